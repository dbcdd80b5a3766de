"""The extend-strategy cost model: formulas, choices and forcing."""

from __future__ import annotations

import pytest

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
