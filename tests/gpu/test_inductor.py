"""The lowered graph under inductor on one GPU (issue 20): FlashInfer and Triton attention with
inductor compiling the rest of the model, against the same model run eagerly, step by step
(prefill, decode, verify k = 7 and 16, extend), and replayed from CUDA graphs while the lengths
and block tables change. Skipped where FlashInfer does not serve the GPU."""

from __future__ import annotations

import pytest
import torch

import dcp_compile
from dcp_compile.runtime.batch import RequestTable
from dcp_compile.runtime.graph_runner import GraphRunner
from tests.gpu.test_flashinfer import REASON, _model

served = pytest.mark.skipif(REASON is not None, reason=str(REASON))
STEPS = ([[[5] * 37, [6], [7] * 300]] + [[[1], [2], [3]]] * 2 + [[[1] * 7] * 3, [[4] * 16] * 3, [[2] * 37] * 3]
         + [[[1], [2], [3]]])
"""Prefill, decode twice, verify k = 7, verify k = 16, an extend chunk of 37, decode."""


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return (got.float() - expected.float()).abs().max().item() / expected.float().abs().max().item()


def worst_step_difference(model, reference) -> float:
    """The largest relative logits difference of `model` from `reference` over STEPS, with a padded row."""
    tables, worst = [RequestTable(4, 2048, 8192, 16) for _ in range(2)], 0.0
    for tokens in STEPS:
        logits = []
        for m, table in zip((model, reference), tables):
            batch = table.extend_batch([0, 1, 2], tokens, pad_rows=1, all_logits=True)
            logits.append(m(*batch.to("cuda").args(), host_metadata=batch.host))
        assert torch.isfinite(logits[0]).all()
        worst = max(worst, relative(*logits))
    return worst


@served
@pytest.mark.parametrize("kernels", ["flashinfer", "triton"])
def test_inductor_matches_eager_step_by_step(kernels):
    models = {inner: _model(kernels, inner_compile=inner) for inner in ("inductor", "eager")}
    assert dcp_compile.state(models["inductor"]).config.inner_compile == "inductor"
    worst = worst_step_difference(models["inductor"], models["eager"])
    print(f"{kernels}: inductor vs eager, bf16: worst |diff| / max|logits| = {worst:.3g}")
    assert worst < 2e-2


@served
def test_flashinfer_under_inductor_replays_from_cuda_graphs_as_lengths_change():
    eager, graphed = _model("flashinfer"), _model("flashinfer", inner_compile="inductor")
    tables = [RequestTable(4, 2048, 8192, 16) for _ in range(2)]
    for model, table in zip((eager, graphed), tables):
        prefill = table.extend_batch([0, 1, 2], [[5] * 9, [6], [7] * 30])
        model(*prefill.to("cuda").args(), host_metadata=prefill.host)
    state = dcp_compile.state(graphed)
    runner = GraphRunner(graphed.compiled("gather-q"), buckets=(4,), debug=True, host_slot=state.host_slot,
                         watched=state.kv_pool.storage())
    worst, tokens = 0.0, [[1], [2], [3]]
    for step in range(8):
        k = 7 if step % 4 == 3 else 1  # decode, and a verify graph of 7 tokens a row
        rows = [t * k for t in tokens]
        batch = tables[0].extend_batch([0, 1, 2], rows, all_logits=k > 1)
        expected = eager(*batch.to("cuda").args(), host_metadata=batch.host)
        got = runner(tables[1].extend_batch([0, 1, 2], rows, all_logits=k > 1), tokens_per_row=k)
        worst = max(worst, relative(got, expected))
        last = expected.view(3, k, -1)[:, -1] if k > 1 else expected
        tokens = [[int(t)] for t in last.argmax(-1)]
    assert len(runner.captured) == 2  # one graph for decode, one for verify, replayed as the lengths grew
    print("FlashInfer + inductor, CUDA graph replays vs eager:", worst)
    assert worst < 2e-2


@served
def test_fused_projections_match_the_unfused_model_under_inductor():
    """fuse_projections='auto' is on for a CUDA pool: q_a with kv_a and gate with up run as one
    matmul each, against the same model with them apart."""
    models = {fuse: _model("flashinfer", inner_compile="inductor", fuse_projections=fuse) for fuse in ("auto", "off")}
    assert dcp_compile.state(models["auto"]).config.fuse_projections == "on"
    worst = worst_step_difference(models["auto"], models["off"])
    report = next(b.reports[-1] for b in dcp_compile.state(models["auto"]).backends.values() if b.reports)
    assert report.sites("fuse_projections") > 0
    print(f"fused vs unfused projections, bf16: worst |diff| / max|logits| = {worst:.3g}")
    assert worst < 2e-2
