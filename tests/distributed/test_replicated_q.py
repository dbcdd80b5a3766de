"""Replicated Q on a canonical-op model: at tp_size 1 every rank has every head, so dcp_size 2 on 2
gloo ranks shards the KV over the world and runs replicated-q (partial attention for all heads over
the local shard, one all-gather of (out, lse), the merge; no Q all-gather). Prefill of mixed
lengths with an empty shard and a padded row, decode, verify k = 3 and an extend chunk, each step
equal to the same model at dcp_size=1; and the strategies that cannot serve such a model refused."""

from __future__ import annotations

import pytest

import dcp_compile
from dcp_compile.models.config import preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.runtime.batch import RequestTable
from dcp_compile.runtime.launch import spawn
from dcp_compile.runtime.parallel import ParallelState

LAYERS = ("mla", "linear", "mla")
STEPS = [[[5, 6, 7, 8, 9, 10, 11], [12], []], [[1], [2], [3]], [[4] * 3, [5] * 3, [6] * 3], [[7] * 9, [8], [9] * 4],
         [[1], [2], [3]]]
"""Prefill (row 2 joins later: an empty shard on both ranks), decode, verify k = 3, an extend chunk, decode."""


def _model(page_size: int = 1):
    return MLAModel(preset("tiny").replace(layer_types=LAYERS), kv_capacity=256, max_requests=4, seed=11,
                    page_size=page_size)


def _errors(dcp_size: int) -> dict:
    found = {}
    for name, make, fields in (("gather-q at tp 1", _model, {"attention_strategy": "gather-q"}),
                               ("replicated-q at tp 2", lambda: MLAModel(preset("tiny"), kv_capacity=64,
                                                                         par=ParallelState(tp_size=2, tp_rank=0)),
                                {"attention_strategy": "replicated-q"})):
        try:
            dcp_compile.apply(make(), dcp_size, **fields)
            found[name] = None
        except ValueError as error:
            found[name] = str(error)
    return found


def _worst(model, reference, page_size: int = 1) -> tuple[float, int]:
    """The largest logits difference over STEPS, and the steps run."""
    tables, worst, steps = [RequestTable(4, 64, 256, page_size) for _ in range(2)], 0.0, 0
    for tokens in STEPS:
        rows = [r for r, t in enumerate(tokens) if t]
        logits = []
        for m, table in zip((model, reference), tables):
            batch = table.extend_batch(rows, [tokens[r] for r in rows], pad_rows=1, all_logits=True)
            logits.append(m(*batch.args()))
        worst = max(worst, (logits[0] - logits[1]).abs().max().item())
        steps += 1
    return worst, steps


def rank_run(rank: int, world: int) -> dict:
    dcp = dcp_compile.apply(_model(), world)
    worst, steps = _worst(dcp, dcp_compile.apply(_model(), 1))
    control, _ = _worst(dcp_compile.apply(_model(), world, disabled_passes=("shard_kv_write",)),
                        dcp_compile.apply(_model(), 1))
    # FlashInfer (its torch stand-in on the CPU), which plans on the host: pages of one block a rank.
    flashinfer = dcp_compile.apply(_model(world), world, kernels="flashinfer")
    flashinfer_worst, _ = _worst(flashinfer, dcp_compile.apply(_model(world), 1), world)
    flashinfer_ops = [dict(r.records[-1].ops_after) for r in dcp_compile.state(flashinfer).reports]
    state = dcp_compile.state(dcp)
    reports = [r for b in state.backends.values() for r in b.reports]
    return {"worst": worst, "control_worst": control, "steps": steps, "strategies": dict(state.strategy_counts), "backends": sorted(state.backends),
            "summary": state.pass_summary(), "graphs": len(reports),
            "ops_after": [{k: v for k, v in r.records[-1].ops_after.items() if "::" in k or k == "linear"} for r in reports],
            "dcp_rank": state.parallel.dcp_rank, "capacity_ratio": state.capacity.capacity_ratio,
            "errors": _errors(world), "flashinfer_worst": flashinfer_worst, "flashinfer_ops": flashinfer_ops}


@pytest.fixture(scope="module")
def runs():
    return spawn(rank_run, 2)


def test_replicated_q_at_tp_size_one_equals_dcp_size_one(runs):
    assert sorted(r["dcp_rank"] for r in runs) == [0, 1]
    for result in runs:
        assert result["steps"] == len(STEPS) and result["worst"] < 1e-5
        assert result["backends"] == ["replicated-q"] and result["strategies"] == {"replicated-q": len(STEPS)}
        assert result["capacity_ratio"] >= 1.9
        mla_layers = LAYERS.count("mla")
        assert result["summary"]["replicated_q_attention"] == mla_layers * result["graphs"]
        assert result["summary"]["gather_q_attention"] == 0
        for ops in result["ops_after"]:
            assert ops.get("dcp::mla_partial_attention") == mla_layers
            assert ops.get("_c10d_functional::all_gather_into_tensor") == mla_layers  # (out, lse) only: no Q gather
            assert ops.get("_c10d_functional::all_to_all_single", 0) == 0 and ops.get("dcp::mla_attention", 0) == 0


def test_flashinfer_serves_replicated_q(runs):
    """A back end that plans on the host serves replicated-q: FlashInfer's paged kernel over the
    local shard in every graph (no step here has more query tokens than its split serves), every
    step equal to dcp_size=1."""
    for result in runs:
        assert result["flashinfer_worst"] < 1e-5
        # Its plans are sized by each step, so the graphs are symbolic in the batch shape: prefill,
        # verify and extend share one, decode has its own (static shapes made 4).
        assert len(result["flashinfer_ops"]) == 2
        for ops in result["flashinfer_ops"]:
            assert ops.get("dcp_flashinfer::mla_paged_attention") == LAYERS.count("mla"), ops
            assert ops.get("dcp::mla_partial_attention", 0) == 0


def test_negative_control_without_the_sharded_kv_write_differs(runs):
    for result in runs:
        assert result["control_worst"] > 1e-2


def test_strategies_that_cannot_serve_the_layout_are_refused(runs):
    errors = runs[0]["errors"]
    assert "runs 'replicated-q'" in errors["gather-q at tp 1"]
    assert "serves models whose heads are not split" in errors["replicated-q at tp 2"]
