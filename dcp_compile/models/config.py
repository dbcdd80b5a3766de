"""Model shapes: a tiny test model and the real shapes of DeepSeek-V3, Kimi-K2 and Kimi-Linear.

The real presets follow the public configs; their MoE blocks are replaced by a dense MLP of the
dense layers' width, since DCP touches attention only. Weights are random. A config read from a
checkpoint (dcp_compile.models.hf_config) also carries the MoE blocks and the rope scaling.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rope scaling (DeepSeek-V2/V3, Kimi-K2), with transformers' defaults and meaning."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    """Scales the rope part's cos/sin (with mscale_all_dim); 0 means unset."""
    mscale_all_dim: float = 0.0
    """Scales the softmax scale by yarn_mscale(factor, mscale_all_dim)^2; 0 means unset."""
    attention_factor: float | None = None
    """The cos/sin scale itself, where the config gives it; None derives it from the mscales."""
    truncate: bool = True
    """Round the correction range outwards to whole dimensions (DeepSeek's code does)."""


@dataclass(frozen=True)
class MoEConfig:
    """DeepSeek-style MoE blocks: routed experts with a top-k gate, plus shared experts."""

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "greedy"
    """greedy, group_limited_greedy (DeepSeek-V2) or noaux_tc (DeepSeek-V3: scores plus a
    correction bias choose the experts, the scores alone weight them)."""
    scoring_func: str = "softmax"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    """Layers before this one have a dense MLP."""
    moe_layer_freq: int = 1
    """From first_k_dense_replace on, every moe_layer_freq-th layer is MoE (by layer index)."""

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts


@dataclass(frozen=True)
class MLAModelConfig:
    vocab_size: int
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    """'mla' or 'linear' (a Kimi-Linear style recurrent layer that DCP leaves alone), per layer."""
    linear_head_dim: int = 16
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    latent_norm_eps: float = 1e-6
    """eps of the q_a and kv_a norms: DeepSeek's code leaves them at 1e-6 whatever rms_norm_eps is."""
    rope_scaling: YarnScaling | None = None
    moe: MoEConfig | None = None
    """None: every layer has a dense MLP of intermediate_size."""
    tie_word_embeddings: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def num_mla_layers(self) -> int:
        return sum(t == "mla" for t in self.layer_types)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, index: int) -> bool:
        moe = self.moe
        return moe is not None and index >= moe.first_k_dense_replace and index % moe.moe_layer_freq == 0

    @property
    def has_dense_layers(self) -> bool:
        return not all(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def has_moe_layers(self) -> bool:
        return any(self.is_moe_layer(i) for i in range(self.num_layers))

    def with_layers(self, num_layers: int) -> "MLAModelConfig":
        """The same shapes with `num_layers` layers, keeping the preset's layer pattern."""
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        pattern = self.layer_types
        return dataclasses.replace(self, layer_types=tuple(pattern[i % len(pattern)] for i in range(num_layers)))

    def replace(self, **changes) -> "MLAModelConfig":
        return dataclasses.replace(self, **changes)


def _kimi_linear_pattern(num_layers: int) -> tuple[str, ...]:
    # Three KDA layers, then one MLA layer.
    return tuple("mla" if i % 4 == 3 else "linear" for i in range(num_layers))


PRESETS: dict[str, MLAModelConfig] = {
    "tiny": MLAModelConfig(
        vocab_size=256, hidden_size=64, num_heads=8, q_lora_rank=48, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128,
        layer_types=("mla", "linear", "mla", "mla"), linear_head_dim=8,
    ),
    # The tiny model with DeepSeek's latent cache (R = 512, P = 64): what Ascend FIA's MLA path
    # accepts (docs/ascend.md §4.1), so the NPU lowering runs on CPU at test sizes.
    "tiny-512": MLAModelConfig(
        vocab_size=256, hidden_size=64, num_heads=8, q_lora_rank=48, kv_lora_rank=512,
        qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=16, intermediate_size=128,
        layer_types=("mla", "linear", "mla", "mla"), linear_head_dim=8,
    ),
    # tiny-512 with DeepSeek-V3's and Kimi-K2's two kinds of MLA layer: a dense first layer, then
    # MoE ones (first_k_dense_replace = 1); under compile regions, two kinds of region. Every token
    # goes to all 4 experts: a top-2 choice is a step function of the router's logits, and in bf16
    # the few ulps by which DCP's summation order moves them flip it now and then (a logit off by
    # 0.47 in a sweep case, 0.07 with every expert), which is the router's rounding, not DCP's.
    "tiny-512-moe": MLAModelConfig(
        vocab_size=256, hidden_size=64, num_heads=8, q_lora_rank=48, kv_lora_rank=512,
        qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=16, intermediate_size=128,
        layer_types=("mla",) * 3,
        moe=MoEConfig(n_routed_experts=4, num_experts_per_tok=4, moe_intermediate_size=32, n_shared_experts=1,
                      first_k_dense_replace=1),
    ),
    "deepseek-v3": MLAModelConfig(
        vocab_size=129280, hidden_size=7168, num_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=18432,
        layer_types=("mla",) * 61,
    ),
    "kimi-k2": MLAModelConfig(
        vocab_size=163840, hidden_size=7168, num_heads=64, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=18432,
        layer_types=("mla",) * 61,
    ),
    "kimi-linear": MLAModelConfig(
        vocab_size=163840, hidden_size=2304, num_heads=32, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=9216,
        layer_types=_kimi_linear_pattern(27), linear_head_dim=128,
    ),
}


def preset(name: str) -> MLAModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]


def allowed_tp_sizes(cfg: MLAModelConfig) -> list[int]:
    """TP sizes that split every head-parallel dimension of the model evenly."""
    widths = [cfg.num_heads]
    if cfg.has_dense_layers:
        widths.append(cfg.intermediate_size)
    if cfg.has_moe_layers:
        widths.append(cfg.moe.moe_intermediate_size)
    if "linear" in cfg.layer_types:
        widths.append(cfg.hidden_size // cfg.linear_head_dim)
    return [t for t in range(1, cfg.num_heads + 1) if all(w % t == 0 for w in widths)]
