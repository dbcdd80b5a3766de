"""Rope frequencies and scales: plain rope, and YaRN as DeepSeek-V2/V3 and Kimi-K2 use it.

YaRN follows transformers (modeling_rope_utils._compute_yarn_parameters and the DeepSeek models'
yarn_apply_mscale), which follows DeepSeek's code:
- inverse frequencies blend interpolated (divided by `factor`) and original ones over a linear
  ramp between the correction dimensions of beta_fast and beta_slow rotations;
- cos/sin are scaled by the attention factor: given, or mscale-derived;
- the softmax scale is multiplied by yarn_mscale(factor, mscale_all_dim)^2 where mscale_all_dim
  is set.
"""

from __future__ import annotations

import math

import torch

from dcp_compile.models.config import MLAModelConfig


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def inverse_frequencies(cfg: MLAModelConfig, device=None) -> torch.Tensor:
    """[P/2] fp32 inverse frequencies of the rope part (rotate-half pairs i and i + P/2)."""
    dim, base, yarn = cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling
    if yarn is None:
        half = dim // 2
        return base ** (-torch.arange(half, device=device, dtype=torch.float32) / half)
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).to(torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (yarn.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


def attention_factor(cfg: MLAModelConfig) -> float:
    """The scale of the rope part's cos and sin (1 without YaRN)."""
    yarn = cfg.rope_scaling
    if yarn is None:
        return 1.0
    if yarn.attention_factor is not None:
        return yarn.attention_factor
    if yarn.mscale and yarn.mscale_all_dim:
        return yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    return yarn_mscale(yarn.factor)


def softmax_scale(cfg: MLAModelConfig) -> float:
    scale = cfg.qk_head_dim ** -0.5
    yarn = cfg.rope_scaling
    if yarn is not None and yarn.mscale_all_dim:
        mscale = yarn_mscale(yarn.factor, yarn.mscale_all_dim)
        scale = scale * mscale * mscale
    return scale
