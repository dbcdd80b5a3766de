"""Tiny transformers MLA models and the comparison the tests of dcp_compile/hf make.

Weights are drawn with initializer_range 0.2, large enough that a 10% error in the softmax scale
flips greedy tokens (test_negative_control checks that it does), in fp32 so that logits compare
to 1e-5. Module-level, so that spawned ranks can import them.
"""

from __future__ import annotations

import copy
import inspect

import torch

import dcp_compile

PROMPT = (2, 5)
"""(batch, prompt length): equal-length rows, no padding."""
NEW_TOKENS = 16


TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
            first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=12,
            qk_nope_head_dim=10, max_position_embeddings=64, initializer_range=0.2, attn_implementation="sdpa",
            eos_token_id=None, bos_token_id=None, pad_token_id=None)
"""Two layers (one dense MLP, one MoE), 4 heads, R = 16, P = 8, n = 10, v = 12."""
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
"""YaRN with both mscales: the softmax scale carries mscale_all_dim, the rope its attention factor."""


def one_region_per_kind(absorbed: list[int], kinds: int) -> bool:
    """Whether each graph absorbed one MLA site per compile region, and had one region per kind of
    decoder layer under apply(regions=True). On torch before 2.13 dynamo traced one MoE call of
    the prefill as a second region of its kind (the same at 4 and 12 layers; the decode graph
    keeps one), so up to two a kind there."""
    most = kinds if torch.__version__ >= "2.13" else 2 * kinds
    return all(kinds <= sites <= most for sites in absorbed)


FAMILIES = {"v3": "deepseek_v3", "v2": "deepseek_v2", "glm4-moe-lite": "glm4_moe_lite", "minicpm3": "minicpm3",
            "youtu": "youtu", "sarvam-mla": "sarvam_mla", "kimi-linear": "kimi_linear"}
"""Test family name: transformers model type. GLM-4-MoE-Lite, MiniCPM3, Youtu and Sarvam-MLA reuse
DeepSeek's MLA block; Kimi-Linear interleaves it with KDA linear attention (HYBRID)."""
HYBRID = dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
              mlp_layer_types=["dense", "sparse", "sparse", "sparse"], linear_head_dim=8, linear_num_heads=4,
              linear_conv_kernel_dim=4, num_local_experts=4)
"""Kimi-Linear's tiny layers: two KDA and two MLA (so that every family has 2 MLA layers)."""


def available(family: str) -> bool:
    """Whether the installed transformers has `family` (Sarvam-MLA came after 5.17)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return FAMILIES[family] in CONFIG_MAPPING_NAMES


def _classes(family: str):
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = FAMILIES[family]
    return (getattr(transformers, CONFIG_MAPPING_NAMES[model_type]),
            getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]))


def config(family: str = "v3", **overrides):
    """A tiny transformers config of `family` (FAMILIES): TINY's fields that its config takes."""
    config_class, _ = _classes(family)
    accepted = set(inspect.signature(config_class.__init__).parameters)
    family_fields = HYBRID if family == "kimi-linear" else {}
    fields = {k: v for k, v in {**TINY, **family_fields, **overrides}.items()
              if k in accepted or k in ("attn_implementation", "experts_implementation")}
    if "n_group" in accepted:
        fields.setdefault("n_group", 1)
        fields.setdefault("topk_group", 1)
    return config_class(**fields)


def tiny_model(seed: int = 0, family: str = "v3", **overrides):
    """A tiny transformers model of `family`, seeded: every rank builds the same weights."""
    torch.manual_seed(seed)
    return _classes(family)[1](config(family, **overrides)).eval()


def prompt(seed: int = 1, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, PROMPT, generator=torch.Generator().manual_seed(seed))


def greedy(model, input_ids):
    """generate()'s greedy tokens and per-step logits."""
    with torch.no_grad():
        out = model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


def compare(model, dcp_size: int = 1, **apply_kwargs) -> dict:
    """Greedy decoding of `model` untouched and of a copy through dcp_compile.apply."""
    reference = copy.deepcopy(model)
    input_ids = prompt(vocab=model.config.vocab_size)
    want_tokens, want_logits = greedy(reference, input_ids)
    compiled = dcp_compile.apply(model, dcp_size=dcp_size, **apply_kwargs)
    got_tokens, got_logits = greedy(compiled, input_ids)
    state = dcp_compile.state(compiled)
    stored = int((state.kv_pool.cache(0) != 0).any(dim=-1).sum())
    return dict(tokens_equal=bool(torch.equal(want_tokens, got_tokens)),
                max_logit_diff=float((want_logits - got_logits).abs().max()),
                # every position but the last generated token's is written
                tokens_total=input_ids.shape[0] * (input_ids.shape[1] + NEW_TOKENS - 1),
                tokens_stored=stored, pass_summary=state.pass_summary(), graphs=len(state.reports),
                absorbed=[report.sites("absorb_mla") for report in state.reports],
                graph_ops=[graph_ops(report) for report in state.reports],
                dcp_size=state.config.dcp_size, capacity_ratio=state.capacity.capacity_ratio,
                kernels=state.lowering.name)


def graph_ops(report) -> dict:
    """Op counts of one captured graph as dynamo captured it and after the last pass."""
    return {"before": dict(report.records[0].ops_before), "after": dict(report.records[-1].ops_after)}


def rank_compare(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """One rank of DCP runs over every rank: compare() of the same seeded model for each case,
    {"overrides": config fields, "apply": apply() arguments, "scale_factor": a factor the absorb
    pass's softmax scale is multiplied by (a negative control; 1 is the real run)}."""
    from dcp_compile.hf import absorb

    results = []
    matched = absorb.match_site
    for case in cases:
        factor = case.get("scale_factor", 1.0)

        def scaled(*args, **kwargs):
            site = matched(*args, **kwargs)
            site.sm_scale *= factor
            return site

        absorb.match_site = scaled
        try:
            results.append(compare(tiny_model(**case.get("overrides", {})), dcp_size=world_size, **case.get("apply", {})))
        finally:
            absorb.match_site = matched
    return results


def agree_near_ties(got, want, tolerance: float) -> float:
    """The near-tie rule for two generate() results (sequences, logits [B, steps, vocab]), as the
    harness's (dcp_compile/harness/scenario.py): a row's tokens may part only where the reference's
    two candidates are within 2 x tolerance of each other, and the logits before that within
    tolerance. Asserts it row by row; returns the largest logit difference compared."""
    (got_tokens, got_logits), (want_tokens, want_logits) = got, want
    got_logits, want_logits = got_logits.float(), want_logits.float()
    prompt = got_tokens.shape[1] - got_logits.shape[1]
    worst = 0.0
    for row in range(got_tokens.shape[0]):
        for step in range(got_logits.shape[1]):
            worst = max(worst, float((got_logits[row, step] - want_logits[row, step]).abs().max()))
            ours, theirs = int(got_tokens[row, prompt + step]), int(want_tokens[row, prompt + step])
            if ours != theirs:
                margin = float(want_logits[row, step, theirs] - want_logits[row, step, ours])
                assert margin <= 2 * tolerance, (row, step, margin)
                break  # the rows' histories part here
    assert worst < tolerance, worst
    return worst
