"""The decode steps of the transformers front end replayed from device graphs (CUDA graphs, or
Ascend NPU graphs), inside generate().

    model = dcp_compile.apply(DeepseekV3ForCausalLM(config).cuda(), dcp_size=2)
    model.capture_decode_graphs(batch_sizes=(1, 2, 4, 8), max_length=4096)
    model.generate(input_ids, max_new_tokens=64)     # its one-token steps replay graphs

A graph is captured once per batch size, at the first one-token step of that size, from the
compiled step (the graph the step compiles for one token, symbolic in the cache's width, is the
one captured), over a static cache of `max_length` columns that owns no KV locations: during
capture its rows are all padding (length 0, the token at location 0, which the write skips), so
capture writes and reads no KV.
Before each replay the step's inputs are copied into the graph's static buffers, on the device:
token ids, positions, the cache's page table (the columns past its width zeroed), its padding and
each attention layer's length counter; after it, the cache's counters advance as the graph's did.
Which steps replay: one token a row, a batch size in `batch_sizes`, a cache of at most
`max_length` columns whose linear-attention layers (a hybrid's) do not record their past for
assisted generation, and the same arguments (names and non-tensor values) as the step the graph
was captured from; any other step runs the compiled step as before. A hybrid model's
linear-attention layers (transformers' own, whose state the prefill allocates) are captured over
a static copy of the first cache's state; the cache a graph replays points its layers at those
tensors (its values copied in once, when the graph takes it over), so a replay updates its state
in place. The host-side checks and the DCP peers' agreement
run before every step, replayed or not.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from dcp_compile import shapes
from dcp_compile.hf.cache import DCPCache, DCPCacheLayer, step_host_metadata
from dcp_compile.runtime.graph_runner import device_graphs, feed_replay


@dataclass
class _Captured:
    graph: object
    cache: DCPCache
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    output: object
    """The step's output at capture (a transformers ModelOutput), its logits the graph's."""
    feeds: list
    """The host feeds of the graphs the captured step ran (back ends that plan on the host), fed
    before every replay."""
    runs: list
    """The feed of each graph run of the captured step, in order (HostSlot.runs: a compile
    region's once per call), which lays out the replay's graph updates."""
    holds: Callable[[], DCPCache | None] = lambda: None
    """The cache whose page table and padding the static cache holds (a weak reference)."""


class DecodeGraphs:
    """One front end's captured decode graphs. `front`: the DCPTransformersModel."""

    def __init__(self, front, batch_sizes, max_length: int):
        sizes = tuple(sorted(set(batch_sizes)))
        if not sizes or sizes[0] < 1:
            raise ValueError(f"batch_sizes must be positive batch sizes, got {batch_sizes}")
        if max_length < 2:
            raise ValueError(f"max_length must be at least 2 columns, got {max_length}")
        self.front, self.batch_sizes, self.max_length = front, sizes, max_length
        self.graphs = device_graphs(front.dcp_state.kv_pool.cache(0).device)
        self.captured: dict[tuple, _Captured] = {}
        self.replays = 0

    def key(self, call: dict, cache_kwarg: str):
        """The captured graph's key for a step, or None where the step does not replay."""
        input_ids, cache = call.get("input_ids"), call.get(cache_kwarg)
        if (input_ids is None or call.get("inputs_embeds") is not None or not isinstance(cache, DCPCache)
                or input_ids.shape[1] != 1 or input_ids.shape[0] not in self.batch_sizes
                or cache.max_length > self.max_length or _records_past(cache)):
            return None
        others = []
        for name, value in sorted(call.items()):
            if name in ("input_ids", "position_ids", cache_kwarg):
                continue
            if isinstance(value, torch.Tensor):
                return None  # an input the static buffers do not hold
            try:
                hash(value)
            except TypeError:
                return None
            others.append((name, value))
        return (input_ids.shape[0], tuple(others))

    def run(self, call: dict, cache_kwarg: str, key):
        captured = self.captured.get(key)
        if captured is None:
            captured = self.captured[key] = self._capture(call, cache_kwarg, key[0])
        cache: DCPCache = call[cache_kwarg]
        width = cache.max_length
        updates = None
        if captured.feeds:  # the kernels' host inputs (lengths, block tables, plans) for this step
            host = step_host_metadata(cache, 1, width=self.max_length)
            updates = feed_replay(captured.feeds, captured.runs, host)
        captured.input_ids.copy_(call["input_ids"])
        captured.position_ids.copy_(call["position_ids"])
        if captured.holds() is not cache:  # a cache's page table and padding never change
            table = captured.cache.req_to_token
            table[:, :width].copy_(cache.req_to_token)
            table[:, width:].zero_()
            captured.cache.pad_tensor.copy_(cache.pad_tensor)
            _hold_linear_state(captured.cache, cache, captured.holds())
            captured.holds = weakref.ref(cache)
        layers = cache.attention_layers()
        for static, layer in zip(captured.cache.attention_layers(), layers):
            static.cumulative_length.copy_(layer.cumulative_length)
        self.graphs.replay(captured.graph, updates)
        for layer in layers:
            layer.cumulative_length.add_(1)
        self.replays += 1
        output = copy.copy(captured.output)
        output["logits"] = captured.output["logits"].clone()
        output[cache_kwarg if cache_kwarg in output else "past_key_values"] = cache
        return output

    def _capture(self, call: dict, cache_kwarg: str, batch: int) -> _Captured:
        front = self.front
        state = front.dcp_state
        cache = DCPCache(state.kv_pool, batch, self.max_length, front._layer_types, placeholder=True)
        for static, real in zip(_linear_layers(cache), _linear_layers(call[cache_kwarg])):
            _mirror(static, real)
        input_ids = torch.zeros_like(call["input_ids"])
        position_ids = torch.zeros_like(call["position_ids"])
        kwargs = dict(call, input_ids=input_ids, position_ids=position_ids, **{cache_kwarg: cache})
        symbolic = front.symbolic_steps()
        compiled = front._compiled_step.variant(front._strategy, symbolic)
        # Every row one column of padding: nothing written (location 0), nothing read (length 0).
        cache.set_padding([1] * batch)
        host = (step_host_metadata(cache, 1, length=0)
                if state.lowering.plans_on_host else None)

        def prepare():
            for layer in cache.attention_layers():
                layer.cumulative_length.zero_()

        def step():
            state.host_slot.begin(host)
            try:
                if not symbolic:
                    return compiled(**kwargs)
                _, marked = front._symbolic_lengths((), kwargs)
                with shapes.distinct_sizes():
                    return compiled(**marked)
            finally:
                state.host_slot.end()

        graph, output = self.graphs.capture(step, prepare)
        slot = state.host_slot
        return _Captured(graph, cache, input_ids, position_ids, output, list(slot.fed), list(slot.runs))


_LINEAR_STATES = ("conv_states", "recurrent_states")
"""A linear-attention layer's state tensors, by state index (transformers' LinearAttentionLayer)."""


def _linear_layers(cache: DCPCache) -> list:
    return [layer for layer in cache.layers if not isinstance(layer, DCPCacheLayer)]


def _records_past(cache: DCPCache) -> bool:
    """Whether a linear-attention layer of `cache` records its past (assisted generation): its
    steps grow its conv state and keep its recurrent states for a crop, which a graph captured
    over fixed state tensors does not do."""
    return any(getattr(layer, "record_past", False) for layer in _linear_layers(cache))


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {key: _clone(item) for key, item in value.items()}
    return copy.copy(value)


def _mirror(static, real) -> None:
    """A static cache's linear-attention layer made like a real cache's, after its prefill: the
    same state tensors (shapes, dtypes, devices), flags and kernel sizes, so the graph captured
    over it takes the decode branch and updates tensors of the real ones' shapes in place."""
    for name, value in vars(real).items():
        setattr(static, name, _clone(value))


def _hold_linear_state(static_cache: DCPCache, cache: DCPCache, previous: DCPCache | None) -> None:
    """The static cache's linear-attention state becomes `cache`'s: its values copied in once, and
    `cache`'s layers pointed at the static tensors, which every replay (and any step of `cache`
    outside the graph) updates in place, so a decode step copies no state. The cache held before
    (`previous`, if still alive) gets its state back in tensors of its own."""
    for i, static in enumerate(_linear_layers(static_cache)):
        if previous is not None:
            old = _linear_layers(previous)[i]
            for name in _LINEAR_STATES:
                setattr(old, name, _clone(getattr(static, name)))
            old.cumulative_length_linear = static.cumulative_length_linear.clone()
        real = _linear_layers(cache)[i]
        for name in _LINEAR_STATES:
            held, own = getattr(static, name), getattr(real, name)
            for index, tensor in own.items():
                if tensor is not None:
                    held[index].copy_(tensor)
                    own[index] = held[index]
        static.cumulative_length_linear.copy_(real.cumulative_length_linear)
        real.cumulative_length_linear = static.cumulative_length_linear
