"""Compile regions for transformers models: `dcp_compile.apply(model, dcp_size, regions=True)`.

Each attention decoder layer's forward (an instance attribute; the class is untouched) becomes

    (the first attention layer) step = its cache layer's step_inputs(B, T)   # write locations, read lengths
    h = layer_region(layer, h, position_embeddings, mask, position_ids, kv_cache_i, *step)   # nested_compile_region
    (the last attention layer) every attention layer's length counter += T

and inside the region the layer's own forward runs with a one-layer cache (_LayerCache) whose
update writes the pool's layer with dcp::mla_kv_write and returns dcp::mla_cache_view, as
DCPCacheLayer.update does. Dynamo then traces one subgraph per kind of layer (dense, MoE) and the
backend (dcp_compile/regions.py) runs the absorb pass, the DCP passes and the inner compiler once
per kind, not once per layer.

Why the step inputs are computed once, from the first attention layer's counter, and the counters
move after the last layer: transformers builds the attention mask from the cache's length (the
first attention layer's), and the absorb pass lets a mask read only what the cache reads read;
and values every call passes alike leave the region (the DCP guard and local metadata then run
once a step, not once a layer). Every layer's counter holds the same length at a step's start.
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
def _layer_region(layer: nn.Module, hidden_states, position_embeddings, attention_mask, position_ids, kv_cache,
                  req_to_token, seq_lens, q_seq_ids, q_positions, loc, cache_name: str):
    step = StepInputs(req_to_token, seq_lens, q_seq_ids, q_positions, loc)
    # (cos, sin), DeepSeek-V2's one complex tensor, or none (Kimi-Linear's MLA, NoPE): as the model passed it
    rotary = {} if position_embeddings is None else {"position_embeddings": position_embeddings}
    return type(layer).forward(layer, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                               **rotary, **{cache_name: _LayerCache(kv_cache, step)})


SERVED = ("position_embeddings", "attention_mask", "position_ids", "use_cache")
"""What a layer in a region is called with besides its hidden states and cache (use_cache unread)."""


def _region_forward(self: nn.Module, hidden_states, *args, **kwargs):
    """A wrapped decoder layer's forward (bound to the layer)."""
    cache_name = self._dcp_region_cache_name
    cache = kwargs.get(cache_name, kwargs.get("past_key_values"))  # the deprecated name
    if cache is None:  # no cache (use_cache=False at dcp_size 1): nothing to write or read
        return type(self).forward(self, hidden_states, *args, **kwargs)
    check_compiling()
    other = sorted(set(kwargs) - {cache_name, "past_key_values", *SERVED})
    if args or other or not isinstance(cache, DCPCache):
        raise TypeError(f"a decoder layer in a compile region takes hidden_states, {', '.join(SERVED)} and a DCP "
                        f"cache; it was called with {len(args)} more positional argument(s), {other} and a cache of "
                        f"type {type(cache).__name__}")
    batch, tokens = hidden_states.shape[:2]
    attention = cache.attention_layers()
    own = cache.layers[self._dcp_region_index]
    if own is attention[0]:
        # Once a step, before any layer moves its counter: every layer's call then passes the same
        # values, which the backend hoists out of the region with what it computes from them.
        cache.region_step = attention[0].step_inputs(batch, tokens)
    step = cache.region_step
    out = _layer_region(self, hidden_states, kwargs.get("position_embeddings"), kwargs.get("attention_mask"),
                        kwargs.get("position_ids"), own.pool.cache(own.layer), step.req_to_token, step.seq_lens,
                        step.q_seq_ids, step.q_positions, step.loc, cache_name)
    if own is attention[-1]:
        for layer in attention:
            layer.cumulative_length.add_(tokens)
        cache.region_step = None
    return out


def region_layers(model: nn.Module, layer_types: list[str] | None) -> list[tuple[int, nn.Module]]:
    """The attention decoder layers of `model` that regions=True wraps, with their indices (each is
    its cache's layer of the same index); checked before apply changes anything."""
    layers = model.get_decoder().layers
    text = model.config.get_text_config(decoder=True)
    if len(layers) != text.num_hidden_layers:
        raise ValueError(f"regions=True: the decoder has {len(layers)} layers and the config {text.num_hidden_layers}; "
                         "each layer must be its cache's layer of the same index")
    # a hybrid's linear-attention layers keep their own state and forward
    return [(i, layer) for i, layer in enumerate(layers) if layer_types is None or layer_types[i] == "full_attention"]


def wrap_layers(layers: list[tuple[int, nn.Module]]) -> None:
    """Make each of these decoder layers call its forward inside a compile region."""
    for index, layer in layers:
        parameters = inspect.signature(type(layer).forward).parameters
        layer._dcp_region_cache_name = "cache" if "cache" in parameters else "past_key_values"
        layer._dcp_region_index = index
        layer.forward = types.MethodType(_region_forward, layer)
