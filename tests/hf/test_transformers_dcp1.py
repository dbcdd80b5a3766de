"""dcp_compile.apply on unmodified transformers DeepSeek-V3 / V2 models at dcp_size 1, in one process:
generate() against the untouched model's, the graph after the passes, the negative controls and
the refusals (the multi-rank runs are in test_transformers_distributed.py)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention  # noqa: E402

import dcp_compile  # noqa: E402
from dcp_compile.hf import absorb  # noqa: E402
from dcp_compile.hf.cache import DCPCache  # noqa: E402
from dcp_compile.hf.model import cache_kwarg  # noqa: E402
from dcp_compile.passes.base import PassConfig  # noqa: E402
from dcp_compile.passes.graph_utils import normalize_meta  # noqa: E402
from dcp_compile.runtime.kv_pool import MLAKVPool  # noqa: E402
from tests.hf.models import YARN, available, compare, prompt, tiny_model  # noqa: E402

LAYERS = 2
CASES = {
    "v3-sdpa": {},
    "v3-eager": {"attn_implementation": "eager"},
    "v3-qlora-rotate-half-yarn": {"q_lora_rank": 12, "rope_interleave": False, "rope_parameters": YARN},
    "v2-eager-yarn": {"family": "v2", "attn_implementation": "eager", "rope_parameters": YARN},
    "v2-sdpa-qlora": {"family": "v2", "q_lora_rank": 12},
    "glm4-moe-lite": {"family": "glm4-moe-lite"},
    "minicpm3-eager": {"family": "minicpm3", "attn_implementation": "eager"},
    "youtu": {"family": "youtu"},
    "sarvam-mla": {"family": "sarvam-mla"},
    "kimi-linear": {"family": "kimi-linear"},
}


@pytest.mark.parametrize("overrides", [
    pytest.param(o, marks=pytest.mark.skipif(not available(o.get("family", "v3")), reason="not in this transformers"))
    for o in CASES.values()], ids=CASES.keys())
def test_generate_matches_transformers(overrides):
    result = compare(tiny_model(**overrides))
    assert result["tokens_equal"]
    assert result["max_logit_diff"] < 1e-5
    assert result["graphs"] == 2  # prefill and one decode graph for all 15 decode steps
    assert result["pass_summary"]["absorb_mla"] == LAYERS * result["graphs"]
    for ops in result["graph_ops"]:
        assert ops["after"].get("dcp::mla_attention") == LAYERS
        assert ops["after"].get("dcp::mla_cache_view", 0) == 0
        assert ops["after"].get("scaled_dot_product_attention", 0) == 0
        # kv_b_proj over the cache was the only linear removed: W_UK and W_UV are its weight's slices
        assert ops["before"]["linear"] - ops["after"]["linear"] == LAYERS
    assert result["tokens_stored"] == result["tokens_total"]


def test_flashinfer_matches_transformers():
    """kernels='flashinfer' (its torch stand-in on the CPU) at dcp_size 1: FlashInfer's paged
    kernel, causal over each row's keys, in every graph; transformers' tokens and logits."""
    result = compare(tiny_model(), kernels="flashinfer")
    assert result["tokens_equal"] and result["max_logit_diff"] < 1e-5
    assert result["kernels"] == "flashinfer" and result["graphs"] == 2
    for ops in result["graph_ops"]:
        assert ops["after"].get("dcp_flashinfer::mla_paged_attention") == LAYERS, ops["after"]
        assert ops["after"].get("dcp::mla_attention", 0) == 0


def test_flashinfer_serves_every_prompt_length_from_a_few_graphs(monkeypatch):
    """FlashInfer's plans are sized by each step, so its graphs are symbolic in the batch shape
    as the other back ends' are (they were compiled per prompt length, and the 257th length raised
    the recompile limit). A prompt past the plan's capacity (MAX_WORK_ITEMS, 10 here) compiles once
    more, to the general kernels: a guard, not a reuse of a graph whose plan would refuse it."""
    from tests.hf.models import graph_ops

    from dcp_compile.lowering.flashinfer import lower_attention

    monkeypatch.setattr(lower_attention, "MAX_WORK_ITEMS", 10)
    reference = tiny_model(max_position_embeddings=512)
    model = dcp_compile.apply(copy.deepcopy(reference), dcp_size=1, kernels="flashinfer", kv_capacity=2048)
    generator = torch.Generator().manual_seed(4)
    lengths = list(range(2, 20)) + [27, 300, 411]  # 4 heads: past 10 work items from 257 tokens a row
    with torch.no_grad():
        for length in lengths:
            rows = 3 if length % 10 == 7 else 1
            input_ids = torch.randint(0, reference.config.vocab_size, (rows, length), generator=generator)
            got = model.generate(input_ids, max_new_tokens=3, do_sample=False)
            assert torch.equal(got, reference.generate(input_ids, max_new_tokens=3, do_sample=False)), length
    reports = dcp_compile.state(model).reports
    paged = [graph_ops(report)["after"].get("dcp_flashinfer::mla_paged_attention", 0) for report in reports]
    assert len(reports) == 5, paged  # (1 row | 3 rows) x (prefill | decode), and the long prefills' graph
    assert paged.count(0) == 1 and all(count == 2 for count in paged if count), paged


def test_negative_control_perturbed_scale(monkeypatch):
    """A softmax scale off by 10% must fail the comparison that test_generate_matches_transformers passes."""
    matched = absorb.match_site

    def off_by_ten_percent(*args, **kwargs):
        site = matched(*args, **kwargs)
        site.sm_scale *= 1.1
        return site

    monkeypatch.setattr(absorb, "match_site", off_by_ten_percent)
    result = compare(tiny_model())
    assert result["pass_summary"]["absorb_mla"] == LAYERS * result["graphs"]
    assert not result["tokens_equal"]
    assert result["max_logit_diff"] > 1e-2


class BiasedValueAttention(DeepseekV3Attention):
    """A changed pattern: the values get a term absorbed MLA does not have."""

    def expand_kv(self, kv_nope, k_rot):
        key_states, value_states = super().expand_kv(kv_nope, k_rot)
        return key_states, value_states + 0.01


def _biased_model():
    model = tiny_model()
    for layer in model.model.layers:
        layer.self_attn.__class__ = BiasedValueAttention
    return model


def _capture(model, dcp_size: int | None = None, cache=None):
    """One step of `model` over `cache` (a DCPCache by default), captured; with dcp_size, the
    absorb pass run on it. Returns (graph module, sites the pass rewrote or None)."""
    config = model.config
    pool = MLAKVPool(config.num_hidden_layers, 64, config.kv_lora_rank, config.qk_rope_head_dim)
    seen = {}

    def backend(gm, example_inputs):
        normalize_meta(gm.graph)
        seen["gm"] = gm
        if dcp_size is not None:
            seen["sites"] = absorb.AbsorbMLA().run(gm, PassConfig(dcp_size=dcp_size))
        return gm.forward

    forward = torch.compile(type(model).forward.__get__(model), backend=backend, fullgraph=True, dynamic=False)
    with torch.no_grad():
        forward(input_ids=prompt(), **{cache_kwarg(model): cache if cache is not None else DCPCache(pool, 2, 8)})
    return seen["gm"], seen.get("sites")


def _absorb_graph(model, dcp_size: int):
    return _capture(model, dcp_size)[1]


@pytest.mark.parametrize("overrides", [CASES["v3-sdpa"], CASES["v2-eager-yarn"]], ids=["v3-sdpa", "v2-eager-yarn"])
def test_finder_reads_shapes_and_scale(overrides):
    model = tiny_model(**overrides)
    gm, _ = _capture(model)
    sites, failures = absorb.find_sites(gm.graph)
    assert failures == []
    assert [site.layer.split(" ")[0] for site in sites] == [f"L['self'].model.layers.{i}.self_attn" for i in range(LAYERS)]
    config, attention = model.config, model.model.layers[0].self_attn
    for site in sites:
        assert (site.heads, site.nope_dim, site.value_dim, site.rank_dim, site.rope_dim) == (
            config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim, config.kv_lora_rank,
            config.qk_rope_head_dim)
        assert site.sm_scale == attention.scaling  # the graph's literal, YaRN's mscale included
    if "rope_parameters" in overrides:
        assert attention.scaling > (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5 * 1.2


def test_finder_matches_only_reads_of_the_pool():
    """The same attention over transformers' own cache is no site (and no failure): only a read of
    the KV pool is, so nothing else in a graph is ever rewritten."""
    model = tiny_model()
    gm, _ = _capture(model, cache=DynamicCache(config=model.config))
    assert "scaled_dot_product_attention" in gm.code
    assert absorb.find_sites(gm.graph) == ([], [])


def test_changed_pattern_is_a_clear_error_under_dcp():
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as error:
        _absorb_graph(_biased_model(), dcp_size=2)
    assert isinstance(error.value.inner_exception, absorb.AbsorbError)
    message = str(error.value.inner_exception)
    assert "2 of 2 attention layers" in message
    assert "model.layers.0.self_attn (BiasedValueAttention)" in message
    assert "add" in message  # the node that broke the pattern
    assert "test_transformers_dcp1.py" in message and "value_states + 0.01" in message  # its source line


def test_changed_pattern_runs_unchanged_at_dcp_size_one():
    assert _absorb_graph(tiny_model(), dcp_size=2) == LAYERS
    result = compare(_biased_model())
    assert result["pass_summary"]["absorb_mla"] == 0
    assert result["tokens_equal"]
    assert result["max_logit_diff"] < 1e-5


def test_refused_before_any_step():
    original = tiny_model()
    model = dcp_compile.apply(original, dcp_size=1)
    with pytest.raises(ValueError, match="already passed to dcp_compile.apply"):
        dcp_compile.apply(original)
    input_ids = prompt()
    holed = torch.ones_like(input_ids)
    holed[0, 2] = 0  # a masked token between two kept ones: not left padding
    with pytest.raises(ValueError, match="serves left padding only"):
        model.generate(input_ids, attention_mask=holed, max_new_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match="cache's positions"):
        model(input_ids, position_ids=torch.arange(1, 6)[None])
    with pytest.raises(ValueError, match="own KV pool"):
        model(input_ids, **{cache_kwarg(original): DynamicCache(config=model.config)})
    with pytest.raises(ValueError, match="max_length"):
        model(input_ids, **{cache_kwarg(original): model.new_cache(2, 4)})
    assert dcp_compile.state(model).reports == []  # nothing was compiled


def test_a_model_loaded_with_tensor_parallelism_is_refused():
    """transformers' TP plan would split the heads (V2's does); the front end runs them replicated.
    (Loading with a plan needs accelerate, which this project does not depend on: the degree that
    transformers records is set by hand here.)"""
    model = tiny_model(family="v2")
    if isinstance(getattr(type(model), "tp_size", None), property):
        model._tp_size = 2
    else:
        model.tp_size = 2
    with pytest.raises(ValueError, match="tensor parallelism"):
        dcp_compile.apply(model, dcp_size=1)


@pytest.mark.skipif(not available("kimi-linear"), reason="not in this transformers")
@pytest.mark.parametrize("regions", [False, True], ids=["plain", "regions"])
def test_a_hybrid_model_serves_a_left_padded_batch(regions):
    """Kimi-Linear's KDA layers keep a recurrent state that transformers shields from the padding
    with a mask of their own (the padding's hidden states zeroed): the front end hands them that
    mask, and its MLA layers serve each row's length. Prompts of 1, 7 and 20 tokens in one
    left-padded batch give transformers' tokens and logits (it refused such a batch before); with
    regions, the MLA layers (rope-free here) are one region and the KDA layers run as they are."""
    from tests.hf.test_caches_and_generate import _left_padded

    reference = tiny_model(family="kimi-linear")
    model = dcp_compile.apply(copy.deepcopy(reference), dcp_size=1, kv_capacity=256, regions=regions)
    _, input_ids, mask = _left_padded((1, 7, 20), vocab=reference.config.vocab_size)
    got, want = (greedy_with(m, input_ids, attention_mask=mask) for m in (model, reference))
    assert torch.equal(got[0], want[0])
    assert float((got[1] - want[1]).abs().max()) < 1e-5
    if regions:
        assert {r.sites("absorb_mla") for r in dcp_compile.state(model).reports} == {1}  # two MLA layers, one region
    unmasked = torch.ones_like(mask)  # the same ids unmasked: the padding taken in, other logits
    assert float((greedy_with(reference, input_ids, attention_mask=unmasked)[1] - want[1]).abs().max()) > 1e-3


def greedy_with(model, input_ids, **kwargs):
    """generate()'s greedy tokens and per-step logits [B, steps, vocab]."""
    with torch.no_grad():
        out = model.generate(input_ids, max_new_tokens=NEW_TOKENS_PADDED, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.logits, 1)


NEW_TOKENS_PADDED = 6


def test_bf16_generate_matches_transformers_under_the_near_tie_rule():
    """bf16 weights and cache, a left-padded batch and an unpadded one: transformers' tokens under
    the near-tie rule, logits within 0.1 (bf16 rounds the absorbed and the expanded attention
    differently)."""
    from tests.hf.models import agree_near_ties
    from tests.hf.test_caches_and_generate import _left_padded

    reference = tiny_model().to(torch.bfloat16)
    model = dcp_compile.apply(copy.deepcopy(reference), dcp_size=1, kv_capacity=256)
    assert dcp_compile.state(model).kv_pool.cache(0).dtype == torch.bfloat16
    _, padded, mask = _left_padded((3, 9, 12))
    for input_ids, kwargs in ((prompt(), {}), (padded, {"attention_mask": mask})):
        results = []
        for served in (model, reference):
            with torch.no_grad():
                out = served.generate(input_ids, max_new_tokens=12, do_sample=False, output_logits=True,
                                      return_dict_in_generate=True, **kwargs)
            results.append((out.sequences, torch.stack(out.logits, 1)))
        agree_near_ties(results[0], results[1], 0.1)
