"""load_pretrained: the reference MLAModel with a released checkpoint's weights (DeepSeek-V2,
DeepSeek-V3, Kimi-K2 and models of their architecture, such as Moonlight).

The model is built from a weight source that reads each parameter where MLAModel asks for it,
already sliced for this TP rank: a rank reads its own share of the files and holds no more.

Checkpoint tensor -> model parameter (per layer, `model.layers.{i}.` prefix):
- self_attn.q_a_proj, q_a_layernorm, kv_a_layernorm, the layer norms: as they are (replicated);
- self_attn.q_b_proj / q_proj: this rank's heads (rows), each head's rope rows de-interleaved;
- self_attn.kv_a_proj_with_mqa: replicated, the rope rows de-interleaved;
- self_attn.kv_b_proj [H*(nope+v), R]: this rank's heads, split into the absorbed
  w_uk [H, nope, R] (the key rows) and w_uv [H, R, v] (the value rows, transposed);
- self_attn.o_proj: this rank's heads' columns;
- mlp.{gate,up}_proj rows and mlp.down_proj columns (dense layers), and the same split of every
  mlp.experts.{e} and of mlp.shared_experts (MoE layers); mlp.gate.weight and
  mlp.gate.e_score_correction_bias (the router) replicated in fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from dcp_compile.models.hf_config import CheckpointConfig, check_tp_size, read_config
from dcp_compile.models.mla import MLAModel
from dcp_compile.models.safetensors_reader import SafetensorsReader
from dcp_compile.runtime.parallel import ParallelState

_LAYER_TENSORS = {
    "input_norm": "input_layernorm.weight",
    "post_norm": "post_attention_layernorm.weight",
    "attn.q_a": "self_attn.q_a_proj.weight",
    "attn.q_a_norm": "self_attn.q_a_layernorm.weight",
    "attn.q_b": "self_attn.q_b_proj.weight",
    "attn.q_proj": "self_attn.q_proj.weight",
    "attn.kv_a": "self_attn.kv_a_proj_with_mqa.weight",
    "attn.kv_a_norm": "self_attn.kv_a_layernorm.weight",
    "attn.w_uk": "self_attn.kv_b_proj.weight",
    "attn.w_uv": "self_attn.kv_b_proj.weight",
    "attn.o_proj": "self_attn.o_proj.weight",
    "mlp.gate": "mlp.gate_proj.weight",
    "mlp.up": "mlp.up_proj.weight",
    "mlp.down": "mlp.down_proj.weight",
    "mlp.router": "mlp.gate.weight",
    "mlp.router_bias": "mlp.gate.e_score_correction_bias",
    "mlp.experts_gate": "mlp.experts.{expert}.gate_proj.weight",
    "mlp.experts_up": "mlp.experts.{expert}.up_proj.weight",
    "mlp.experts_down": "mlp.experts.{expert}.down_proj.weight",
    "mlp.shared_gate": "mlp.shared_experts.gate_proj.weight",
    "mlp.shared_up": "mlp.shared_experts.up_proj.weight",
    "mlp.shared_down": "mlp.shared_experts.down_proj.weight",
}
_MODEL_TENSORS = {"embed": "model.embed_tokens.weight", "lm_head": "lm_head.weight", "norm": "model.norm.weight"}


def _checkpoint_name(name: str) -> tuple[str, str]:
    """(the checkpoint's tensor name, the model's leaf name) of model weight `name`."""
    if name in _MODEL_TENSORS:
        return _MODEL_TENSORS[name], name
    _, index, leaf = name.split(".", 2)
    return f"model.layers.{index}.{_LAYER_TENSORS[leaf]}", leaf


class CheckpointWeights:
    """MLAModel's weight source (see mla.WeightFactory) reading from a checkpoint."""

    def __init__(self, reader: SafetensorsReader, ckpt: CheckpointConfig, device, dtype: torch.dtype):
        self.reader, self.ckpt, self.device, self.dtype = reader, ckpt, torch.device(device), dtype
        P = ckpt.model.qk_rope_head_dim
        # Interleaved pairs (0, 1), (2, 3), ... -> halves: evens first, then odds.
        self.rope_order = torch.cat([torch.arange(0, P, 2), torch.arange(1, P, 2)]) if ckpt.rope_interleaved else None

    def _param(self, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> nn.Parameter:
        return nn.Parameter(tensor.to(device=self.device, dtype=dtype or self.dtype).contiguous(), requires_grad=False)

    def norm(self, name: str, dim: int) -> nn.Parameter:
        tensor_name, _ = _checkpoint_name(name)
        return self._param(self.reader.read(tensor_name, (dim,), dtype=self.dtype))

    def make(self, name: str, shape, fan_in: int, shard_dim: int | None = None, tp_rank: int = 0, tp_size: int = 1,
             dtype: torch.dtype | None = None) -> nn.Parameter:
        tensor_name, leaf = _checkpoint_name(name)
        shape = tuple(shape)
        if leaf in ("attn.q_b", "attn.q_proj"):
            return self._param(self._query(tensor_name, shape, tp_rank, tp_size))
        if leaf == "attn.kv_a":
            return self._param(self._latent(tensor_name, shape))
        if leaf in ("attn.w_uk", "attn.w_uv"):
            return self._param(self._kv_b(tensor_name, leaf, shape, tp_rank, tp_size))
        if leaf.startswith("mlp.experts_"):
            return self._experts(tensor_name, shape, shard_dim, tp_rank, tp_size)
        dtype = dtype or self.dtype
        if shard_dim is None:
            return self._param(self.reader.read(tensor_name, shape, dtype=dtype), dtype)
        width = shape[shard_dim] // tp_size
        return self._param(self.reader.read(tensor_name, shape, shard_dim, tp_rank * width, (tp_rank + 1) * width, dtype),
                           dtype)

    def _deinterleave(self, rope_rows: torch.Tensor) -> torch.Tensor:
        return rope_rows if self.rope_order is None else rope_rows[..., self.rope_order, :]

    def _query(self, tensor_name: str, shape, tp_rank: int, tp_size: int) -> torch.Tensor:
        cfg = self.ckpt.model
        rows = shape[0] // tp_size
        weight = self.reader.read(tensor_name, shape, 0, tp_rank * rows, (tp_rank + 1) * rows, self.dtype)
        heads = weight.view(-1, cfg.qk_head_dim, shape[1])
        nope, rope = heads.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=1)
        return torch.cat([nope, self._deinterleave(rope)], dim=1).reshape(rows, shape[1])

    def _latent(self, tensor_name: str, shape) -> torch.Tensor:
        weight = self.reader.read(tensor_name, shape, dtype=self.dtype)
        latent, rope = weight.split([self.ckpt.model.kv_lora_rank, self.ckpt.model.qk_rope_head_dim], dim=0)
        return torch.cat([latent, self._deinterleave(rope)], dim=0)

    def _kv_b(self, tensor_name: str, leaf: str, shape, tp_rank: int, tp_size: int) -> torch.Tensor:
        cfg = self.ckpt.model
        per_head = cfg.qk_nope_head_dim + cfg.v_head_dim
        heads = shape[0] // tp_size
        weight = self.reader.read(tensor_name, (cfg.num_heads * per_head, cfg.kv_lora_rank), 0,
                                  tp_rank * heads * per_head, (tp_rank + 1) * heads * per_head, self.dtype)
        key, value = weight.view(heads, per_head, cfg.kv_lora_rank).split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)
        return key if leaf == "attn.w_uk" else value.transpose(1, 2)

    def _experts(self, tensor_name: str, shape, shard_dim: int, tp_rank: int, tp_size: int) -> nn.Parameter:
        """Routed experts stacked [E, ...]: each expert's slice is read into its row of one buffer."""
        experts, per_expert = shape[0], shape[1:]
        dim = shard_dim - 1
        width = per_expert[dim] // tp_size
        local = list(shape)
        local[shard_dim] = width
        stacked = torch.empty(local, dtype=self.dtype, device=self.device)
        for expert in range(experts):
            part = self.reader.read(tensor_name.format(expert=expert), per_expert, dim, tp_rank * width,
                                    (tp_rank + 1) * width, self.dtype)
            stacked[expert].copy_(part)
        return nn.Parameter(stacked, requires_grad=False)


def load_pretrained(path, *, kv_capacity: int, par: ParallelState | None = None, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", max_requests: int = 16, page_size: int = 1,
                    num_layers: int | None = None) -> MLAModel:
    """The MLAModel of checkpoint folder `path` (config.json + safetensors), this TP rank's share.

    par: this rank's ParallelState (parallel.build(tp_size) on every rank; default TP 1).
    dtype: the model's dtype (float8 weights are dequantized to it). num_layers: load the first
    layers only (None: all). The other arguments are MLAModel's. The model's forward, its
    attention_metadata and dcp_compile.apply work as with random weights.
    """
    par = par or ParallelState()
    ckpt = read_config(path)
    cfg = ckpt.model
    if num_layers is not None:
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= cfg.num_layers:
            raise ValueError(f"num_layers must be in [1, {cfg.num_layers}] (num_hidden_layers of "
                             f"{ckpt.folder / 'config.json'}), got {num_layers!r}")
        cfg = cfg.with_layers(num_layers)
    check_tp_size(ckpt, par.tp_size)
    with SafetensorsReader(ckpt.folder, ckpt.fp8_block) as reader:
        weights = CheckpointWeights(reader, ckpt, device, dtype)
        model = MLAModel(cfg, kv_capacity=kv_capacity, max_requests=max_requests, par=par, dtype=dtype,
                         device=device, page_size=page_size, weights=weights)
    model.checkpoint = ckpt
    return model
