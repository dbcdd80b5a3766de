"""dcp_compile.apply(DeepseekV3ForCausalLM(config), dcp_size=2) on 2 gloo ranks: generate() returns
the untouched model's greedy tokens, each rank stores half of the KV, and the negative controls
(a perturbed softmax scale, the sharded KV write disabled) fail the same comparison."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from dcp_compile.runtime.launch import spawn  # noqa: E402
from tests.hf.models import rank_compare  # noqa: E402

LAYERS = 2
DCP_SIZE = 2


@pytest.fixture(scope="module")
def runs():
    cases = [{}, {"scale_factor": 1.1}, {"apply": {"disabled_passes": ("shard_kv_write",)}}]
    per_rank = spawn(rank_compare, DCP_SIZE, cases)
    return [[rank[i] for rank in per_rank] for i in range(len(cases))]


def test_generate_matches_transformers(runs):
    for result in runs[0]:
        assert result["tokens_equal"]
        assert result["max_logit_diff"] < 1e-5
        assert result["dcp_size"] == DCP_SIZE
        assert result["capacity_ratio"] >= 1.9
        graphs = result["graphs"]
        summary = result["pass_summary"]
        assert summary["absorb_mla"] == summary["replicated_q_attention"] == LAYERS * graphs
        assert summary["shard_kv_write"] == LAYERS * graphs
        for ops in result["graph_ops"]:
            after = ops["after"]
            assert after.get("dcp::mla_partial_attention") == LAYERS
            assert after.get("_c10d_functional::all_gather_into_tensor") == LAYERS  # (out, lse), no Q gather
            assert after.get("_c10d_functional::all_to_all_single", 0) == 0
            for gone in ("dcp::mla_attention", "dcp::mla_cache_view", "scaled_dot_product_attention", "dcp::mla_kv_write"):
                assert after.get(gone, 0) == 0, gone
            assert ops["before"]["linear"] - after["linear"] == LAYERS
    stored = [result["tokens_stored"] for result in runs[0]]
    assert sum(stored) == runs[0][0]["tokens_total"]
    assert max(stored) - min(stored) <= 2  # token-interleaved: about half each


def test_negative_control_perturbed_scale(runs):
    for result in runs[1]:
        assert not result["tokens_equal"]


def test_negative_control_unsharded_kv_write(runs):
    for result in runs[2]:
        assert result["pass_summary"]["shard_kv_write"] == 0
        assert not result["tokens_equal"]
