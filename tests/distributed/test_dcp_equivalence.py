"""Multi-process (gloo) runs: DCP prefill + greedy decode against the same model at dcp_size=1.

Lengths include 1 and values below N, so some ranks hold empty shards; every batch carries padded
rows that write to location 0. The tiny model is hybrid (one linear-attention layer).
"""

from __future__ import annotations

import pytest

from dcp_compile.harness.scenario import Scenario

# Run by tests/conftest.py, in one spawn per TP size with the other modules' cases.
GLOO_SCENARIOS = [
    Scenario(dcp_size=2, tp_size=2, batch=5, contexts=(1, 2, 17, 40, 3), steps=4, pad_rows=2, seed=1),
    Scenario(dcp_size=4, tp_size=4, batch=4, contexts=(1, 3, 2, 64), steps=3, seed=2),
    Scenario(dcp_size=2, tp_size=4, batch=3, contexts=(1, 9, 33), steps=3, seed=3),
]
# Page-interleaved decode (interleave 4 runs by default in test_modes.py's extend and
# tests/flashinfer/test_lowering.py's verify).
MATRIX_SCENARIOS = [Scenario(dcp_size=2, tp_size=2, batch=3, contexts=(1, 3, 30), steps=3, interleave=4, seed=4)]
GLOO_SCENARIOS += MATRIX_SCENARIOS


@pytest.mark.parametrize("scenario", [s if s not in MATRIX_SCENARIOS else pytest.param(s, marks=pytest.mark.matrix)
                                      for s in GLOO_SCENARIOS], ids=lambda s: f"tp{s.tp_size}-dcp{s.dcp_size}-I{s.interleave}")
def test_dcp_matches_dcp_size_one(scenario, scenario_results):
    result = scenario_results[scenario]
    assert result["finite"]
    assert result["max_abs_diff"] < 1e-5
    assert result["tokens_match"]
    # Every written location is stored on exactly one rank of the DCP group, and no rank holds all.
    stored = result["tokens_stored_per_dcp_rank"]
    assert sum(stored) == result["tokens_total"] == sum(scenario.lengths) + scenario.batch * scenario.steps
    assert max(stored) < result["tokens_total"]
    mla_layers = 3
    graphs = result["graphs_captured"]
    summary = result["pass_summary"]
    assert summary["gather_q_attention"] + summary["gather_kv_attention"] == mla_layers * graphs
    assert result["pass_summary"]["local_metadata"] == graphs
    assert result["kv_capacity_ratio"] >= scenario.dcp_size * 0.995
