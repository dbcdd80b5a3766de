"""Compile regions under DCP (dcp_compile/regions.py): a model whose decoder layers are
nested_compile_region calls, at DCP 2 over gloo, against the same model at dcp_size 1 without
regions, in decode and verify (and in the matrix tier: verify under inductor, extend). The tiny
model is hybrid: the MLA layers share one region, the linear-attention layer has its own."""

from __future__ import annotations

import pytest

from dcp_compile.harness.scenario import Scenario

# Run by tests/conftest.py, in one spawn per TP size with the other modules' cases. Inductor and
# extend at interleave 4 run in the matrix tier (README "Test tiers"; inductor over a region at
# DCP 1 runs by default in tests/passes/test_regions.py).
DEFAULT_SCENARIOS = [
    Scenario(dcp_size=2, tp_size=2, batch=5, contexts=(1, 2, 17, 40, 3), steps=3, pad_rows=2, seed=11, regions=True),
    Scenario(mode="verify", dcp_size=2, tp_size=2, batch=3, contexts=(1, 5, 20), draft_len=7, steps=2, seed=12,
             regions=True),
]
MATRIX_SCENARIOS = [
    Scenario(mode="verify", dcp_size=2, tp_size=2, batch=3, contexts=(1, 5, 20), draft_len=7, steps=2, seed=12,
             regions=True, inner_compile="inductor"),
    Scenario(mode="extend", dcp_size=2, tp_size=2, batch=3, contexts=(1, 40, 23), chunk=9, steps=1, seed=13,
             regions=True, interleave=4),
]
GLOO_SCENARIOS = DEFAULT_SCENARIOS + MATRIX_SCENARIOS


@pytest.mark.parametrize("scenario", [s if s not in MATRIX_SCENARIOS else pytest.param(s, marks=pytest.mark.matrix)
                                      for s in GLOO_SCENARIOS],
                         ids=lambda s: f"{s.mode}-{s.inner_compile}-I{s.interleave}")
def test_regions_match_dcp_size_one(scenario, scenario_results):
    result = scenario_results[scenario]
    assert result["finite"]
    assert result["max_abs_diff"] < 1e-5
    assert result["tokens_match"]
    stored = result["tokens_stored_per_dcp_rank"]
    assert sum(stored) == result["tokens_total"] and max(stored) < result["tokens_total"]
    # The passes ran once per graph on the one MLA region, not once per MLA layer (3 of them);
    # twice where dynamo traces a region's first call apart (torch 2.10).
    graphs, summary = result["graphs_captured"], result["pass_summary"]
    assert graphs <= summary["gather_q_attention"] + summary["gather_kv_attention"] <= 2 * graphs
    assert graphs <= summary["shard_kv_write"] <= 2 * graphs
