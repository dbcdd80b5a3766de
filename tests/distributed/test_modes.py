"""Verify and extend under DCP on gloo ranks, against dcp_size=1 in fp32 to 1e-5."""

from __future__ import annotations

import pytest

from dcp_compile.harness.scenario import Scenario

# Run by tests/conftest.py, in one spawn per TP size with the other modules' cases.
GLOO_SCENARIOS = [
    # Verify: k = 7 with scripted accept/reject (0..6 drafts accepted), then local lengths recomputed.
    Scenario(mode="verify", dcp_size=2, tp_size=2, batch=3, contexts=(1, 5, 20), draft_len=7, steps=3, seed=5),
    # Extend: chunked prefill over a sharded prefix, both strategies forced, and the cost model.
    Scenario(mode="extend", dcp_size=2, tp_size=2, batch=3, contexts=(1, 40, 23), chunk=9, steps=1,
             attention_strategy="gather-kv", seed=7),
    # Page-interleaved (I = page size = 4) with a shared prefix of two pages: prefix-cache pages
    # stay in the scheduler's logical address space, so nothing needs scaling by N.
    Scenario(mode="extend", dcp_size=2, tp_size=2, batch=3, contexts=(20, 14, 1), chunk=6, steps=2, interleave=4,
             shared_prefix=8, seed=9),
    # The DCP model on the Triton kernels (interpreted on CPU), against the reference baseline: 4
    # queries a request over 4 rows at 8 gathered heads, a shape the folded kernel folds
    # (lowering/triton/folded_attention.folds).
    Scenario(mode="verify", dcp_size=2, tp_size=2, batch=4, contexts=(1, 12, 5, 20), draft_len=4, steps=1, seed=10,
             kernels="triton", attention_strategy="gather-q"),
]
MATRIX_SCENARIOS = [
    # DCP 4 (the same passes at N = 4; DCP 4 runs by default in test_dcp_equivalence.py's decode and
    # tests/checkpoints/test_oracle.py's DCP 4 x TP 4 against transformers).
    Scenario(mode="verify", dcp_size=4, tp_size=4, batch=2, contexts=(2, 9), draft_len=3, steps=2, seed=6),
    Scenario(mode="extend", dcp_size=4, tp_size=4, batch=2, contexts=(3, 30), chunk=11, steps=1,
             attention_strategy="gather-q", seed=8),
    # TP 2 without DCP (tests/checkpoints/test_oracle.py runs TP 2 at dcp_size 1 against transformers).
    Scenario(mode="verify", dcp_size=1, tp_size=2, batch=2, contexts=(2, 9), draft_len=4, steps=2, seed=6),
    Scenario(mode="extend", dcp_size=1, tp_size=2, batch=2, contexts=(3, 30), chunk=11, steps=1, seed=8),
]
GLOO_SCENARIOS += MATRIX_SCENARIOS


@pytest.mark.parametrize(
    "scenario", [s if s not in MATRIX_SCENARIOS else pytest.param(s, marks=pytest.mark.matrix) for s in GLOO_SCENARIOS],
    ids=lambda s: f"{s.mode}-tp{s.tp_size}-dcp{s.dcp_size}-I{s.interleave}-{s.attention_strategy}-{s.kernels}",
)
def test_mode_matches_dcp_size_one(scenario, scenario_results):
    result = scenario_results[scenario]
    assert result["finite"]
    assert result["max_abs_diff"] < 1e-5 and result["outputs_match"]
    assert result["tokens_match"]
    assert sum(result["tokens_stored_per_dcp_rank"]) == result["tokens_total"]
    if scenario.dcp_size > 1 and scenario.attention_strategy != "auto":
        assert set(result["strategy_counts"]) == {scenario.attention_strategy}
