"""NPU graphs on the emulated npu device: what the torchair inner compiler is handed (torchair
itself faked: it needs torch_npu), the graph runner's logic on a fake graph back end (buckets,
the FIA lengths pushed before each replay, a skipped update caught in debug mode), and
bench.npu_smoke in its stand-in mode (the emulated device). Replays from the emulator's own
NPU graphs: tests/npu/test_defects.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dcp_compile
from bench.lib import result as results
from dcp_compile.lowering import npu as npu_lowering
from dcp_compile.lowering.base import Unsupported
from dcp_compile.lowering.npu import inner_compile
from dcp_compile.models.mla import MLAModel
from dcp_compile.runtime import devices
from dcp_compile.runtime.batch import RequestTable
from dcp_compile.runtime.graph_runner import GraphRunner, StaleHostLengthsError
from tests.npu.models import TINY_512

ROOT = Path(__file__).resolve().parents[2]
npu_lowering.ensure_ops()
FIA = torch.ops.npu.npu_fused_infer_attention_score.default
NPU = "npu"  # a device of the emulator, installed by the fixture of tests/npu/conftest.py: not at import


def npu_model(**config):
    model = MLAModel(TINY_512, 2048, max_requests=4, dtype=torch.bfloat16, page_size=16, device=NPU)
    return dcp_compile.apply(model, 1, kernels="npu", **config)


def test_torchair_is_handed_symbolic_fia_lengths(monkeypatch):
    handed = []

    def fake_torchair(mode):
        assert mode == "reduce-overhead"

        def compile_graph(gm, example_inputs):
            handed.append((gm, list(example_inputs)))
            return gm.forward

        return compile_graph

    monkeypatch.setattr(inner_compile, "torchair_compiler", fake_torchair)
    monkeypatch.setattr(inner_compile, "torchair_missing", lambda mode: None)
    model, eager = npu_model(inner_compile="torchair"), npu_model()
    tables = [RequestTable(4, 64, 2048, 16) for _ in range(2)]
    outs = []
    for step in range(21):  # a prefill, then 20 decode steps whose lengths all change
        tokens = [[1] * 5, [2] * 9, [3]] if step == 0 else [[step]] * 3
        for m, table in zip((model, eager), tables):
            batch = table.extend_batch([0, 1, 2], tokens, pad_rows=1)
            outs.append(m(*batch.to(NPU).args(), host_metadata=batch.host))
        assert outs[-1].device.type == NPU and torch.equal(outs[-2], outs[-1])
    assert len(handed) == 2  # the prefill (TND: at most 16 tokens a row) and the decode graph, once each
    gm, example_inputs = handed[1]
    fia = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is FIA)
    lengths = fia.kwargs["actual_seq_lengths_kv"]
    assert all(isinstance(n.meta["val"], torch.SymInt) and n.op == "placeholder" for n in lengths)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    symbolic = [example for node, example in zip(placeholders, example_inputs) if node in lengths]
    assert len(symbolic) == 4 and all(isinstance(v, torch.SymInt) for v in symbolic)


@pytest.mark.skipif(devices.torch_npu_installed(), reason="torch_npu ships torchair")
def test_inner_compile_torchair_without_torchair_is_refused_at_apply():
    """Where torchair is missing (the emulated device has none: it ships with torch_npu), apply()
    refuses inner_compile='torchair' naming what is missing and what to do, instead of dynamo's
    compiler failure at the first step."""
    with pytest.raises(Unsupported, match=r"inner_compile='torchair' needs torchair, which ships with torch_npu.*"
                                          r"inner_compile='eager'"):
        npu_model(inner_compile="torchair")


class FakeGraphs:
    """A graph back end that captures nothing: capture runs the step once on the npu device;
    replay records the FIA lengths pushed to the graph (or drops them, to stand for an update
    that did not happen)."""

    def __init__(self, drop_updates: bool = False, device: str = NPU):
        self.device = torch.device(device)
        self.drop_updates, self.captures, self.pushed = drop_updates, 0, []
        self._applied = {}

    def capture(self, run):
        self.captures += 1
        return object(), run()

    def replay(self, graph, updates):
        self.pushed.append(updates)
        if not self.drop_updates:
            self._applied[id(graph)] = updates

    def applied(self, graph):
        return self._applied.get(id(graph))


def runner_and_table(graphs, **runner_args):
    model = npu_model()
    table = RequestTable(4, 64, 2048, 16)
    prefill = table.extend_batch([0, 1, 2], [[1] * 5, [2] * 20, [3] * 2])
    model(*prefill.to(NPU).args(), host_metadata=prefill.host)
    state = dcp_compile.state(model)
    runner = GraphRunner(model.compiled("gather-q"), buckets=(1, 2, 4), graphs=graphs, host_slot=state.host_slot,
                         **runner_args)
    return runner, table


def test_runner_pushes_the_current_fia_lengths_before_every_replay():
    graphs = FakeGraphs()
    runner, table = runner_and_table(graphs, debug=True)
    assert [runner.bucket_for(rows) for rows in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, None]
    layers = TINY_512.num_mla_layers
    runner(table.extend_batch([0, 1, 2], [[1]] * 3))
    assert graphs.pushed[-1] == [{"actual_seq_lengths_kv": [6, 21, 3, 0]}] * layers  # padded to the bucket of 4
    runner(table.extend_batch([0, 1, 2], [[1]] * 3))
    assert graphs.pushed[-1] == [{"actual_seq_lengths_kv": [7, 22, 4, 0]}] * layers  # after an append
    verify = table.extend_batch([0, 1, 2], [[1] * 3] * 3, all_logits=True)
    runner(verify, tokens_per_row=3)
    assert graphs.pushed[-1] == [{"actual_seq_lengths": [3, 6, 9, 12], "actual_seq_lengths_kv": [7, 22, 4, 0]}] * layers
    for request in range(3):  # reject every draft
        table.truncate(request, int(table.seq_lens[request]) - 2)
    runner(table.extend_batch([0, 1, 2], [[1]] * 3))
    assert graphs.pushed[-1] == [{"actual_seq_lengths_kv": [9, 24, 6, 0]}] * layers  # after the reject
    assert graphs.captures == 2  # one decode graph, one verify graph
    with pytest.warns(UserWarning, match="exceeds the largest captured bucket"):
        runner(table.extend_batch([0, 1, 2], [[1]] * 3, pad_rows=2))  # 5 rows: eager


def test_a_skipped_fia_update_is_caught_in_debug_mode():
    runner, table = runner_and_table(FakeGraphs(drop_updates=True), debug=True)
    with pytest.raises(StaleHostLengthsError, match="not refreshed"):
        runner(table.extend_batch([0, 1, 2], [[1]] * 3))


def test_npu_smoke_script_runs_on_the_standins(tmp_path):
    out = tmp_path / "smoke.json"
    # The default kernels only: the Triton option's interpreter run is its own tests' cost
    # (tests/distributed/test_npu_lowering.py); which cases each kernel set gets is checked below.
    done = subprocess.run([sys.executable, "-m", "bench.npu_smoke", "--standin", "--kernels", "native", "--out",
                           str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    result = results.read(out)
    assert result["schema"] == results.SCHEMA and result["benchmark"] == "npu_smoke"
    assert {"command", "date", "machine", "versions"} <= set(result) and "shapes" in result["run"]
    verdicts, layer = results.rows(result, "correctness"), results.rows(result, "attention_layer")
    # --standin: the script's check, one decode case and the last --combos entry's verify (nz, v2, mask)
    assert [(v["mode"], v["npu_kernels"]) for v in verdicts] == [("decode", "native"), ("verify", "native")]
    assert {k: verdicts[1][k] for k in ("npu_kv_format", "fia_version", "npu_verify")} == dict(
        npu_kv_format="nz", fia_version=2, npu_verify="mask")
    assert all(v["tokens_match"] and v["outputs_match"] for v in verdicts)
    assert {(r["dcp_size"], r["context"], r["batch"], r["npu_kv_format"], r["fia_version"], r["npu_kernels"])
            for r in layer} == {(n, 300, 4, "nz", 2, "native") for n in (1, 2)}
    assert all(r["step_seconds"] > 0 for r in layer)


def test_npu_smoke_times_both_kernel_sets_side_by_side():
    from bench import npu_smoke

    args = npu_smoke.parse_args(["--kernels", "native,triton", "--combos", "nd:1:split,nz:2:mask"])
    assert npu_smoke._layouts(args) == [dict(npu_kv_format=f, fia_version=v, npu_kernels=k)
                                        for f, v in (("nd", 1), ("nz", 2)) for k in ("native", "triton")]


@pytest.mark.parametrize("message, advice", [
    ("aclmdlRICaptureEnd failed: Alloc sq cq fail", "upgrade the HDK to 25.5.1"),
    ("HCCL error code 507903", "HCCL_OP_EXPANSION_MODE=AIV"),
])
def test_a_known_capture_error_says_what_to_do(monkeypatch, message, advice):
    """The capture errors the engines know (an old driver, an HCCL collective inside a capture) are
    raised with what to do; any other error is raised as it is."""
    from dcp_compile.runtime.graph_runner import NPUGraphs

    graphs = NPUGraphs()

    def failing_graph(*args, **kwargs):
        raise RuntimeError(message)

    monkeypatch.setattr(torch.npu, "graph", failing_graph)
    with pytest.raises(RuntimeError, match=f"NPU graph capture failed: .*{advice}"):
        graphs.capture(lambda: torch.zeros(1, device=NPU))
    monkeypatch.setattr(torch.npu, "graph", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("other")))
    with pytest.raises(RuntimeError, match="^other$"):
        graphs.capture(lambda: torch.zeros(1, device=NPU))
