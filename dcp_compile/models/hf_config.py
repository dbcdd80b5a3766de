"""Read a checkpoint folder's config.json (DeepSeek-V2, DeepSeek-V3, Kimi-K2) into an MLAModelConfig.

Every field that changes the numbers is mapped; a value the model cannot compute, or a field it
needs that is missing, is an error that names the field and the file. Missing optional fields
take transformers' defaults for the model type. Both config styles are read: the released one
(`rope_scaling`, `rope_theta`) and the one transformers >= 5 writes (`rope_parameters`).

Rope layout: DeepSeek's checkpoints order each rope part in interleaved pairs (x0, x1), (x2, x3),
...; transformers de-interleaves them before rotate-half (DeepSeek-V3's `rope_interleave`, true
by default) or rotates the pairs as complex numbers (DeepSeek-V2). The reference model rotates
halves, so the loader permutes the rope rows of q_b_proj / q_proj and kv_a_proj_with_mqa once
(`rope_interleaved`): the attention scores are the same.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from dcp_compile.models.config import SCORING_FUNCS, TOPK_METHODS, MLAModelConfig, MoEConfig, YarnScaling

CONFIG_FILE = "config.json"
MODEL_TYPES = ("deepseek_v3", "kimi_k2", "deepseek_v2")

_COMMON_DEFAULTS = dict(q_lora_rank=1536, hidden_act="silu", tie_word_embeddings=False)
_V3_DEFAULTS = dict(_COMMON_DEFAULTS, n_shared_experts=1, n_group=8, topk_group=4, topk_method="noaux_tc", scoring_func="sigmoid",
                    norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=3, moe_layer_freq=1,
                    rope_interleave=True)
DEFAULTS = {
    "deepseek_v3": _V3_DEFAULTS,
    "kimi_k2": _V3_DEFAULTS,
    "deepseek_v2": dict(_COMMON_DEFAULTS, n_shared_experts=2, n_group=1, topk_group=1, topk_method="greedy", scoring_func="softmax",
                        norm_topk_prob=False, routed_scaling_factor=1.0, first_k_dense_replace=0, moe_layer_freq=1),
}
"""transformers' config defaults per model type, for fields a config.json leaves out."""


@dataclass(frozen=True)
class CheckpointConfig:
    folder: Path
    model_type: str
    model: MLAModelConfig
    rope_interleaved: bool
    """The checkpoint's rope rows are interleaved pairs (see the module docstring)."""
    fp8_block: tuple[int, int] | None
    """Block shape of float8 weights' weight_scale_inv (quantization_config), if quantized."""

    @property
    def name(self) -> str:
        return self.folder.name


class _Fields:
    """config.json's values, checked one field at a time; errors name the field and the file."""

    def __init__(self, raw: dict, source: str, defaults: dict):
        self.raw, self.source, self.defaults = raw, source, defaults

    def error(self, field: str, problem: str) -> ValueError:
        return ValueError(f"{self.source}: {field} {problem}")

    def get(self, field: str):
        if field in self.raw:
            return self.raw[field]
        if field in self.defaults:
            return self.defaults[field]
        raise self.error(field, "is missing")

    def integer(self, field: str, minimum: int = 1, optional: bool = False) -> int | None:
        value = self.raw.get(field, self.defaults.get(field)) if optional else self.get(field)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(field, f"must be an integer >= {minimum}, got {value!r}")
        return value

    def number(self, field: str, value=None) -> float:
        """A finite number > 0: the field's, or `value` where given. Every such field of the config
        (rope theta, eps, scaling factors) is meaningless at 0, NaN or inf."""
        value = self.get(field) if value is None else value
        try:
            number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
        except OverflowError:  # an integer beyond a float's range
            number = math.inf
        if not math.isfinite(number) or number <= 0:
            raise self.error(field, f"must be a finite positive number, got {value!r}")
        return number

    def flag(self, field: str, null_is_false: bool = False) -> bool:
        value = self.get(field)
        if value is None and null_is_false:  # transformers tests these fields for truth
            return False
        if not isinstance(value, bool):
            raise self.error(field, f"must be true or false, got {value!r}")
        return value

    def choice(self, field: str, allowed) -> str:
        value = self.get(field)
        if value not in allowed:
            raise self.error(field, f"{value!r} is not supported; supported: {', '.join(allowed)}")
        return value


def read_config(folder: str | Path) -> CheckpointConfig:
    """Parse and check `folder`/config.json."""
    folder = Path(folder)
    path = folder / CONFIG_FILE
    if not folder.is_dir():
        raise ValueError(f"checkpoint folder {folder} does not exist")
    if not path.is_file():
        raise ValueError(f"{path} is missing: a checkpoint folder needs the model's config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object of the model's settings, not {_json_kind(raw)}")
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"{path}: model_type {model_type!r} is not supported; supported: {', '.join(MODEL_TYPES)}")
    fields = _Fields(raw, str(path), DEFAULTS[model_type])
    if raw.get("kv_lora_rank") is None:
        raise fields.error("kv_lora_rank", "is missing: load_pretrained reads MLA (multi-head latent attention) "
                                           "models only, whose config sets kv_lora_rank")
    if fields.get("hidden_act") != "silu":
        raise fields.error("hidden_act", f"{fields.get('hidden_act')!r} is not supported; supported: silu")
    for bias in ("attention_bias", "mlp_bias"):
        if raw.get(bias):
            raise fields.error(bias, "true is not supported: the model has no linear biases")
    rope_dim = fields.integer("qk_rope_head_dim", minimum=2)
    if rope_dim % 2:
        raise fields.error("qk_rope_head_dim", f"must be even, got {rope_dim}")
    theta, yarn = _rope(fields)
    eps = fields.number("rms_norm_eps", raw.get("rms_norm_eps", 1e-6))
    layers = fields.integer("num_hidden_layers")
    model = MLAModelConfig(
        vocab_size=fields.integer("vocab_size"),
        hidden_size=fields.integer("hidden_size"),
        num_heads=fields.integer("num_attention_heads"),
        q_lora_rank=fields.integer("q_lora_rank", optional=True),
        kv_lora_rank=fields.integer("kv_lora_rank"),
        qk_nope_head_dim=fields.integer("qk_nope_head_dim"),
        qk_rope_head_dim=rope_dim,
        v_head_dim=fields.integer("v_head_dim"),
        intermediate_size=fields.integer("intermediate_size"),
        layer_types=("mla",) * layers,
        rope_theta=theta,
        rms_norm_eps=eps,
        rope_scaling=yarn,
        moe=_moe(fields),
        tie_word_embeddings=fields.flag("tie_word_embeddings"),
    )
    interleaved = True if model_type == "deepseek_v2" else fields.flag("rope_interleave", null_is_false=True)
    return CheckpointConfig(folder, model_type, model, interleaved, _fp8_block(fields))


def _json_kind(value) -> str:
    if value is None:
        return "JSON null"
    kinds = ((bool, "a JSON boolean"), ((int, float), "a JSON number"), (str, "a JSON string"), (list, "a JSON array"))
    return next(kind for types, kind in kinds if isinstance(value, types))


def _rope(fields: _Fields) -> tuple[float, YarnScaling | None]:
    raw = fields.raw
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise fields.error("rope_scaling", f"must be an object or null, got {params!r}")
    name = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    # Only an absent (or null) theta takes transformers' default: a 0 is an error, not "unset".
    if params.get("rope_theta") is not None:
        theta = fields.number(f"{name}.rope_theta", params["rope_theta"])
    else:
        theta = fields.number("rope_theta", 10000.0 if raw.get("rope_theta") is None else raw["rope_theta"])
    for source, value in ((f"{name}.partial_rotary_factor", params.get("partial_rotary_factor")),
                          ("partial_rotary_factor", raw.get("partial_rotary_factor"))):
        if value not in (None, 1, 1.0):
            raise fields.error(source, f"{value!r} is not supported: the whole rope part rotates")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise fields.error(f"{name}.type", f"{rope_type!r} is not supported; supported: default (none), yarn")
    max_positions = raw.get("max_position_embeddings")
    original = params.get("original_max_position_embeddings") or max_positions
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise fields.error(f"{name}.original_max_position_embeddings", f"must be an integer >= 1, got {original!r}")
    if params.get("factor") is None:
        raise fields.error(f"{name}.factor", "is missing (YaRN's scaling factor)")
    factor = fields.number(f"{name}.factor", params["factor"])
    if factor < 1:
        raise fields.error(f"{name}.factor", f"must be >= 1, got {factor}")

    def optional(key: str, default: float) -> float:
        # transformers: an unset or zero beta / mscale takes the default; NaN is not zero.
        value = params.get(key)
        return fields.number(f"{name}.{key}", value) if value else default

    attention_factor = params.get("attention_factor")
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise fields.error(f"{name}.truncate", f"must be true or false, got {truncate!r}")
    return theta, YarnScaling(
        factor=factor, original_max_position_embeddings=original,
        beta_fast=optional("beta_fast", 32.0), beta_slow=optional("beta_slow", 1.0),
        mscale=optional("mscale", 0.0), mscale_all_dim=optional("mscale_all_dim", 0.0),
        attention_factor=None if attention_factor is None else fields.number(f"{name}.attention_factor", attention_factor),
        truncate=truncate,
    )


def _moe(fields: _Fields) -> MoEConfig | None:
    if fields.raw.get("n_routed_experts") is None:
        return None  # DeepSeek's code: a null n_routed_experts makes every layer dense
    experts = fields.integer("n_routed_experts")
    groups = fields.integer("n_group", optional=True) or 1
    moe = MoEConfig(
        n_routed_experts=experts,
        num_experts_per_tok=fields.integer("num_experts_per_tok"),
        moe_intermediate_size=fields.integer("moe_intermediate_size"),
        n_shared_experts=fields.integer("n_shared_experts", minimum=0, optional=True) or 0,
        n_group=groups,
        topk_group=fields.integer("topk_group", optional=True) or 1,
        topk_method=fields.choice("topk_method", TOPK_METHODS),
        scoring_func=fields.choice("scoring_func", SCORING_FUNCS),
        norm_topk_prob=fields.flag("norm_topk_prob", null_is_false=True),
        routed_scaling_factor=fields.number("routed_scaling_factor"),
        first_k_dense_replace=fields.integer("first_k_dense_replace", minimum=0),
        moe_layer_freq=fields.integer("moe_layer_freq"),
    )
    if moe.num_experts_per_tok > experts:
        raise fields.error("num_experts_per_tok", f"{moe.num_experts_per_tok} exceeds n_routed_experts {experts}")
    if experts % groups:
        raise fields.error("n_group", f"{groups} does not divide n_routed_experts {experts}")
    if moe.topk_method != "greedy" and groups > 1:
        if moe.topk_group > groups:
            raise fields.error("topk_group", f"{moe.topk_group} exceeds n_group {groups}")
        if moe.topk_group * (experts // groups) < moe.num_experts_per_tok:
            raise fields.error("topk_group", f"{moe.topk_group} groups of {experts // groups} experts cannot hold "
                                             f"num_experts_per_tok {moe.num_experts_per_tok}")
        if moe.topk_method == "noaux_tc" and experts // groups < 2:
            raise fields.error("n_group", f"noaux_tc scores a group by its top 2 experts; {groups} groups of "
                                          f"{experts} experts have fewer")
    return moe


def _fp8_block(fields: _Fields) -> tuple[int, int] | None:
    quant = fields.raw.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict) or quant.get("quant_method") != "fp8":
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise fields.error("quantization_config.quant_method", f"{method!r} is not supported; supported: fp8 "
                                                                "(block-quantized float8_e4m3fn, dequantized on load)")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise fields.error("quantization_config.fmt", f"{quant['fmt']!r} is not supported; supported: e4m3")
    block = quant.get("weight_block_size", [128, 128])
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise fields.error("quantization_config.weight_block_size", f"must be two positive integers, got {block!r}")
    return tuple(block)


def check_tp_size(ckpt: CheckpointConfig, tp_size: int) -> None:
    """Every TP-split width of the checkpoint's model divides over tp_size; the error names the field."""
    cfg, source = ckpt.model, ckpt.folder / CONFIG_FILE
    widths = [("num_attention_heads", cfg.num_heads)]
    if cfg.has_dense_layers:
        widths.append(("intermediate_size", cfg.intermediate_size))
    if cfg.has_moe_layers:
        widths.append(("moe_intermediate_size", cfg.moe.moe_intermediate_size))
    for field, width in widths:
        if width % tp_size:
            allowed = [t for t in range(1, cfg.num_heads + 1) if all(w % t == 0 for _, w in widths)]
            raise ValueError(f"{source}: {field} {width} does not split over tp_size {tp_size}; allowed tp sizes: {allowed}")
