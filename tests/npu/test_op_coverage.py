"""The emulated npu device knows which aten ops torch_npu runs on the device: op-plugin's table
(npu_aten_ops.py, regenerated from the yaml by regenerate_op_table.py) and the kernels' own CPU
fallbacks (op_coverage.FALLBACKS). An op off the device raises in an NPU graph capture and counts
a host sync outside one; the project's NPU graphs hold none. The table spans the project's torch
range (2.10 to 2.13) and marks the ops with an acl_op kernel only: on the device in eager, refused in
a capture (only aclnn kernels enter an NPU graph); the native graphs call none."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch.utils import _pytree as pytree

import dcp_compile
from dcp_compile.models.mla import MLAModel
from dcp_compile.ops import reference
from dcp_compile.runtime.batch import RequestTable
from dcp_compile.runtime.graph_runner import GraphRunner, NPUGraphs
from dcp_compile.testing import npu_emulator
from dcp_compile.testing.npu_emulator import npu_aten_ops, op_coverage, regenerate_op_table
from dcp_compile.testing.npu_emulator.graphs import CaptureError
from tests.npu.models import TINY_512

NPU = "npu"
OP_PLUGIN_COMMIT = "517f2e7d0f202f38b76310706cb977ca2388ad21"
TORCH_NPU_COMMIT = "9e73e708ab9350d203475609f36f8a43f6a0c2ab"
PYPROJECT = Path(__file__).parents[2] / "pyproject.toml"

SAMPLE_OP_PLUGIN = """\
all_version: [v2.1, v2.5, v2.10, v2.11, v2.12, v2.13, v2.14]
official:
  - func: abs(Tensor self) -> Tensor
    acl_op: all_version
    op_api: all_version

  - func: scatter_reduce.two(Tensor self, int dim, Tensor index, Tensor src, str reduce, *, bool include_self=True) -> Tensor
    op_api: all_version
    gen_opapi:
      exec: aclnnScatterReduce

  - func: old_op(Tensor self) -> Tensor
    acl_op: [v2.1, v2.12]

  - func: split_op(Tensor self) -> Tensor
    acl_op: [v2.1, v2.11]

  - func: split_op(Tensor self) -> Tensor
    op_api: [v2.12, newest]

  - func: listed_op.out(Tensor self, *, Tensor(a!) out) -> Tensor(a!)
    op_api: v2.11, v2.12, v2.13

  - func: new_op(Tensor self) -> Tensor
    op_api: [v2.11, newest]

  - func: acl_only_op(Tensor self) -> Tensor
    acl_op: all_version

autograd:
  - func: _thnn_fused_gru_cell(Tensor input_gates) -> (Tensor, Tensor)
    op_api: [v2.5, newest]

custom:
  - func: npu_special(Tensor self) -> Tensor
    op_api: all_version

symint:
  - func: embedding(Tensor weight, Tensor indices, SymInt padding_idx=-1) -> Tensor
    op_api: [v2.1, newest]
  - func: npu_other(Tensor self) -> Tensor
    op_api: all_version
"""

SAMPLE_TORCH_NPU = """\
backend: NPU
supported:
  - _local_scalar_dense
  - func: copy_
    op_api: True

custom:
  - func: npu_format_cast(Tensor self) -> Tensor
"""


def test_the_table_names_its_sources_and_commits():
    assert npu_aten_ops.SOURCES == (
        f"Ascend/op-plugin op_plugin/config/op_plugin_functions.yaml @ {OP_PLUGIN_COMMIT}",
        f"Ascend/pytorch torch_npu/csrc/aten/npu_native_functions.yaml @ {TORCH_NPU_COMMIT}")
    assert OP_PLUGIN_COMMIT in npu_aten_ops.__doc__ and TORCH_NPU_COMMIT in npu_aten_ops.__doc__
    assert npu_aten_ops.VERSIONS == regenerate_op_table.VERSIONS
    assert {"scatter_reduce.two", "searchsorted.Tensor", "index_select", "mm", "copy_"} <= npu_aten_ops.CAPTURABLE
    assert not any(op.startswith("npu_") for op in npu_aten_ops.OPS)
    # the read of op-plugin @ 517f2e7d: no other aten op lacks an op_api kernel on 2.10-2.13
    assert npu_aten_ops.ACL_OP_ONLY == {"lstm_cell", "slow_conv3d_forward", "slow_conv3d_forward.output"}
    assert npu_aten_ops.CAPTURABLE | npu_aten_ops.ACL_OP_ONLY == npu_aten_ops.OPS
    assert "npugraph.md:40" in npu_aten_ops.CAPTURE_RULE


def test_the_table_spans_the_projects_torch_range_from_its_2_10_floor():
    major, floor, ceiling_major, ceiling = map(int, re.search(r'"torch>=(\d+)\.(\d+),<(\d+)\.(\d+)"',
                                                              PYPROJECT.read_text()).groups())
    assert major == ceiling_major
    supported = tuple(f"v{major}.{minor}" for minor in range(floor, ceiling))
    assert npu_aten_ops.VERSIONS == regenerate_op_table.VERSIONS == supported == ("v2.10", "v2.11", "v2.12", "v2.13")


def test_an_op_registered_only_from_v2_11_is_left_out():
    ops = regenerate_op_table.op_plugin_ops(SAMPLE_OP_PLUGIN)
    assert "new_op" not in ops and "listed_op.out" not in ops
    from_2_11 = regenerate_op_table.op_plugin_ops(SAMPLE_OP_PLUGIN, ("v2.11", "v2.12", "v2.13"))
    assert {"new_op", "listed_op.out"} <= from_2_11


def test_an_acl_op_only_op_is_not_capturable_and_an_op_api_one_is():
    ops = regenerate_op_table.op_plugin_ops(SAMPLE_OP_PLUGIN)
    capturable = regenerate_op_table.op_api_ops(SAMPLE_OP_PLUGIN)
    assert {"abs", "scatter_reduce.two", "embedding"} <= capturable  # abs: acl_op and op_api
    # acl_only_op has no op_api; split_op's op_api starts at v2.12, so 2.10 and 2.11 run its acl_op
    assert {"acl_only_op", "split_op"} <= ops - capturable
    assert "split_op" in regenerate_op_table.op_api_ops(SAMPLE_OP_PLUGIN, ("v2.12", "v2.13"))


def test_the_script_regenerates_a_table_from_a_sample_yaml(tmp_path):
    (tmp_path / "op_plugin.yaml").write_text(SAMPLE_OP_PLUGIN)
    (tmp_path / "torch_npu.yaml").write_text(SAMPLE_TORCH_NPU)
    out = tmp_path / "table.py"
    regenerate_op_table.main(["--op-plugin", str(tmp_path / "op_plugin.yaml"), "--op-plugin-commit", "abc123",
                              "--torch-npu", str(tmp_path / "torch_npu.yaml"), "--torch-npu-commit", "def456",
                              "--out", str(out)])
    namespace: dict = {}
    exec(out.read_text(), namespace)
    # old_op stops at v2.12; listed_op.out and new_op start at v2.11; split_op is the union of its two
    # entries; npu_ ops and custom: are not aten
    assert namespace["OPS"] == {"abs", "scatter_reduce.two", "split_op", "acl_only_op", "_thnn_fused_gru_cell",
                                "embedding", "_local_scalar_dense", "copy_"}
    # torch_npu's own ops (allocation, copies, views) count as capturable
    assert namespace["ACL_OP_ONLY"] == {"split_op", "acl_only_op"}
    assert namespace["CAPTURABLE"] == namespace["OPS"] - {"split_op", "acl_only_op"}
    assert namespace["SOURCES"] == ("Ascend/op-plugin op_plugin/config/op_plugin_functions.yaml @ abc123",
                                    "Ascend/pytorch torch_npu/csrc/aten/npu_native_functions.yaml @ def456")
    # The checked-in table is this script's output, byte for byte, for its own sources' sets.
    table = regenerate_op_table.render(set(npu_aten_ops.OPS), set(npu_aten_ops.CAPTURABLE), OP_PLUGIN_COMMIT,
                                       TORCH_NPU_COMMIT)
    assert table == regenerate_op_table.TABLE.read_text()


def _amin_inputs():
    ids = torch.tensor([0, 0, 1, 1, 1], device=NPU)
    positions = torch.tensor([5, 6, 2, 3, 4], device=NPU)
    return torch.full((3,), 99, dtype=torch.int64, device=NPU), ids, positions


def test_an_int64_scatter_reduce_amin_raises_in_a_capture_and_syncs_the_host_outside():
    first, ids, positions = _amin_inputs()
    with pytest.raises(CaptureError, match=r"scatter_reduce\.two runs on the host under torch_npu.*test_op_coverage"):
        with torch.npu.graph(torch.npu.NPUGraph()):
            first.scatter_reduce(0, ids, positions, "amin")
    npu_emulator.reset_host_syncs()
    out = first.scatter_reduce(0, ids, positions, "amin")
    assert npu_emulator.host_syncs() >= 1
    assert npu_emulator.ops_off_device() == {"aten::scatter_reduce.two": 1}
    assert out.cpu().tolist() == [5, 2, 99]


def test_a_covered_op_and_the_fp32_sum_scatter_stay_on_the_device():
    first, ids, positions = _amin_inputs()
    values = torch.ones(5, device=NPU)
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        total = torch.zeros(3, device=NPU).scatter_reduce(0, ids, values, "sum")
        found = positions.index_select(0, ids) + 1
    assert "aten.scatter_reduce.two" in graph.recorded_ops
    npu_emulator.reset_host_syncs()
    graph.replay()
    torch.zeros(3, device=NPU).scatter_reduce(0, ids, values, "sum")
    torch.searchsorted(ids, torch.arange(3, device=NPU))
    assert npu_emulator.host_syncs() == 0 and npu_emulator.ops_off_device() == {}
    assert total.cpu().tolist() == [2.0, 3.0, 0.0] and found.cpu().tolist() == [6, 6, 7, 7, 7]


def test_a_blocking_device_to_host_read_is_a_host_sync():
    values = torch.arange(4, device=NPU)
    npu_emulator.reset_host_syncs()
    values.sum().item()
    values.tolist()
    values.cpu()
    assert npu_emulator.host_syncs() == 3 and npu_emulator.ops_off_device() == {}


def test_an_op_without_an_npu_kernel_is_off_the_device():
    """aten::mode has a CPU kernel and none in op-plugin: torch_npu runs it on the host."""
    assert "mode" not in npu_aten_ops.OPS
    values = torch.tensor([3, 1, 3, 2], device=NPU)
    with pytest.raises(CaptureError, match=r"aten\.mode\.default runs on the host"):
        with torch.npu.graph(torch.npu.NPUGraph()):
            torch.mode(values)
    npu_emulator.reset_host_syncs()
    assert int(torch.mode(values).values.cpu()) == 3
    assert npu_emulator.ops_off_device() == {"aten::mode": 1} and npu_emulator.host_syncs() == 2  # the op, the read
    assert not op_coverage.off_device(torch.ops.aten.mm.default, (torch.zeros(2, 2), torch.zeros(2, 2)), {})


def _conv3d(images, weight):
    return torch.ops.aten.slow_conv3d_forward(images, weight, [2, 2, 2], None, [1, 1, 1], [0, 0, 0])


def _lstm_cell(inputs, hidden, cell, input_weights, hidden_weights, input_bias, hidden_bias):
    return torch.ops.aten.lstm_cell(inputs, [hidden, cell], input_weights, hidden_weights, input_bias, hidden_bias)


@pytest.mark.parametrize("name, op, shapes", [
    ("slow_conv3d_forward", _conv3d, [(1, 2, 3, 3, 3), (4, 2, 2, 2, 2)]),
    # torch's kernel is a composite, which torch_npu's replaces: the capture meets the op whole
    ("lstm_cell", _lstm_cell, [(2, 3), (2, 4), (2, 4), (16, 3), (16, 4), (16,), (16,)]),
])
def test_an_acl_op_only_op_raises_in_a_capture_and_runs_on_the_device_in_eager(name, op, shapes):
    """op-plugin gives these ops an acl_op kernel only: torch_npu runs them on the device, and an NPU
    graph, which captures aclnn kernels only, cannot record them."""
    assert name in npu_aten_ops.ACL_OP_ONLY
    inputs = [torch.randn(shape) for shape in shapes]
    on_device = [tensor.to(NPU) for tensor in inputs]
    with pytest.raises(CaptureError, match=rf"aten\.{name}\.default runs on the device under torch_npu through an "
                                           r"acl_op kernel only.*npugraph\.md:40.*test_op_coverage"):
        with torch.npu.graph(torch.npu.NPUGraph()):
            op(*on_device)
    npu_emulator.reset_host_syncs()
    out = op(*on_device)
    assert npu_emulator.host_syncs() == 0 and npu_emulator.ops_off_device() == {}
    torch.testing.assert_close(pytree.tree_map(torch.Tensor.cpu, out), op(*inputs))


def _old_first_query_positions(q_seq_ids, q_positions, rows):
    first = torch.full((rows,), reference.NEVER_VISIBLE, dtype=q_positions.dtype, device=q_positions.device)
    return first.scatter_reduce(0, q_seq_ids, q_positions, "amin")


@pytest.mark.parametrize("tokens, pad_to", [
    ([[1] * 3, [1] * 7, [1], [1] * 16], None),   # verify-like, mixed
    ([[1]] * 4, 6),                              # decode, two padded rows
    ([[1] * 4, [1] * 4], 4),                     # verify, padded rows of 4 tokens each
])
def test_first_query_positions_match_the_scatter_definition(tokens, pad_to):
    table = RequestTable(6, 80, 4096, 16)
    table.extend_batch([0, 1, 2, 3], [[1] * 1, [1] * 2, [1] * 37, [1] * 5])
    requests = list(range(len(tokens)))
    batch = table.extend_batch(requests, tokens)
    if pad_to is not None:
        batch = batch.padded(pad_to, len(tokens[0]))
    rows = batch.seq_lens.shape[0] + 1  # and a row without queries at the end
    expected = _old_first_query_positions(batch.q_seq_ids, batch.positions, rows)
    assert torch.equal(reference.first_query_positions(batch.q_seq_ids, batch.positions, rows), expected)
    on_device = reference.first_query_positions(batch.q_seq_ids.to(NPU), batch.positions.to(NPU), rows)
    assert torch.equal(on_device.cpu(), expected)
    empty = torch.zeros(0, dtype=torch.int64)
    assert reference.first_query_positions(empty, empty, 3).tolist() == [reference.NEVER_VISIBLE] * 3


@pytest.mark.parametrize("options, page_size", [
    (dict(), 16),  # ND, FIA v1, split verify: the defaults
    (dict(npu_kv_format="nz", fia_version=2, npu_verify="mask"), 128),
], ids=["nd-v1-split", "nz-v2-mask"])
def test_the_native_decode_and_verify_graphs_run_every_op_on_the_device_and_capture_only_aclnn_ops(options, page_size):
    """An NPU model (two MLA layers, npu_kernels='native') captured and replayed by a graph runner:
    no op of either graph runs on the host, nor calls an acl_op-only kernel (the capture would raise),
    and neither do the eager prefill or the replays (the Triton launchers' own ops run there)."""
    model = MLAModel(TINY_512.with_layers(2), 1024, max_requests=4, dtype=torch.bfloat16, page_size=page_size,
                     device=NPU)
    model = dcp_compile.apply(model, 1, kernels="npu", **options)
    table = RequestTable(4, 96, 1024, page_size)
    npu_emulator.reset_host_syncs()
    prefill = table.extend_batch([0, 1, 2], [[3] * 15, [4] * 31, [5]], pad_rows=1)
    model(*prefill.to(NPU).args(), host_metadata=prefill.host)
    state = dcp_compile.state(model)
    runner = GraphRunner(model.compiled("gather-q"), buckets=(4,), graphs=NPUGraphs(), host_slot=state.host_slot,
                         watched=state.kv_pool.storage())
    for step in range(2):
        runner(table.extend_batch([0, 1, 2], [[1 + step], [2], [3]]))
        runner(table.extend_batch([0, 1, 2], [[1] * 7, [2] * 7, [3] * 7], all_logits=True), 7)
    assert sorted(runner.captured) == [(4, 1, 96), (4, 7, 96)]
    recorded = [r.func for captured in runner.captured.values() for r in captured.graph._records]
    names = [str(func) for func in recorded]
    # FIA is recorded as its .out overload, as torch_npu's NPU-graph handler captures it
    fia = "npu_fused_infer_attention_score" + ("_v2" if options.get("fia_version") == 2 else "")
    assert f"npu.{fia}.out" in names and "aten.scatter_reduce.two" not in names
    aten_ops = {func for func in recorded if getattr(func, "namespace", "") == "aten"}
    assert aten_ops and [str(func) for func in aten_ops if not op_coverage.capturable(func)] == []
    assert npu_emulator.ops_off_device() == {}
