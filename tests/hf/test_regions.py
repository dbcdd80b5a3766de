"""apply(transformers model, dcp_size, regions=True) in one process (dcp_compile/hf/regions.py):
each attention decoder layer a compile region, so that the absorb pass, the DCP passes and the
inner compile run once per kind of layer. Against the untouched model's generate(): one dense
layer and MoE layers (two kinds) on the torch and FlashInfer back ends, and the NPU lowering with
generate()'s decode steps replayed from NPU graphs on the emulated npu device. DCP 2:
tests/hf/test_transformers_distributed.py; Kimi-Linear's left-padded batch with regions:
tests/hf/test_transformers_dcp1.py."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import dcp_compile  # noqa: E402
from tests.hf.models import NEW_TOKENS, compare, one_region_per_kind, prompt, tiny_model  # noqa: E402

DENSE_THEN_MOE = dict(num_hidden_layers=4, first_k_dense_replace=1)


@pytest.mark.parametrize("kernels", ["torch", "flashinfer"])
def test_each_kind_of_layer_is_absorbed_once_and_the_tokens_are_transformers(kernels, monkeypatch):
    """One dense layer and three MoE layers are two kinds: each graph absorbs two sites, not
    four, and lowers them to the back end's attention; the tokens and logits are transformers'.
    FlashInfer: both kinds' regions read one host-fed plan, which FlashInfer plans once a step
    (its host plan() is a large part of a GPU step's host time; it was planned once per kind)."""
    from dcp_compile.testing import flashinfer_standin

    planned = []
    plan = flashinfer_standin.ReferenceMLAWrapper.plan
    monkeypatch.setattr(flashinfer_standin.ReferenceMLAWrapper, "plan",
                        lambda wrapper, **kwargs: (planned.append(wrapper), plan(wrapper, **kwargs))[1])
    result = compare(tiny_model(**DENSE_THEN_MOE), kernels=kernels, regions=True)
    assert result["tokens_equal"] and result["max_logit_diff"] < 1e-5
    assert result["graphs"] == 2
    assert one_region_per_kind(result["absorbed"], kinds=2), result["absorbed"]
    if kernels == "flashinfer":
        assert result["pass_summary"]["lower_flashinfer_attention"] == result["pass_summary"]["absorb_mla"]
        assert len(planned) == NEW_TOKENS and len(set(map(id, planned))) == 2  # a step's plan: prefill's, decode's
    assert result["tokens_stored"] == result["tokens_total"]


def test_a_step_without_a_cache_runs_the_layers_as_they_are():
    """use_cache=False at dcp_size 1 (a forward without a cache): the wrapped layers call their own
    forward, and the logits are transformers'."""
    reference = tiny_model(**DENSE_THEN_MOE)
    model = dcp_compile.apply(copy.deepcopy(reference), dcp_size=1, regions=True)
    with torch.no_grad():
        got = model(prompt(), use_cache=False).logits
        want = reference(prompt(), use_cache=False).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_mask_that_reads_the_tokens_is_left_as_it_is_inside_a_region(monkeypatch):
    """The absorb pass's rule that an attention mask reads only the cache's own state holds inside
    a region, whose mask is an input computed outside it: a mask made to depend on the token
    embeddings (a padding mask would) leaves every layer to transformers' attention at dcp_size 1
    (at DCP > 1, an AbsorbError), named with the input it reads; the tokens are still transformers'."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3

    made = modeling_deepseek_v3.create_causal_mask

    def reading_the_tokens(*args, **kwargs):
        mask, embeds = made(*args, **kwargs), kwargs["inputs_embeds"]
        if mask is None:  # transformers' own eager steps may skip it
            return mask
        same = embeds[:, None, :1, :1] == embeds[:, None, :1, :1]  # all True, but a function of the tokens
        return mask & same if mask.dtype == torch.bool else mask + 0 * embeds[:, None, :1, :1]

    monkeypatch.setattr(modeling_deepseek_v3, "create_causal_mask", reading_the_tokens)
    reference = tiny_model(**DENSE_THEN_MOE)
    model = dcp_compile.apply(copy.deepcopy(reference), dcp_size=1, regions=True)
    with torch.no_grad():
        got = model.generate(prompt(), max_new_tokens=3, do_sample=False)
        want = reference.generate(prompt(), max_new_tokens=3, do_sample=False)
    assert torch.equal(got, want)
    assert dcp_compile.state(model).pass_summary()["absorb_mla"] == 0
    assert model._absorb.left_as_is and all("a mask computed from the cache's lengths only" in why and "input_ids" in why
                                            for why in model._absorb.left_as_is), model._absorb.left_as_is[:1]


def test_the_npu_lowering_replays_regional_decode_steps_from_npu_graphs(npu_emulator):
    """kernels='npu' (FIA's widths, bf16) with regions on the emulated npu device, generate()'s
    decode steps replayed from NPU graphs: transformers' tokens, every decode step replayed. One
    dense layer, then two MoE ones (DeepSeek-V3's and Kimi-K2's kinds): two kinds of region, one
    absorbed site each, and three FIA calls in the captured graph, each updated before every
    replay (one update per kind of region failed the first replay: "cpu_update_input has 2
    entries, the graph recorded 3 updatable calls"). The experts run batched_mm: transformers'
    grouped_mm counts tokens with an integer histc, which the emulator's CPU kernels lack."""
    reference = tiny_model(num_hidden_layers=3, first_k_dense_replace=1, kv_lora_rank=512, qk_rope_head_dim=64,
                           experts_implementation="batched_mm").to(torch.bfloat16)
    input_ids = prompt()
    model = dcp_compile.apply(copy.deepcopy(reference).to(npu_emulator), dcp_size=1, kernels="npu", regions=True,
                              block_size=16, kv_capacity=1024)
    model.capture_decode_graphs(batch_sizes=(1, 2), max_length=64)
    with torch.no_grad():
        want = reference.generate(input_ids, max_new_tokens=6, do_sample=False)
        got = model.generate(input_ids.to(npu_emulator), max_new_tokens=6, do_sample=False).cpu()
    assert torch.equal(got, want)
    assert model.decode_graphs.replays == 5
    assert one_region_per_kind([r.sites("absorb_mla") for r in dcp_compile.state(model).reports], kinds=2)
    (captured,) = model.decode_graphs.captured.values()
    assert len(model.decode_graphs.graphs.applied(captured.graph)) == 3


def test_regions_are_for_transformers_models():
    from dcp_compile.models.config import preset
    from dcp_compile.models.mla import MLAModel

    with pytest.raises(ValueError, match=r"regions=True wraps a transformers model's decoder layers.*MLAModel\(regions=True\)"):
        dcp_compile.apply(MLAModel(preset("tiny"), 64), 1, regions=True)
