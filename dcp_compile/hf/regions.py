"""Compile regions for transformers models: `dcp_compile.apply(model, dcp_size, regions=True)`.

Each attention decoder layer's forward (an instance attribute; the class is untouched) becomes

    step = first attention layer's cache.step_inputs(B, T)     # the write's locations, the read's lengths
    h = layer_region(layer, h, cos, sin, mask, position_ids, kv_cache_i, *step)   # a nested_compile_region
    (the last attention layer) every attention layer's length counter += T

and inside the region the layer's own forward runs with a one-layer cache (_LayerCache) whose
update writes the pool's layer with dcp::mla_kv_write and returns dcp::mla_cache_view, as
DCPCacheLayer.update does. Dynamo then traces one subgraph per kind of layer (dense, MoE) and the
backend (dcp_compile/regions.py) runs the absorb pass, the DCP passes and the inner compiler once
per kind, not once per layer.

Why the step inputs come from the first attention layer's counter and the counters move after
the last layer: transformers builds the attention mask from the cache's length (the first
attention layer's), and the absorb pass lets a mask read only what the cache reads read; every
layer's counter holds the same length at the start of a step.
Why a bound method, not a closure over the layer: dynamo (torch 2.13) lifted the first call's
weights into every call of a region whose module came from a closure cell (silently wrong
logits); through a bound method's `self` each call gets its own layer's.
"""

from __future__ import annotations

import inspect
import types

import torch
from torch import nn

from dcp_compile.hf.cache import DCPCache, StepInputs, check_compiling, write_and_read

class _LayerCache:
    """What a layer's attention sees as its cache inside a region: its own layer's write and read."""

    def __init__(self, kv_cache: torch.Tensor, step: StepInputs):
        self.kv_cache, self.step = kv_cache, step

    def update(self, key_states, value_states, *args, **kwargs):
        return write_and_read(self.kv_cache, self.step, key_states, value_states)


@torch.compiler.nested_compile_region
def _layer_region(layer: nn.Module, hidden_states, cos, sin, attention_mask, position_ids, kv_cache, req_to_token,
                  seq_lens, q_seq_ids, q_positions, loc, cache_name: str):
    step = StepInputs(req_to_token, seq_lens, q_seq_ids, q_positions, loc)
    rotary = {} if cos is None else {"position_embeddings": (cos, sin)}  # none: Kimi-Linear's MLA (NoPE)
    return type(layer).forward(layer, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                               **rotary, **{cache_name: _LayerCache(kv_cache, step)})


def _region_forward(self: nn.Module, hidden_states, *args, **kwargs):
    """A wrapped decoder layer's forward (bound to the layer)."""
    check_compiling()
    cache_name = self._dcp_region_cache_name
    cache = kwargs.pop(cache_name, None)
    if cache is None:
        cache = kwargs.pop("past_key_values", None)  # the deprecated name
    position_embeddings = kwargs.pop("position_embeddings", None)
    attention_mask, position_ids = kwargs.pop("attention_mask", None), kwargs.pop("position_ids", None)
    kwargs.pop("use_cache", None)
    if args or kwargs or not isinstance(cache, DCPCache):
        raise TypeError(f"a decoder layer in a compile region takes hidden_states, position_embeddings, attention_mask, "
                        f"position_ids and a DCP cache; it was called with {len(args)} more positional argument(s), "
                        f"{sorted(kwargs)} and a cache of type {type(cache).__name__}")
    batch, tokens = hidden_states.shape[:2]
    attention = cache.attention_layers()
    step = attention[0].step_inputs(batch, tokens)
    own = cache.layers[self._dcp_region_index]
    cos, sin = position_embeddings if position_embeddings is not None else (None, None)
    out = _layer_region(self, hidden_states, cos, sin, attention_mask, position_ids, own.pool.cache(own.layer),
                        step.req_to_token, step.seq_lens, step.q_seq_ids, step.q_positions, step.loc, cache_name)
    if own is attention[-1]:
        for layer in attention:
            layer.cumulative_length.add_(tokens)
    return out


def wrap_layers(model: nn.Module, layer_types: list[str] | None) -> None:
    """Make each attention decoder layer of `model` call its forward inside a compile region."""
    layers = model.model.layers if hasattr(model, "model") else model.layers
    for index, layer in enumerate(layers):
        if layer_types is not None and layer_types[index] != "full_attention":
            continue  # a hybrid's linear-attention layers keep their own state and forward
        parameters = inspect.signature(type(layer).forward).parameters
        layer._dcp_region_cache_name = "cache" if "cache" in parameters else "past_key_values"
        layer._dcp_region_index = index
        layer.forward = types.MethodType(_region_forward, layer)
