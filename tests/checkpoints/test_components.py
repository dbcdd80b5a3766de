"""The pieces of the reference model that read config fields, each against transformers' own code
on the same config: YaRN (released-style config.json files, as transformers reads them) and MoE
routing (every topk_method and scoring function)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from dcp_compile.models import rope
from dcp_compile.models.config import MoEConfig
from dcp_compile.models.hf_config import read_config
from dcp_compile.models.mla import MLAModel
from dcp_compile.models.moe import routing_weights
from tests.checkpoints import oracle

RELEASED_STYLE = dict(
    model_type="deepseek_v2", vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
    num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=32, q_lora_rank=None,
    qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=12, first_k_dense_replace=1, moe_layer_freq=1,
    n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2, n_group=1, topk_group=1, topk_method="greedy",
    scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=1.0, rms_norm_eps=1e-6,
    max_position_embeddings=163840, rope_theta=10000, hidden_act="silu", tie_word_embeddings=False,
)
ROPE_SCALINGS = {
    "none": None,
    # DeepSeek-V2-Lite's
    "v2-lite": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    # Kimi-K2's (beta_fast == beta_slow: a zero-width ramp)
    "kimi-k2": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    # mscale_all_dim alone: cos/sin scaled by yarn_mscale(factor), the softmax scale by mscale_all_dim's
    "mscale-all-dim-only": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 2048,
                            "mscale_all_dim": 0.8},
}


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("scaling", ROPE_SCALINGS, ids=str)
def test_rope_of_a_released_style_config_matches_transformers(tmp_path, model_type, scaling):
    import transformers

    (tmp_path / "config.json").write_text(json.dumps(
        dict(RELEASED_STYLE, model_type=model_type, rope_scaling=ROPE_SCALINGS[scaling])))
    ours = read_config(tmp_path).model
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    module = transformers.models.deepseek_v2.modeling_deepseek_v2 if model_type == "deepseek_v2" else \
        transformers.models.deepseek_v3.modeling_deepseek_v3
    rotary = (module.DeepseekV2RotaryEmbedding if model_type == "deepseek_v2" else module.DeepseekV3RotaryEmbedding)(config)
    attention = (module.DeepseekV2Attention if model_type == "deepseek_v2" else module.DeepseekV3Attention)(config, 0)
    # YaRN's frequencies are computed as transformers does, bit for bit; plain rope's as the
    # random-weight model always did (x ** -y rather than 1 / x ** y: within an ulp).
    if scaling != "none":
        assert torch.equal(rope.inverse_frequencies(ours), rotary.inv_freq)
    torch.testing.assert_close(rope.inverse_frequencies(ours), rotary.inv_freq, rtol=2e-7, atol=0)
    assert rope.attention_factor(ours) == pytest.approx(rotary.attention_scaling, rel=1e-12)
    assert rope.softmax_scale(ours) == pytest.approx(attention.scaling, rel=1e-12)


def _dense(weights: torch.Tensor, indices: torch.Tensor, experts: int) -> torch.Tensor:
    return torch.zeros(weights.shape[0], experts).scatter(1, indices, weights)


ROUTERS = {
    "v3-noaux_tc-sigmoid": ("deepseek_v3", {}),
    "v3-one-group": ("deepseek_v3", dict(n_group=1, topk_group=1)),
    "v3-not-normalised": ("deepseek_v3", dict(norm_topk_prob=False)),
    "v2-group_limited_greedy": ("deepseek_v2", {}),
    "v2-greedy": ("deepseek_v2", dict(topk_method="greedy", n_group=1, topk_group=1)),
}


@pytest.mark.parametrize("case", ROUTERS)
def test_routing_matches_transformers_routers(tmp_path, case):
    import transformers

    model_type, changes = ROUTERS[case]
    settings = dict(oracle.CONFIGS[model_type], **changes)
    module = transformers.models.deepseek_v2.modeling_deepseek_v2 if model_type == "deepseek_v2" else \
        transformers.models.deepseek_v3.modeling_deepseek_v3
    config = (transformers.DeepseekV2Config if model_type == "deepseek_v2" else transformers.DeepseekV3Config)(**settings)
    router = (module.DeepseekV2TopkRouter if model_type == "deepseek_v2" else module.DeepseekV3TopkRouter)(config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        bias = getattr(router, "e_score_correction_bias", None)
        if bias is not None:
            bias.copy_(0.3 * torch.randn(bias.shape, generator=gen))
    hidden = torch.randn(200, settings["hidden_size"], generator=gen)
    _, weights, indices = router(hidden)
    expected = _dense(weights, indices, settings["n_routed_experts"])
    config.save_pretrained(tmp_path)
    moe = read_config(tmp_path).model.moe
    ours = routing_weights(F.linear(hidden, router.weight), moe, bias)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-7)
    assert int((ours > 0).sum(dim=-1).min()) == settings["num_experts_per_tok"]


def test_norm_topk_prob_normalises_where_deepseek_v2s_code_does():
    """transformers' DeepseekV2 router ignores norm_topk_prob (no released V2 sets it); DeepSeek's
    own V2 code normalises the top-k weights when it is set, and so does this model."""
    moe = dataclasses.replace(_moe_config("deepseek_v2"), norm_topk_prob=True, routed_scaling_factor=2.0)
    weights = routing_weights(torch.randn(50, moe.n_routed_experts, generator=torch.Generator().manual_seed(0)), moe)
    torch.testing.assert_close(weights.sum(dim=-1), torch.full((50,), 2.0))


def _moe_config(model_type: str) -> MoEConfig:
    settings = oracle.CONFIGS[model_type]
    return MoEConfig(**{f.name: settings[f.name] for f in dataclasses.fields(MoEConfig) if f.name in settings})


@pytest.mark.parametrize("changes, kinds", [
    (dict(first_k_dense_replace=1, moe_layer_freq=2), ["MLP", "MLP", "MoE", "MLP", "MoE"]),
    (dict(first_k_dense_replace=0, moe_layer_freq=1), ["MoE"] * 5),
    (dict(n_routed_experts=None), ["MLP"] * 5),
])
def test_which_layers_are_moe(tmp_path, changes, kinds):
    """DeepSeek's rule: layer i is MoE where n_routed_experts is set, i >= first_k_dense_replace and
    i % moe_layer_freq == 0 (transformers' classes ignore moe_layer_freq; every release sets 1)."""
    (tmp_path / "config.json").write_text(json.dumps(dict(RELEASED_STYLE, num_hidden_layers=5, **changes)))
    cfg = read_config(tmp_path).model
    model = MLAModel(cfg, kv_capacity=16, device="meta")
    assert [type(layer.mlp).__name__ for layer in model.layers] == kinds
