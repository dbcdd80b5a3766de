"""npu_kernels='native' (the default) at the graph level: every NPU graph of decode, verify (split
and masked) and extend, ND and NZ, FIA v1 and v2, holds no dcp_triton op; the page table is not
read on the device (its placeholder is tagged for the host feed and has no user), so a graph
runner need not copy it; npu_kernels='triton' keeps the Triton kernels. Numerics of the native
ops: test_native_ops.py; end to end against dcp_size 1: tests/distributed/test_npu_lowering.py."""

from __future__ import annotations

import itertools

import pytest
import torch

import dcp_compile
from dcp_compile.debug import fake_capture
from dcp_compile.lowering.base import Unsupported
from dcp_compile.lowering.npu import native_ops
from dcp_compile.runtime.host_inputs import BATCH_INPUT, CAPTURE_SKIPPED
from dcp_compile.models.mla import MLAModel
from dcp_compile.passes import PassManager
from dcp_compile.models.config import preset
from tests.npu.models import TINY_512

MODES = [dict(mode="decode"), dict(mode="verify", draft_len=7), dict(mode="verify", draft_len=7, npu_verify="mask"),
         dict(mode="extend", chunk=8), dict(mode="extend", chunk=64)]
FORMATS = [dict(npu_kv_format="nd", fia_version=1), dict(npu_kv_format="nz", fia_version=2)]


def lowered(mode: dict, options: dict, dcp_size: int = 2, debug_checks: bool = False):
    fields = {k: v for k, v in mode.items() if k != "npu_verify"}
    options = {**options, **({"npu_verify": mode["npu_verify"]} if "npu_verify" in mode else {})}
    spec = fake_capture.GraphSpec(model="tiny-512", kernels="npu", block_size=128, dcp_size=dcp_size, tp_size=dcp_size,
                                  batch=3, context=300, options=options, debug_checks=debug_checks, **fields)
    captured = fake_capture.capture(spec)
    PassManager(captured.pass_config(), passes=captured.passes()).run(captured.gm)
    return captured.gm


def targets_of(gm) -> set[str]:
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


def case_id(case) -> str:
    mode, options, dcp_size = case
    return "-".join([mode["mode"], str(mode.get("draft_len", mode.get("chunk", 1))), mode.get("npu_verify", "split"),
                     options["npu_kv_format"], f"v{options['fia_version']}", f"dcp{dcp_size}"])


CASES = list(itertools.product(MODES, FORMATS, (1, 2)))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_a_native_graph_holds_no_triton_op(case):
    mode, options, dcp_size = case
    gm = lowered(mode, options, dcp_size)
    ops = targets_of(gm)
    assert not any(op.startswith("dcp_triton") for op in ops), sorted(ops)
    assert "dcp_npu.scatter_kv_cache.default" in ops  # the KV write is npu_scatter_pa_kv_cache's
    # Chunks of any length run FIA (over pieces of 16 queries), never the dense fallback
    assert any("npu_fused_infer_attention_score" in op for op in ops) and "dcp_npu.partial_attention.default" not in ops


@pytest.mark.parametrize("debug_checks", [False, True], ids=["default", "debug-checks"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m["mode"] + str(m.get("chunk", "")) + m.get("npu_verify", ""))
def test_the_page_table_is_not_read_on_the_device(mode, debug_checks):
    """FIA reads the KV through the host-fed block table and the window through the step's own
    tokens: req_to_token (64 MiB at 64 rows x 128k) need not reach the device. The debug checks
    read it, outside captures only: a replayed graph holds nothing of them."""
    gm = lowered(mode, FORMATS[0], debug_checks=debug_checks)
    tagged = [n for n in gm.graph.nodes if n.op == "placeholder" and n.meta.get(BATCH_INPUT) == "req_to_token"]
    assert len(tagged) == 1 and all(user.meta.get(CAPTURE_SKIPPED) for user in tagged[0].users)
    assert bool(tagged[0].users) == debug_checks
    assert "dcp.guard_batch.default" not in targets_of(gm) and "dcp_npu.guard_tokens.default" in targets_of(gm)


def test_the_triton_option_keeps_the_triton_kernels():
    ops = targets_of(lowered(dict(mode="verify", draft_len=7), {**FORMATS[0], "npu_kernels": "triton"}))
    assert {"dcp_triton.sharded_kv_write.default", "dcp_triton.window_attention.default"} <= ops
    assert "dcp_npu.scatter_kv_cache.default" not in ops


def test_native_is_the_default_and_triton_is_opt_in(npu_emulator):
    model = MLAModel(TINY_512, kv_capacity=1024, max_requests=2, device=npu_emulator, page_size=128,
                     dtype=torch.bfloat16)
    state = dcp_compile.state(dcp_compile.apply(model, 1, kernels="npu"))
    assert state.lowering.options.npu_kernels == "native"


@pytest.mark.parametrize("soc, cann, match", [("Ascend910B3", "8.3.0", "CANN >= 8.5.0"),
                                              ("Ascend310P3", "8.5.0", "no known family")])
def test_apply_refuses_a_deployment_outside_the_matrix(npu_emulator, monkeypatch, soc, cann, match):
    monkeypatch.setenv("DCP_COMPILE_NPU_EMULATOR_SOC", soc)
    monkeypatch.setenv("DCP_COMPILE_NPU_EMULATOR_CANN", cann)
    model = MLAModel(TINY_512, kv_capacity=1024, max_requests=2, device=npu_emulator, page_size=128,
                     dtype=torch.bfloat16)
    with pytest.raises(Unsupported, match=match):
        dcp_compile.apply(model, 1, kernels="npu")


def test_the_slot_mapping_is_computed_once_per_graph():
    gm = lowered(dict(mode="verify", draft_len=7), FORMATS[0])
    slots = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is native_ops.SLOT_MAPPING]
    writes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is native_ops.SCATTER_KV_CACHE]
    assert len(slots) == 1 and len(writes) == preset("tiny-512").num_mla_layers
    assert all(w.args[3] is slots[0] for w in writes)


@pytest.mark.parametrize("chunk, pieces", [(64, 14), (8, 4)])
def test_a_split_graph_runs_fia_over_pieces_of_sixteen_queries(chunk, pieces):
    """T = 3 rows x chunk tokens: FIA's TND call takes one length per piece, as many as a batch of
    that shape can cut into (3 x 64 as 1 + 1 + 190 tokens: 14 pieces; 24 as 1 + 1 + 22: 4), its
    block table one row per piece; a batch of fewer pieces pads with empty ones."""
    gm = lowered(dict(mode="extend", chunk=chunk), FORMATS[0])
    fia = next(n for n in gm.graph.nodes if n.op == "call_function" and "npu_fused_infer_attention_score" in str(n.target))
    assert fia.kwargs["input_layout"] == "TND"
    assert len(fia.kwargs["actual_seq_lengths"]) == len(fia.kwargs["actual_seq_lengths_kv"]) == pieces
    assert fia.kwargs["block_table"].meta["val"].shape[0] == pieces


def test_a_step_of_more_pieces_than_fia_takes_is_refused():
    with pytest.raises(ValueError, match="at most 4096"):
        lowered(dict(mode="extend", chunk=30000), FORMATS[0])
