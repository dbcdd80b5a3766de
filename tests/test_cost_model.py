"""The extend-strategy cost model: formulas, choices and forcing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_compile import cost_model

KIMI = dict(heads=32, kv_lora_rank=512, rope_dim=64, element_bytes=2)


def test_bytes_match_hand_counts():
    table = cost_model.costs(query_tokens=3, rows=2, width=10, visible_keys=17, dcp_size=4, **KIMI)
    assert table["gather-q"]["bytes"] == 3 * 3 * 32 * 576 * 2 + 3 * 3 * 32 * (512 * 2 + 4)
    assert table["gather-kv"]["bytes"] == 3 * 2 * 10 * 576 * 2
    assert table["gather-q"]["flops"] - table["gather-kv"]["flops"] == 4 * 4 * 3 * 32 * 512


def test_decode_over_long_context_gathers_q():
    decision = cost_model.choose("auto", query_tokens=64, rows=64, width=131072, visible_keys=64 * 131072, dcp_size=2, **KIMI)
    assert decision.strategy == "gather-q" and not decision.forced
    assert "gather-q" in decision.reason and "kB" in decision.reason


def test_long_chunk_over_short_prefix_gathers_kv():
    decision = cost_model.choose("auto", query_tokens=8192, rows=1, width=8300, visible_keys=8192 * 4200, dcp_size=2, **KIMI)
    assert decision.strategy == "gather-kv"


@pytest.mark.parametrize("forced", cost_model.STRATEGIES)
def test_forcing(forced):
    decision = cost_model.choose(forced, query_tokens=1, rows=1, width=4, visible_keys=4, dcp_size=2, **KIMI)
    assert decision.strategy == forced and decision.forced


def test_unknown_strategy():
    with pytest.raises(ValueError, match="unknown attention strategy"):
        cost_model.choose("gather-everything", query_tokens=1, rows=1, width=4, visible_keys=4, dcp_size=2, **KIMI)


@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(1, 4096), rows=st.integers(1, 64), width=st.integers(1, 200_000),
       dcp_size=st.sampled_from([2, 4, 8]), fraction=st.floats(0.0, 1.0))
def test_choice_does_not_depend_on_visible_keys(tokens, rows, width, dcp_size, fraction):
    """apply() bounds the visible keys by the shapes on a GPU, to avoid a device sync."""
    bound = tokens * width
    shared = dict(query_tokens=tokens, rows=rows, width=width, dcp_size=dcp_size, **KIMI)
    exact = cost_model.choose("auto", visible_keys=int(bound * fraction), **shared)
    assert exact.strategy == cost_model.choose("auto", visible_keys=bound, **shared).strategy
