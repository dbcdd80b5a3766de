"""Reference DeepSeek-V3 / Kimi style decoder whose MLA attention uses the canonical ops.

TP: q/kv_b are column-parallel over heads, o_proj is row-parallel with an all-reduce, and the
MLP (and each MoE expert) is column/row parallel. kv_a (the latent) is replicated. Weights come
from a weight source: WeightFactory generates them from the seed for the full model and slices
them per TP rank, so every TP/DCP layout computes the same function; a checkpoint's source
(dcp_compile.models.pretrained) reads each rank's slices from the files.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from dcp_compile import ops
from dcp_compile.models import rope
from dcp_compile.models.config import MLAModelConfig
from dcp_compile.models.functional import all_reduce, swiglu
from dcp_compile.models.linear_attention import StepRecord, commit_linear_attention, linear_attention
from dcp_compile.models.moe import MoE
from dcp_compile.runtime.kv_pool import MLAKVPool, check_cache_dtype
from dcp_compile.runtime.parallel import ParallelState


def per_head_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[T, H, K] by [H, K, N] -> [T, H, N], each head's rows by its own matrix. bmm, not einsum:
    einsum guards that T is not 1 (its broadcasting rule), so a graph symbolic in the batch would
    still compile a step of one token apart."""
    return torch.bmm(x.transpose(0, 1), weight).transpose(0, 1)


class WeightFactory:
    """Deterministic full-size weights, sliced for one TP rank. On the meta device only shapes
    are made (graph dumps and pass benchmarks of full-size models allocate nothing).

    The weight-source interface the model is built from: make() for a (sliced) matrix named
    `name` of full shape `shape`, norm() for a norm's weight. `dtype` overrides the model dtype
    (MoE routers stay in fp32)."""

    def __init__(self, seed: int, device, dtype):
        self.seed, self.device, self.dtype = seed, device, dtype

    def make(self, name: str, shape, fan_in: int, shard_dim: int | None = None, tp_rank: int = 0, tp_size: int = 1,
             dtype: torch.dtype | None = None):
        if self.device.type == "meta":
            full = torch.empty(*shape, device="meta")
        else:
            # Generated where the weights live: full-size layers on a GPU take milliseconds, not
            # minutes on the host. A given seed gives the same weights on one device type.
            gen = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
            full = torch.randn(*shape, generator=gen, device=self.device) / math.sqrt(fan_in)
        if shard_dim is not None:
            full = full.chunk(tp_size, dim=shard_dim)[tp_rank]
        return nn.Parameter(full.to(device=self.device, dtype=dtype or self.dtype).contiguous(), requires_grad=False)

    def norm(self, name: str, dim: int):
        return nn.Parameter(torch.ones(dim, device=self.device, dtype=self.dtype), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, weight: nn.Parameter, eps: float):
        super().__init__()
        self.weight = weight
        self.eps = eps

    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Rotate-half rope on the last dim of x [T, ..., P] at `positions` [T]; cos and sin are
    multiplied by `scale` (YaRN's attention factor)."""
    half = x.shape[-1] // 2
    angles = positions.float()[:, None] * inv_freq[None, :]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = angles.cos().view(shape), angles.sin().view(shape)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class MLAAttention(nn.Module):
    def __init__(self, cfg: MLAModelConfig, prefix: str, mla_index: int, pool: MLAKVPool,
                 par: ParallelState, weights: WeightFactory):
        super().__init__()
        if cfg.num_heads % par.tp_size:
            raise ValueError(f"{cfg.num_heads} heads do not split over tp_size {par.tp_size}")
        self.cfg, self.mla_index, self.pool = cfg, mla_index, pool
        self.heads = cfg.num_heads // par.tp_size
        self.tp_group_name = par.tp_group_name
        self.sm_scale = rope.softmax_scale(cfg)
        self.rope_scale = rope.attention_factor(cfg)
        self.register_buffer("rope_inv_freq", rope.inverse_frequencies(cfg, weights.device), persistent=False)
        tp = dict(tp_rank=par.tp_rank, tp_size=par.tp_size)
        H, D, R, P = cfg.num_heads, cfg.qk_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        if cfg.q_lora_rank:
            self.q_a = weights.make(f"{prefix}.q_a", (cfg.q_lora_rank, cfg.hidden_size), cfg.hidden_size)
            self.q_a_norm = RMSNorm(weights.norm(f"{prefix}.q_a_norm", cfg.q_lora_rank), cfg.latent_norm_eps)
            self.q_b = weights.make(f"{prefix}.q_b", (H * D, cfg.q_lora_rank), cfg.q_lora_rank, 0, **tp)
        else:
            self.q_proj = weights.make(f"{prefix}.q_proj", (H * D, cfg.hidden_size), cfg.hidden_size, 0, **tp)
        self.kv_a = weights.make(f"{prefix}.kv_a", (R + P, cfg.hidden_size), cfg.hidden_size)
        self.kv_a_norm = RMSNorm(weights.norm(f"{prefix}.kv_a_norm", R), cfg.latent_norm_eps)
        self.w_uk = weights.make(f"{prefix}.w_uk", (H, cfg.qk_nope_head_dim, R), cfg.qk_nope_head_dim, 0, **tp)
        self.w_uv = weights.make(f"{prefix}.w_uv", (H, R, cfg.v_head_dim), R, 0, **tp)
        self.o_proj = weights.make(f"{prefix}.o_proj", (cfg.hidden_size, H * cfg.v_head_dim), H * cfg.v_head_dim, 1, **tp)

    def forward(self, x, cache, positions, q_seq_ids, out_loc, req_to_token, seq_lens):
        """cache: this layer's buffer of the KV pool (self.pool.cache(self.mla_index)), passed in
        so that every layer's code is the same (a compile region serves them all)."""
        cfg, T = self.cfg, x.shape[0]
        if cfg.q_lora_rank:
            q = F.linear(self.q_a_norm(F.linear(x, self.q_a)), self.q_b)
        else:
            q = F.linear(x, self.q_proj)
        q = q.view(T, self.heads, cfg.qk_head_dim)
        q_nope, q_rope = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        q_rope = apply_rope(q_rope, positions, self.rope_inv_freq, self.rope_scale)
        kv = F.linear(x, self.kv_a)
        latent = self.kv_a_norm(kv[:, : cfg.kv_lora_rank])
        k_rope = apply_rope(kv[:, cfg.kv_lora_rank :], positions, self.rope_inv_freq, self.rope_scale)
        q_latent = per_head_matmul(q_nope, self.w_uk)

        ops.mla_kv_write(cache, latent, k_rope, out_loc)
        o_latent = ops.mla_attention(q_latent, q_rope.contiguous(), cache, req_to_token, seq_lens, q_seq_ids, positions, self.sm_scale)

        # clone, not reshape: a [T, H, v] seen from [H, T, v] flattens without a copy only at T = 1,
        # a guard that would split a batch-symbolic graph at one token
        o = per_head_matmul(o_latent, self.w_uv).clone(memory_format=torch.contiguous_format).view(T, -1)
        return all_reduce(F.linear(o, self.o_proj), self.tp_group_name)


class LinearAttentionLayer(nn.Module):
    def __init__(self, cfg: MLAModelConfig, prefix: str, max_requests: int, par: ParallelState, weights: WeightFactory):
        super().__init__()
        self.heads_total = cfg.hidden_size // cfg.linear_head_dim
        if self.heads_total % par.tp_size:
            raise ValueError(f"{self.heads_total} linear-attention heads do not split over tp_size {par.tp_size}")
        self.heads, self.head_dim = self.heads_total // par.tp_size, cfg.linear_head_dim
        self.tp_group_name = par.tp_group_name
        tp = dict(tp_rank=par.tp_rank, tp_size=par.tp_size)
        width = self.heads_total * self.head_dim
        self.qkv = nn.ParameterList(
            weights.make(f"{prefix}.{n}", (width, cfg.hidden_size), cfg.hidden_size, 0, **tp) for n in "qkv"
        )
        self.o_proj = weights.make(f"{prefix}.o_proj", (cfg.hidden_size, width), width, 1, **tp)
        self.register_buffer(
            "state", torch.zeros(max_requests + 1, self.heads, self.head_dim, self.head_dim, device=weights.device), persistent=False
        )
        record = StepRecord(max_requests + 1, self.heads, self.head_dim, weights.device)
        for name in ("start", "carried", "keys", "values"):
            self.register_buffer(f"step_{name}", getattr(record, name), persistent=False)

    def forward(self, x, q_seq_ids, state_slots, positions):
        q, k, v = (F.linear(x, w).view(x.shape[0], self.heads, self.head_dim) for w in self.qkv)
        o = linear_attention(q, F.normalize(k, dim=-1), v, self.state, q_seq_ids, state_slots, positions, 0.9,
                             self.step_start, self.step_carried, self.step_keys, self.step_values)
        return all_reduce(F.linear(o.reshape(x.shape[0], -1), self.o_proj), self.tp_group_name)

    def commit(self, state_slots: torch.Tensor, accepted: torch.Tensor) -> None:
        commit_linear_attention(self.state, self.step_start, self.step_carried, self.step_keys, self.step_values,
                                state_slots, accepted)


class MLP(nn.Module):
    def __init__(self, cfg: MLAModelConfig, prefix: str, par: ParallelState, weights: WeightFactory):
        super().__init__()
        if cfg.intermediate_size % par.tp_size:
            raise ValueError(f"intermediate_size {cfg.intermediate_size} does not split over tp_size {par.tp_size}")
        tp = dict(tp_rank=par.tp_rank, tp_size=par.tp_size)
        I, Hd = cfg.intermediate_size, cfg.hidden_size
        self.gate = weights.make(f"{prefix}.gate", (I, Hd), Hd, 0, **tp)
        self.up = weights.make(f"{prefix}.up", (I, Hd), Hd, 0, **tp)
        self.down = weights.make(f"{prefix}.down", (Hd, I), I, 1, **tp)
        self.tp_group_name = par.tp_group_name

    def forward(self, x):
        return all_reduce(swiglu(x, self.gate, self.up, self.down), self.tp_group_name)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, index, mla_index, pool, max_requests, par, weights):
        super().__init__()
        prefix = f"layers.{index}"
        self.kind = cfg.layer_types[index]
        self.input_norm = RMSNorm(weights.norm(f"{prefix}.input_norm", cfg.hidden_size), cfg.rms_norm_eps)
        self.post_norm = RMSNorm(weights.norm(f"{prefix}.post_norm", cfg.hidden_size), cfg.rms_norm_eps)
        if self.kind == "mla":
            self.attn = MLAAttention(cfg, f"{prefix}.attn", mla_index, pool, par, weights)
        elif self.kind == "linear":
            self.attn = LinearAttentionLayer(cfg, f"{prefix}.attn", max_requests, par, weights)
        else:
            raise ValueError(f"unknown layer type {self.kind!r}; expected 'mla' or 'linear'")
        if cfg.is_moe_layer(index):
            self.mlp = MoE(cfg, f"{prefix}.mlp", par, weights)
        else:
            self.mlp = MLP(cfg, f"{prefix}.mlp", par, weights)

    def forward(self, h, cache, positions, q_seq_ids, out_loc, req_to_token, seq_lens, state_slots):
        """cache: the layer's KV pool buffer (None for a linear-attention layer)."""
        x = self.input_norm(h)
        if self.kind == "mla":
            h = h + self.attn(x, cache, positions, q_seq_ids, out_loc, req_to_token, seq_lens)
        else:
            h = h + self.attn(x, q_seq_ids, state_slots, positions)
        return h + self.mlp(self.post_norm(h))


@torch.compiler.nested_compile_region
def _layer_region(layer: nn.Module, *args):
    """A decoder layer as one compile region: dynamo traces each kind of layer once and reuses
    its graph for the others (a `torch.ops.higher_order.invoke_subgraph` per layer), and
    dcp_compile's passes and the inner compiler see that graph once."""
    return layer(*args)


class MLAModel(nn.Module):
    """forward(*ForwardBatch.args()) -> logits [B, vocab] in fp32 for each request row."""

    def __init__(self, cfg: MLAModelConfig, kv_capacity: int, max_requests: int = 16,
                 par: ParallelState | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", seed: int = 0, page_size: int = 1, weights=None,
                 regions: bool = False):
        """weights: the weight source (default: WeightFactory(seed, device, dtype), random
        weights); dcp_compile.models.load_pretrained passes a checkpoint's. regions: each decoder
        layer is a compile region (torch.compiler.nested_compile_region), so that compiling a
        step costs one layer of each kind, not every layer."""
        super().__init__()
        self.regions = regions
        check_cache_dtype(dtype)
        par = par or ParallelState()
        self.cfg, self.parallel = cfg, par
        weights = weights or WeightFactory(seed, torch.device(device), dtype)
        self.kv_pool = MLAKVPool(cfg.num_mla_layers, kv_capacity, cfg.kv_lora_rank, cfg.qk_rope_head_dim, dtype, device, page_size) if cfg.num_mla_layers else None
        self.embed = weights.make("embed", (cfg.vocab_size, cfg.hidden_size), 1)
        mla_indices = [sum(t == "mla" for t in cfg.layer_types[:i]) for i in range(cfg.num_layers)]
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, mla_indices[i], self.kv_pool, max_requests, par, weights) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(weights.norm("norm", cfg.hidden_size), cfg.rms_norm_eps)
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            self.lm_head = weights.make("lm_head", (cfg.vocab_size, cfg.hidden_size), cfg.hidden_size)

    @property
    def num_local_heads(self) -> int:
        return self.cfg.num_heads // self.parallel.tp_size

    @staticmethod
    def attention_metadata(input_ids, positions, q_seq_ids, out_loc, req_to_token, seq_lens, state_slots, logits_index) -> dict:
        """The canonical attention metadata of a call, for dcp_compile's per-batch cost model."""
        return dict(req_to_token=req_to_token, seq_lens=seq_lens, q_seq_ids=q_seq_ids, q_positions=positions)

    @torch.no_grad()
    def commit_verify(self, state_slots: torch.Tensor, accepted: torch.Tensor) -> None:
        """After a verify step, keep only its accepted tokens in the recurrent state: each row b's
        slot `state_slots[b]` (the verify batch's `state_slots`; padded rows name slot 0) is set to
        the state after the first `accepted[b]` of that row's verify tokens, 0 <= accepted[b] <= k
        (0: the state from before the step). accepted is an int64 tensor on the model's device:
        no host sync. It reads what the rows' last step recorded, so it follows that verify step
        before the rows' next step. The latent KV needs no commit: RequestTable.truncate drops the
        rejected tokens' locations, and their rows are written again."""
        if state_slots.shape != accepted.shape or state_slots.dim() != 1:
            raise ValueError(f"state_slots and accepted must be two vectors of one length (a count per row of the "
                             f"verify batch), got shapes {tuple(state_slots.shape)} and {tuple(accepted.shape)}")
        if accepted.dtype != torch.int64:
            raise ValueError(f"accepted must be an int64 tensor of accepted token counts, got {accepted.dtype}")
        for layer in self.layers:
            if layer.kind == "linear":
                layer.attn.commit(state_slots, accepted)

    def forward(self, input_ids, positions, q_seq_ids, out_loc, req_to_token, seq_lens, state_slots, logits_index):
        h = F.embedding(input_ids, self.embed)
        for layer in self.layers:
            cache = self.kv_pool.cache(layer.attn.mla_index) if layer.kind == "mla" else None
            args = (h, cache, positions, q_seq_ids, out_loc, req_to_token, seq_lens, state_slots)
            h = _layer_region(layer, *args) if self.regions else layer(*args)
        return F.linear(self.norm(h)[logits_index], self.lm_head).float()
