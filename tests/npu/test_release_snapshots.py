"""The emulator built from torch_npu's own artifacts, per release (docs/ascend.md §21).

- Each committed snapshot parses, names its wheel and version, and is what the snapshot script
  derives from its committed excerpts (and, where a wheel is at hand, from the wheel itself).
- Every torch.ops.npu call of every native NPU graph (decode, verify split and masked, extend;
  ND and NZ; FIA v1 and v2), and the calls torch_npu's NPU-graph handler makes to capture it
  (`_get_max_workspace`, `_infer_output`, `.out`), binds to each release's schema and gives each
  release's meta function the shapes and dtypes the stand-ins give: in process, on fake tensors.
- A stand-in that departs from the release (an output shape or dtype, an argument name it reads)
  and a lowered call with an argument the release does not have are caught.
- The emulated NPUGraph captures FIA as the release's handler does (`.default` as `.out`) and
  refuses an update without `auto_dispatch_capture`, as torch_npu does.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dcp_compile.lowering.npu import native_ops
from dcp_compile.testing import npu_standin
from dcp_compile.testing.npu_emulator import releases, snapshot
from dcp_compile.testing.npu_emulator.releases import ReleaseMismatch, overload_name

RELEASES = releases.available()
MODES = [dict(mode="decode"), dict(mode="verify", draft_len=7), dict(mode="verify", draft_len=7, npu_verify="mask"),
         dict(mode="extend", chunk=8), dict(mode="extend", chunk=64)]
FORMATS = [dict(npu_kv_format="nd", fia_version=1), dict(npu_kv_format="nz", fia_version=2)]
CASES = [(mode, fmt) for mode in MODES for fmt in FORMATS] + [
    (MODES[0], dict(npu_kv_format="nz", fia_version=1)), (MODES[0], dict(npu_kv_format="nd", fia_version=2))]
WHEELS_ENV = "DCP_COMPILE_TORCH_NPU_WHEELS"
"""A folder of torch_npu wheels: where set, each snapshot is also regenerated from its wheel."""


def case_id(case) -> str:
    mode, fmt = case
    return "-".join([mode["mode"], str(mode.get("draft_len", mode.get("chunk", 1))), mode.get("npu_verify", "split"),
                     fmt["npu_kv_format"], f"v{fmt['fia_version']}"])


# --- the snapshots -------------------------------------------------------------------------------


def test_three_releases_are_committed_and_2_13_0_is_the_default():
    assert {"2.10.0.post6", "2.13.0", "2.14.0"} <= set(RELEASES)
    assert releases.DEFAULT == "2.13.0"


@pytest.mark.parametrize("version", RELEASES)
def test_each_snapshot_parses_and_names_its_wheel(version):
    release = releases.load(version)
    data = release.snapshot
    assert data["torch_npu"] == version and re.fullmatch(rf"torch_npu-{re.escape(version)}-.+\.whl", data["wheel"])
    assert re.fullmatch(r"[0-9a-f]{64}", data["wheel_sha256"]) and snapshot.META_FILE in data["files"]
    for name, schema in release.schemas.items():
        parsed = torch._C.parse_schema(schema)
        assert (parsed.name if not parsed.overload_name else f"{parsed.name}.{parsed.overload_name}") == name
    assert set(snapshot.LOWERED_OPS) <= set(release.meta_functions) & set(release.schemas)
    meta_text = (release.folder / "meta.py").read_text()
    assert f"torch_npu {version} wheel" in meta_text and "BSD 3-Clause" in meta_text
    assert "import torch_npu" not in meta_text
    assert "Huawei" in (release.folder / "LICENSE").read_text()


@pytest.mark.parametrize("version", RELEASES)
def test_each_snapshot_is_what_its_excerpts_give(version):
    assert snapshot.rederive(releases.load(version).folder) == []


@pytest.mark.parametrize("version", RELEASES)
def test_each_snapshot_is_what_its_wheel_gives_where_the_wheel_is_at_hand(version):
    folder = Path(os.environ.get(WHEELS_ENV, "/nonexistent"))
    wheels = sorted(folder.glob(f"torch_npu-{version}-*.whl"))
    if not wheels:
        pytest.skip(f"no torch_npu {version} wheel in ${WHEELS_ENV}")
    rendered = snapshot.render(snapshot.extract(wheels[0]))
    committed = releases.load(version).folder
    assert {name: (committed / name).read_text() == text for name, text in rendered.items()} == dict.fromkeys(rendered,
                                                                                                             True)


def test_the_lowering_calls_no_npu_op_the_snapshots_leave_out():
    lowering = Path(native_ops.__file__).parent
    named = set()
    for source in lowering.glob("*.py"):
        text = source.read_text()
        named |= set(re.findall(r"torch\.ops\.npu\.(\w+)", text))
        named |= set(re.findall(r"hasattr\(torch\.ops\.npu, \"(\w+)\"\)", text))
    assert named and named <= set(snapshot.LOWERED_OPS), named - set(snapshot.LOWERED_OPS)


def test_the_stand_ins_register_the_selected_releases_schemas():
    npu_standin.register()
    release = npu_standin.release()
    assert release.version == releases.selected_version()
    for name, schema in release.schemas.items():
        op, _, overload = name.partition(".")
        assert getattr(getattr(torch.ops.npu, op), overload or "default")._schema == torch._C.parse_schema(
            "npu::" + schema)


def test_an_unknown_release_is_refused_naming_the_committed_ones(monkeypatch):
    monkeypatch.setenv(releases.ENV, "2.99.0")
    with pytest.raises(ValueError, match=r"2\.99\.0.*2\.13\.0"):
        releases.selected()


# --- every npu call of the native graphs, against every release -----------------------------------


class _NpuCalls(TorchDispatchMode):
    """Records the torch.ops.npu calls made under it (and lets every call through)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        outputs = func(*args, **kwargs)
        if func.namespace == "npu":
            self.calls.append((func, args, kwargs, outputs))
        return outputs


def _value(argument):
    """A node's argument with every node replaced by its example value (fake tensors, SymInts)."""
    if isinstance(argument, torch.fx.Node):
        return argument.meta["val"]
    if isinstance(argument, tuple):
        return tuple(_value(a) for a in argument)
    if isinstance(argument, list):
        return [_value(a) for a in argument]
    if isinstance(argument, dict):
        return {key: _value(value) for key, value in argument.items()}
    return argument


@functools.cache
def npu_calls(case) -> list:
    """(op, args, kwargs, outputs) of every torch.ops.npu call a native graph makes, on its fake
    tensors: its FIA and npu_attention_update nodes, and the npu_scatter_pa_kv_cache calls its
    dcp_npu.scatter_kv_cache nodes make (their Python run on the node's fake values)."""
    from tests.npu.test_native_lowering import lowered

    mode, fmt = dict(case[0]), dict(case[1])
    gm = lowered(mode, fmt)
    calls = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is native_ops.SCATTER_KV_CACHE:
            args = _value(node.args)
            fake_mode = next(a.fake_mode for a in args if isinstance(a, torch.Tensor))
            recorder = _NpuCalls()
            with fake_mode, recorder:
                native_ops.scatter_kv_cache(*args)
            calls += recorder.calls
        elif getattr(node.target, "namespace", "") == "npu":
            calls.append((node.target, _value(node.args), _value(dict(node.kwargs)), node.meta["val"]))
    return calls


def _frozen(case):
    return tuple(tuple(sorted(part.items())) for part in case)


def _capture_calls(release, func, args, kwargs):
    """The calls the release's NPU-graph handler makes to capture this one (its prepare_capture):
    `_get_max_workspace(*args, **kwargs)`, `_infer_output(query, value, **subset)`, then the `.out`
    overload with both; checks each, and that `_infer_output` gives what the op itself gives."""
    handler = release.handler(func.__name__)
    if handler is None or not handler.get("workspace"):
        return 0
    release.check(handler["workspace"], args, kwargs)
    out_args = tuple(args[index] for index in handler["infer_output_args"])
    out_kwargs = {key: kwargs[key] for key in handler["infer_output_kwargs"] if key in kwargs}
    preallocated = release.meta(handler["infer_output"], out_args, out_kwargs)
    release.check(handler["infer_output"], out_args, out_kwargs, preallocated)
    with args[0].fake_mode:
        workspace = torch.empty(1, dtype=torch.uint8, device=args[0].device)
    release.check(handler["capture_as"], args, {**kwargs, "workspace": workspace, "out": list(preallocated)})
    return 3


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_every_npu_call_of_a_native_graph_matches_the_releases_schema_and_meta_function(case, version):
    release = releases.load(version)
    calls = npu_calls(_frozen(case))
    ops = {overload_name(func) for func, *_ in calls}
    fia = "npu_fused_infer_attention_score" + ("_v2" if case[1]["fia_version"] == 2 else "")
    assert {fia, "npu_attention_update", "npu_scatter_pa_kv_cache"} <= ops, ops
    captured = 0
    for func, args, kwargs, outputs in calls:
        release.check(overload_name(func), args, kwargs, outputs)
        captured += _capture_calls(release, func, args, kwargs)
    assert captured == 3 * sum(1 for func, *_ in calls if "fused_infer_attention" in func._opname)


# --- what a departure from the release looks like ----------------------------------------------------


def _first_fia(case=(MODES[0], FORMATS[0])):
    return next(call for call in npu_calls(_frozen(case)) if "fused_infer_attention" in call[0]._opname)


def test_a_lowered_call_with_an_argument_the_release_lacks_is_caught():
    func, args, kwargs, outputs = _first_fia()
    release = releases.load(releases.DEFAULT)
    renamed = {("actual_seq_len_kv" if key == "actual_seq_lengths_kv" else key): value for key, value in kwargs.items()}
    with pytest.raises(ReleaseMismatch, match="has no argument 'actual_seq_len_kv'"):
        release.check(overload_name(func), args, renamed, outputs)
    with pytest.raises(ReleaseMismatch, match=r"block_size is int in its schema, got '128'"):
        release.check(overload_name(func), args, {**kwargs, "block_size": "128"}, outputs)


@pytest.mark.parametrize("departure", ["lse shape", "lse dtype", "out shape"])
def test_a_stand_in_that_departs_from_the_releases_meta_function_fails_at_trace_and_run_time(monkeypatch, departure):
    """The stand-in's fake kernel (trace time) and its npu kernel (run time) are both checked: each
    departure is caught once the stand-in gives it, whatever the stand-in's own validation said."""
    from tests.npu.test_standin import fia_call, make_cache, make_queries

    func, args, kwargs, _ = _first_fia()
    if departure == "lse shape":
        monkeypatch.setattr(npu_standin, "_softmax_lse_shape", lambda a: (a.query.shape[0], a.num_heads, 1))
        run_patch = ("_lse_output", lambda lse, plan, a: lse.new_empty(plan.softmax_lse_shape))
    elif departure == "lse dtype":
        fake_outputs = npu_standin._fake_outputs
        monkeypatch.setattr(npu_standin, "_fake_outputs", lambda q, a: tuple(o.double() for o in fake_outputs(q, a)))
        run_patch = ("_lse_output", lambda lse, plan, a: lse.new_empty(plan.softmax_lse_shape, dtype=torch.float64))
    else:
        monkeypatch.setattr(npu_standin, "_attention_out_shape",
                            lambda a: (*a.query.shape[:-1], a.query.shape[-1] // 2))
        run_patch = ("_from_token_major", lambda tensor, layout, shape: tensor)
    with pytest.raises(ReleaseMismatch, match="its meta function gives"):
        with args[0].fake_mode:
            func(*args, **kwargs)
    monkeypatch.setattr(npu_standin, *run_patch)
    cache, (query, query_rope) = make_cache([5, 9]), make_queries(2)
    call_args, call_kwargs = fia_call(cache, query, query_rope, "BSND", [1, 1])
    with pytest.raises(ReleaseMismatch, match="its meta function gives"):
        torch.ops.npu.npu_fused_infer_attention_score(*call_args, **call_kwargs)


def test_a_stand_in_reading_an_argument_name_the_release_lacks_is_refused(monkeypatch):
    release = releases.load(releases.DEFAULT)
    npu_standin.check_argument_names(release)
    renames = {**npu_standin.V2_RENAMES, "actual_seq_kv_len": "actual_seq_lengths_kv"}
    monkeypatch.setattr(npu_standin, "V2_RENAMES", renames)
    with pytest.raises(ReleaseMismatch, match="actual_seq_kv_len"):
        npu_standin.check_argument_names(release)


# --- NPU graphs by the release's handler and update rules --------------------------------------------


def _captured(auto_dispatch_capture: bool):
    from tests.npu.test_standin import fia_call, make_cache, make_queries

    cache, (query, query_rope) = make_cache([5, 9]), make_queries(2)

    def run(lengths):
        args, kwargs = fia_call(cache, query, query_rope, "BSND", [1, 1], actual_seq_lengths_kv=list(lengths))
        return torch.ops.npu.npu_fused_infer_attention_score(*args, **kwargs)

    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph, auto_dispatch_capture=auto_dispatch_capture):
        outputs = run([5, 9])
    return graph, outputs, run


def test_a_dispatch_capture_records_fia_as_its_out_overload_into_infer_outputs_buffers():
    graph, outputs, run = _captured(auto_dispatch_capture=True)
    (record,) = [r for r in graph._records if r.dispatch]
    assert str(record.func) == "npu.npu_fused_infer_attention_score.out" and "workspace" in record.kwargs
    # the handler's postprocess_result: the caller gets the buffers of _infer_output, which .out writes
    assert [o.data_ptr() for o in outputs] == [o.data_ptr() for o in record.kwargs["out"]]
    assert [r for r in graph.recorded_ops if "fused_infer_attention" in r] == [str(record.func)]
    graph.update(cpu_update_input=[{"actual_seq_lengths_kv": [3, 9]}])
    graph.replay()
    torch.npu.synchronize()
    expected = run([3, 9])
    assert torch.equal(outputs[0].cpu(), expected[0].cpu()) and torch.equal(outputs[1].cpu(), expected[1].cpu())


def test_an_update_of_a_graph_captured_without_auto_dispatch_capture_is_refused_and_its_replay_keeps_the_lengths():
    graph, outputs, run = _captured(auto_dispatch_capture=False)
    with pytest.raises(RuntimeError, match="does not support update"):
        graph.update(cpu_update_input=[{"actual_seq_lengths_kv": [3, 9]}])
    graph.replay()  # no dispatch record, no event to wait on: the host lengths of the capture
    torch.npu.synchronize()
    assert torch.equal(outputs[0].cpu(), run([5, 9])[0].cpu())


def test_an_update_replaces_a_captured_keyword_argument_as_torch_npu_does():
    """update_capture_record replaces any keyword argument the record captured, not only the
    handler's spec keys: a new block table is taken (docs/ascend.md §21.1)."""
    from tests.npu.test_standin import make_cache

    graph, outputs, run = _captured(auto_dispatch_capture=True)
    other = make_cache([5, 9], seed=7)
    (record,) = [r for r in graph._records if r.dispatch]
    graph.update(cpu_update_input=[{"block_table": other.block_table, "actual_seq_lengths_kv": [5, 9]}])
    assert record.kwargs["block_table"] is other.block_table


def test_a_release_whose_count_check_compared_the_records_with_themselves_leaves_the_rest_unupdated(monkeypatch):
    """The 7.3.0 line's update_capture_record (docs/ascend.md §9.3): two dicts for three records are
    taken; the third record keeps waiting for its update, so the replay would hang."""
    from tests.npu.test_standin import fia_call, make_cache, make_queries

    release = releases.active()
    rule = {**release.update_rule, "count_check": "none: compares the records with themselves"}
    old_line = dict(release.snapshot, npugraph={**release.snapshot["npugraph"], "update": rule})
    monkeypatch.setattr(releases, "_active", releases.Release(release.version, release.folder, old_line,
                                                              release.meta_functions))
    cache, (query, query_rope) = make_cache([5, 9]), make_queries(2)
    args, kwargs = fia_call(cache, query, query_rope, "BSND", [1, 1], actual_seq_lengths_kv=[5, 9])
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph, auto_dispatch_capture=True):
        for _ in range(3):
            torch.ops.npu.npu_fused_infer_attention_score(*args, **kwargs)
    graph.update(cpu_update_input=[{"actual_seq_lengths_kv": [5, 9]}] * 2)
    with pytest.raises(RuntimeError, match="1 recorded FIA call.*would hang"):
        graph.replay()
