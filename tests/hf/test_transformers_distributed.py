"""dcp_compile.apply(DeepseekV3ForCausalLM, DeepseekV2ForCausalLM or a family built on DeepSeek's MLA block,
dcp_size=2) on 2 gloo ranks: generate() returns the untouched model's greedy tokens, each rank stores half of the KV, and the negative controls
(a perturbed softmax scale, the sharded KV write disabled) fail the same comparison; V2 with
each decoder layer a compile region; and V3 at dcp_size=4 on 4 ranks. In the same launch (tests/hf/group_steps.py): two interleaved
conversations in caches of their own, classifier-free guidance, sampling after per-rank seeds,
and steps the ranks disagree on."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("transformers")

from dcp_compile.runtime.launch import spawn  # noqa: E402
from tests.hf.group_steps import LARGE, POOL_LOCATIONS, WIDTH, rank_runs  # noqa: E402
from tests.hf.models import YARN, available, rank_compare  # noqa: E402

LAYERS = 2
DCP_SIZE = 2
MATCHING = {
    "v3-sdpa": {},
    "v3-qlora-rotate-half-yarn": {"overrides": {"q_lora_rank": 12, "rope_interleave": False, "rope_parameters": YARN}},
    "v2-eager-yarn": {"overrides": {"family": "v2", "attn_implementation": "eager", "rope_parameters": YARN}},
    "glm4-moe-lite": {"overrides": {"family": "glm4-moe-lite"}},
    "minicpm3": {"overrides": {"family": "minicpm3"}},
    "youtu-eager": {"overrides": {"family": "youtu", "attn_implementation": "eager"}},
    "sarvam-mla": {"overrides": {"family": "sarvam-mla"}},
    "kimi-linear": {"overrides": {"family": "kimi-linear"}},
}
CONTROLS = {"scale+10%": {"scale_factor": 1.1}, "unsharded-write": {"apply": {"disabled_passes": ("shard_kv_write",)}}}
BACK_ENDS = {"v3-flashinfer": {"apply": {"kernels": "flashinfer"}}}
"""Back ends that plan on the host, on the CPU: FlashInfer's torch stand-in (its plans, CSR page
lists and lengths handed to the wrapper as on a GPU)."""
REGIONS = {"v2-regions": {"apply": {"regions": True}, "overrides": {
    "family": "v2", "attn_implementation": "eager", "rope_parameters": YARN, "num_hidden_layers": 3,
    "first_k_dense_replace": 1}},
    "v3-regions-flashinfer": {"apply": {"regions": True, "kernels": "flashinfer"},
                              "overrides": {"num_hidden_layers": 3, "first_k_dense_replace": 1}}}
"""Each decoder layer a compile region: one dense layer, then two MoE layers (two kinds); V2's
rotary embedding is one complex tensor (V3 with regions: tests/hf/test_regions.py). With
FlashInfer the two kinds' graphs share one host plan a step (lowering/flashinfer/plans.py)."""


MATRIX_FAMILIES = ("v3-qlora-rotate-half-yarn", "glm4-moe-lite", "minicpm3", "youtu-eager", "sarvam-mla")
"""Variants the default run covers at dcp_size 1 (tests/hf/test_transformers_dcp1.py), and at
DCP 2 only under --matrix: each is DeepSeek-V2/V3's attention under another config, which the
sharding (the same rewrite after absorb_mla) does not see."""


def _selected_matching(session: pytest.Session) -> set[str]:
    """The MATCHING cases the session's selected tests of this module ask for."""
    return {item.callspec.params["case"] for item in session.items
            if item.module is sys.modules[__name__] and hasattr(item, "callspec") and "case" in item.callspec.params}


@pytest.fixture(scope="module")
def launch(request):
    """Every selected case, the controls, the back ends and group_steps in one launch of 2 ranks:
    [rank 0's results, rank 1's]."""
    selected = _selected_matching(request.session)
    cases = {name: case for name, case in {**MATCHING, **CONTROLS, **BACK_ENDS, **REGIONS}.items()
             if (name in selected or name not in MATCHING) and available(case.get("overrides", {}).get("family", "v3"))}
    return cases, spawn(rank_runs, DCP_SIZE, list(cases.values()))


@pytest.fixture(scope="module")
def runs(launch):
    """{case name: [rank 0's result, rank 1's]}."""
    cases, per_rank = launch
    return {name: [rank["compare"][i] for rank in per_rank] for i, name in enumerate(cases)}


@pytest.fixture(scope="module")
def group(launch):
    """group_steps' results, [rank 0's, rank 1's]."""
    return [rank["group"] for rank in launch[1]]


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.matrix) if case in MATRIX_FAMILIES else case
                                  for case in MATCHING])
def test_generate_matches_transformers(runs, case):
    if case not in runs:
        pytest.skip(f"{case}: not in this transformers")
    for result in runs[case]:
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
    stored = [result["tokens_stored"] for result in runs[case]]
    assert sum(stored) == runs[case][0]["tokens_total"]
    assert max(stored) - min(stored) <= 2  # token-interleaved: about half each


def test_flashinfer_matches_transformers(runs):
    """kernels='flashinfer' at DCP 2: every layer's attention over the local shard is FlashInfer's
    paged MLA kernel (here its stand-in), planned on the host from the cache's page table; the
    tokens and logits are transformers'."""
    for result in runs["v3-flashinfer"]:
        assert result["tokens_equal"] and result["max_logit_diff"] < 1e-5
        assert result["kernels"] == "flashinfer"
        for ops in result["graph_ops"]:
            after = ops["after"]
            assert after.get("dcp_flashinfer::mla_paged_attention") == LAYERS, after
            assert after.get("dcp::mla_partial_attention", 0) == 0
            assert after.get("_c10d_functional::all_gather_into_tensor") == LAYERS
    stored = [result["tokens_stored"] for result in runs["v3-flashinfer"]]
    assert sum(stored) == runs["v3-flashinfer"][0]["tokens_total"]


def test_regions_match_transformers_with_each_kind_of_layer_rewritten_once(runs):
    """apply(..., regions=True) at DCP 2: the absorb pass and the replicated-q rewrite run once per
    kind of layer (dense, MoE) in each graph, not once per layer; every rank gets transformers'
    tokens and logits, and stores about half of the KV."""
    for result in runs["v2-regions"]:
        assert result["tokens_equal"] and result["max_logit_diff"] < 1e-5
        summary = result["pass_summary"]
        assert summary["absorb_mla"] == summary["replicated_q_attention"] == summary["shard_kv_write"] == 2 * result["graphs"]
    stored = [result["tokens_stored"] for result in runs["v2-regions"]]
    assert sum(stored) == runs["v2-regions"][0]["tokens_total"] and max(stored) < sum(stored)


def test_flashinfer_regions_match_transformers(runs):
    """apply(..., regions=True, kernels='flashinfer') at DCP 2: each kind of layer lowered once to
    FlashInfer's attention, the two kinds' regions reading one plan a step (its count at DCP 1:
    tests/hf/test_regions.py); every rank gets transformers' tokens and logits, and stores about
    half of the KV."""
    for result in runs["v3-regions-flashinfer"]:
        assert result["tokens_equal"] and result["max_logit_diff"] < 1e-5 and result["kernels"] == "flashinfer"
        summary = result["pass_summary"]
        assert summary["absorb_mla"] == summary["lower_flashinfer_attention"] == summary["shard_kv_write"] == 2 * result["graphs"]
    stored = [result["tokens_stored"] for result in runs["v3-regions-flashinfer"]]
    assert sum(stored) == runs["v3-regions-flashinfer"][0]["tokens_total"] and max(stored) < sum(stored)


def test_negative_control_perturbed_scale(runs):
    for result in runs["scale+10%"]:
        assert not result["tokens_equal"]


def test_negative_control_unsharded_kv_write(runs):
    for result in runs["unsharded-write"]:
        assert result["pass_summary"]["shard_kv_write"] == 0
        assert not result["tokens_equal"]


@pytest.mark.matrix  # DCP 4 against transformers runs by default in tests/checkpoints/test_oracle.py (DCP 4 x TP 4)
def test_dcp4_matches_transformers():
    per_rank = [results[0] for results in spawn(rank_compare, 4, [MATCHING["v3-sdpa"]])]
    for result in per_rank:
        assert result["tokens_equal"]
        assert result["max_logit_diff"] < 1e-5
        assert result["capacity_ratio"] >= 3.9
        assert result["pass_summary"]["replicated_q_attention"] == LAYERS * result["graphs"]
        for ops in result["graph_ops"]:  # at N = 4 the partials are exchanged, then the merged heads gathered
            after = ops["after"]
            assert after.get("_c10d_functional::all_to_all_single") == LAYERS
            assert after.get("_c10d_functional::all_gather_into_tensor") == LAYERS
            assert after.get("dcp::merge_partials") == LAYERS
    stored = [result["tokens_stored"] for result in per_rank]
    assert sum(stored) == per_rank[0]["tokens_total"] and max(stored) - min(stored) <= 2


def _matches_transformers(result: dict) -> None:
    assert result["tokens_equal"]
    assert result["logits"] < 1e-5 and result["scores"] < 1e-5


def test_interleaved_conversations_keep_their_own_kv(group):
    """A generate() in a cache of its own while another conversation's generate() is half done:
    each gets transformers' tokens and logits (before, both caches took the same locations and the
    first conversation's logits were off by up to 3.35); the pool refuses a cache that does not
    fit beside the two, and serves it once they are dropped."""
    for result in group:
        _matches_transformers(result["first"])
        _matches_transformers(result["second"])
        kind, message = result["too_large"]
        assert kind == "MemoryError"
        assert f"1 row(s) of {LARGE} positions needs {LARGE} KV locations" in message
        assert (f"the pool has {POOL_LOCATIONS} (location 0 is reserved), {POOL_LOCATIONS - 2 * WIDTH} of them free "
                "on every DCP rank: 2 live cache(s) hold the rest") in message
        assert result["fits_after"] == ("ok", "")


def test_guidance_matches_transformers(group):
    """Classifier-free guidance (guidance_scale) calls the model for its unconditional pass with
    a cache of its own; the processed scores are transformers'."""
    for result in group:
        _matches_transformers(result["guidance"])


def test_sampling_after_per_rank_seeds_draws_one_token_for_the_group(group):
    """torch.manual_seed(100 + rank), then generate(do_sample=True): every rank returns the tokens
    transformers samples with seed 100 (rank 0's generator, shared for the call); afterwards
    rank 0's generator is where transformers leaves it, rank 1's is its own again."""
    for result in group:
        _matches_transformers(result["sampling"])
        assert result["generator_after_sampling"]


def test_steps_the_ranks_disagree_on_are_refused_on_every_rank(group):
    """Other token ids, other prompt lengths (one a shape both ranks ran before, which the shape
    agreement remembered), a rank in generate() and its peer in a step, generate() calls that
    sample on one rank only: a ValueError on every rank naming what each was given, not a gloo
    mismatch (SIGABRT) or silently mixed shards. A refused generate() call leaves the model serving."""
    rule = "same step with the same batch"
    for result in group:
        kind, message = result["tokens_differ"]
        assert kind == "ValueError" and "token ids differ" in message and rule in message
        assert "rank 0: token checksum 3; rank 1: token checksum 4" in message
        kind, message = result["step_lengths_differ"]
        assert kind == "ValueError" and "different steps: rank 0: tokens 5; rank 1: tokens 4." in message
        kind, message = result["generate_and_step"]
        assert kind == "ValueError" and "rank 0 in generate(); rank 1 in a model step" in message
        kind, message = result["prompt_lengths_differ"]
        assert kind == "ValueError"
        assert "different generate() calls: rank 0: prompt tokens 5; rank 1: prompt tokens 4." in message
        kind, message = result["sampling_differs"]
        assert kind == "ValueError" and "generate() calls: rank 0: sampling 1; rank 1: sampling 0." in message
        _matches_transformers(result["after_refused_calls"])


def test_torch_compile_around_the_applied_model_keeps_dcp(group):
    """torch.compile(applied): DCP's own step runs inside it (before, the outer compile inlined it,
    and every rank stored every token)."""
    stored = [result["outer_compile"]["stored"] for result in group]
    for result in group:
        assert result["outer_compile"]["worst"] < 1e-5
    assert sum(stored) == group[0]["outer_compile"]["tokens"] and max(stored) - min(stored) <= 1


def test_a_left_padded_batch_matches_transformers_with_the_padding_never_stored(group):
    """Prompts of 1, 7 and 20 tokens, left-padded: transformers' tokens and logits on every rank,
    and the ranks together store each row's own tokens only; on the torch kernels, on FlashInfer
    (its stand-in), whose host plans read each row's padding as columns not stored, and for the
    hybrid Kimi-Linear, whose linear-attention layers mask the padding (it was refused)."""
    for kernels in ("auto", "flashinfer", *(("kimi-linear",) if available("kimi-linear") else ())):
        for result in group:
            _matches_transformers(result["left_padded"][kernels])
        assert sum(result["left_padded"][kernels]["stored"] for result in group) == group[0]["left_padded"][kernels]["tokens"]
