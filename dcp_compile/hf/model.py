"""dcp_compile.apply for an unmodified transformers MLA model (DeepSeek-V3 / V2 and what loads as them).

    model = dcp_compile.apply(DeepseekV3ForCausalLM(config), dcp_size=2)   # on every rank
    tokens = model.generate(input_ids, max_new_tokens=16, do_sample=False)

What apply does here:
- a KV pool of `kv_capacity` rows per rank for every decoder layer (latent R + rope P per row),
  resharded by tokens over the DCP group: the model's own per-layer cache is never allocated;
- the model's `forward` (an instance attribute, the class is untouched) becomes the DCP step:
  host-side checks of the call, then the model's own forward compiled (fullgraph) with the DCP
  backend, whose first pass is the absorb pass (dcp_compile/hf/absorb.py), then the DCP passes,
  run by the compiled-step core every front end shares (dcp_compile/compiled_step.py): after a
  failed step a rank with DCP peers runs no more steps, a device error flag a step set (a batch
  the kernels masked) raises at the next step, and the DCP peers agree on each batch shape;
- attention stays replicated (transformers' DeepSeek-V3 TP plan does not split it): every rank
  of the DCP group runs the same tokens with every head, attends over its own shard, and the
  exchange of (out, LSE) with the LSE merge gives every rank the whole attention
  (passes/replicated_q_attention.py);
- any kernel back end: for those that plan on the host (Lowering.plans_on_host) the pool is
  made of whole pages (Lowering.pool_page_size, `block_size`) and each step's host metadata comes
  from the cache's host view of its page table (hf/cache.step_host_metadata).

What the step refuses, before any graph runs: a transformers cache (it would hold the whole KV
on every rank), a cache released or of another pool, token ids that are not integers in
[0, vocab_size), an attention mask other than left padding (a left-padded batch is served: each
row's padding is its own length in the cache), position ids other than the cache's positions, a
step past the cache's `max_length`, hidden states and attention weights as outputs. The step's
rows, tokens and cache width are symbolic: one graph serves every prompt length. Under DCP the
ranks' steps must agree (shapes, cache position, token ids: dcp_compile/hf/agreement.py), and a
sampling generate() draws every rank's token with the group's first rank's generator. generate()
serves greedy and sampled decoding, num_return_sequences, classifier-free guidance
(guidance_scale) and transformers' assisted generation of one row (assistant_model, a plain
transformers model or one applied with dcp_compile; prompt_lookup_num_tokens: each verify step's
rejected draft tokens are cropped off the cache, hf/cache.py), and refuses beam search and
use_cache=False by name; its decode steps replay
device graphs after capture_decode_graphs (dcp_compile/hf/graphs.py). Caches of one model never share KV locations
(dcp_compile/hf/locations.py). The model passed to apply is the one that runs: its forward now
is the DCP step.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect

import torch
import torch.distributed as dist
from torch import nn

from dcp_compile.binding import bind
from dcp_compile.compiled_step import CompiledStep, DCPState
from dcp_compile.config import DCPConfig
from dcp_compile.hf.absorb import AbsorbError, AbsorbMLA
from dcp_compile.hf.agreement import GroupAgreement
from dcp_compile.hf.cache import LINEAR_ATTENTION, DCPCache, step_host_metadata
from dcp_compile.hf.locations import allocator
from dcp_compile.hf.regions import region_layers, wrap_layers
from dcp_compile.strategy import REPLICATED_Q
from dcp_compile.runtime import parallel
from dcp_compile.lowering import registry
from dcp_compile.runtime.failure import PeerFailedError, agreeing
from dcp_compile.runtime.host_metadata import HostMetadata
from dcp_compile.runtime.kv_pool import MLAKVPool, PoolSpec

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "deepseek_v2", "glm4_moe_lite", "minicpm3", "youtu", "sarvam_mla", "kimi_linear")
"""transformers model types whose attention the absorb pass knows: DeepSeek-V3 (Kimi-K2 and
Moonlight load as it) and V2, and the families whose attention is DeepSeek's MLA block
(GLM-4-MoE-Lite, MiniCPM3, Youtu, Sarvam-MLA); each is tested against transformers (tests/hf)."""

_CACHE_LENGTH_IN_GENERATE: contextvars.ContextVar[int | None] = contextvars.ContextVar("dcp_cache_length", default=None)
"""Inside generate(): the positions a cache made for a step called without one gets (classifier-free
guidance's unconditional pass calls the model so, then again with that cache for each new token)."""


def _decoding_in_generate(input_ids: torch.Tensor | None) -> bool:
    """Whether this step is one of generate()'s decode steps on a device: one token a row, inside
    our generate(). Such a step reads nothing back from the device (its checks are the device's)."""
    return (_CACHE_LENGTH_IN_GENERATE.get() is not None and input_ids is not None
            and input_ids.device.type != "cpu" and input_ids.dim() == 2 and input_ids.shape[1] == 1)


_UNSERVED_OUTPUTS = ("output_hidden_states", "output_attentions")
PADDING_MASK_INPUT = "_attention_mask_"
"""How dynamo's name of the step's attention_mask input ends (l_kwargs_attention_mask_)."""


def _unserved_output(name: str) -> str:
    why = ("the DCP step's attention is absorbed MLA over the sharded latent cache, which never forms per-head "
           "attention weights" if name == "output_attentions" else
           "transformers records them with hooks on the decoder layers, which the DCP step (the forward compiled whole "
           "with fullgraph) cannot trace")
    return f"{name}=True: {why}; leave {name} at False (its default)"


def _layer_types(text) -> list[str] | None:
    """A hybrid model's layer types (attention, or linear attention: Kimi-Linear), else None."""
    kinds = getattr(text, "layer_types", None)
    if not kinds:
        return None
    kinds = list(kinds)[:text.num_hidden_layers]
    other = sorted(set(kinds) - {"full_attention", LINEAR_ATTENTION})
    if other:
        raise ValueError(f"layer types {other}: the front end serves full attention (MLA) and linear attention layers")
    return kinds


def cache_kwarg(model: nn.Module) -> str:
    """The name the model's forward takes its cache under: `cache` since transformers 5.2x,
    `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def _check_model(model: nn.Module, config: DCPConfig) -> None:
    from torch.distributed.tensor import DTensor

    text = model.config.get_text_config(decoder=True)
    model_type = getattr(text, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{type(model).__name__} (model_type {model_type!r}) is not an MLA family dcp_compile knows: "
                         f"supported model types are {list(SUPPORTED_MODEL_TYPES)}")
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if rope_type is not None and "dynamic" in rope_type:
        raise ValueError(f"rope_type {rope_type!r} (dynamic NTK) recomputes the rotary frequencies whenever a step's "
                         "largest position passes the longest seen so far, a branch on the data that a compiled step "
                         "cannot take; use a static scaling of the same factor ('linear', 'yarn' or 'longrope')")
    if not hasattr(model, "generate"):
        raise ValueError(f"{type(model).__name__} has no generate(): apply takes the causal-LM model "
                         "(e.g. DeepseekV3ForCausalLM)")
    if (getattr(model, "tp_size", None) or 1) > 1 or any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError(f"{type(model).__name__} was loaded with transformers' tensor parallelism (a TP plan, "
                         "DistributedConfig): a plan that splits attention heads across ranks (DeepSeek-V2's does) is not "
                         "served; the front end runs every head on every rank (replicated-q). Load it without a TP plan")
    if config.dcp_size > 1:
        if text._attn_implementation not in ("sdpa", "eager"):
            raise ValueError(f"attn_implementation {text._attn_implementation!r}: under DCP the absorb pass rewrites "
                             "'sdpa' and 'eager' attention only")
        if config.attention_strategy not in ("auto", REPLICATED_Q):
            raise ValueError(f"attention_strategy {config.attention_strategy!r}: a transformers model's attention is "
                             f"replicated on every rank, and runs the {REPLICATED_Q!r} strategy")


def apply_transformers(model: nn.Module, config: DCPConfig, kv_capacity: int | None = None,
                       kv_keep: str = "memory", block_size: int | None = None,
                       regions: bool = False) -> "DCPTransformersModel":
    """dcp_compile.apply's path for transformers models (see the module docstring).

    kv_capacity: KV locations of the pool before sharding (default 1 + the model's
    max_position_embeddings), rounded up to whole pages; kv_keep='memory' keeps that many rows
    per rank and grows the logical capacity dcp_size-fold, 'capacity' keeps the capacity and
    shrinks the rows. block_size: the KV rows of one page on one rank, for back ends that read
    the pool as blocks (default the back end's: Lowering.default_block_size). regions: each
    attention decoder layer a compile region (dcp_compile/hf/regions.py)."""
    _check_model(model, config)
    if "forward" in vars(model):
        raise ValueError(f"this {type(model).__name__} was already passed to dcp_compile.apply (its forward is a DCP "
                         "step): apply an unmodified model once")
    if config.dcp_size > 1 and not dist.is_initialized():
        raise RuntimeError(f"dcp_size {config.dcp_size} needs torch.distributed initialised with >= {config.dcp_size} "
                           "ranks (init_process_group on every rank, or dcp_compile.runtime.launch)")
    text = model.config.get_text_config(decoder=True)
    capacity = kv_capacity if kv_capacity is not None else 1 + text.max_position_embeddings
    kinds = _layer_types(text) or ["full_attention"] * text.num_hidden_layers
    attention_layers = sum(kind != LINEAR_ATTENTION for kind in kinds)  # a hybrid's linear layers keep no KV
    if block_size is not None and block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")

    def page_size(lowering) -> int:
        return lowering.pool_page_size(config.dcp_size, config.interleave, block_size)

    spec = PoolSpec(model.device, text.kv_lora_rank, text.qk_rope_head_dim, model.dtype, 1)
    lowering = registry.resolve(config.kernels, spec, config, page_size=page_size)
    page = page_size(lowering)
    pool = MLAKVPool(attention_layers, -(-capacity // page) * page, text.kv_lora_rank, text.qk_rope_head_dim,
                     model.dtype, model.device, page_size=page)
    binding = bind(config.replace(kernels=lowering.name), pool, model, replicated=True)
    groups = parallel.build_replicated(config.dcp_size)
    binding.shard_pool(groups.dcp_rank, kv_keep)
    # A hybrid's padded steps hand the model the attention mask (its linear-attention layers mask
    # the padding with it); the step checks it equals the cache's padding (_read_padding), which
    # the absorbed attention serves as each row's length, so its attention masks may read it.
    absorb = AbsorbMLA(padding_inputs=(PADDING_MASK_INPUT,) if LINEAR_ATTENTION in kinds else ())
    wrapped = region_layers(model, _layer_types(text)) if regions else []
    applied = DCPTransformersModel(model, DCPState.build(binding, groups, front_end_passes=[absorb]), absorb)
    wrap_layers(wrapped)  # last: a model apply refused is left as it was given
    return applied


class DCPTransformersModel(nn.Module):
    """What apply returns for a transformers model: generate() and forward() as transformers'
    own, running the DCP step. `model` is the wrapped transformers model."""

    def __init__(self, model: nn.Module, state: DCPState, absorb: AbsorbMLA):
        super().__init__()
        self.model, self.dcp_state, self._absorb = model, state, absorb
        self.cache_kwarg = cache_kwarg(model)
        self._layer_types = _layer_types(model.config.get_text_config(decoder=True))
        self._graphs = None
        forward = type(model).forward.__get__(model)
        self._signature = inspect.signature(forward)
        (self._strategy,) = state.backends
        self._compiled_step = CompiledStep(forward, state, errors=(AbsorbError,), too_many_shapes=(
            f"(kernels={state.lowering.name!r} compiles each (batch, tokens, cache width) shape): run a few batch "
            "sizes and prompt lengths"))
        groups = state.parallel
        self._agreement = GroupAgreement(state.config.dcp_size, groups.dcp_rank, groups.dcp_group_name,
                                         state.kv_pool.cache(0).device)
        model.forward = self._forward_with_the_models_signature()  # generate() and model(...) run the DCP step
        model.generate = self.generate  # the DCP generate() (its cache, its checks) on the object passed to apply too

    @property
    def config(self):
        return self.model.config

    def new_cache(self, batch_size: int, max_length: int | None = None) -> DCPCache:
        """A cache over this model's KV pool for `batch_size` rows of up to `max_length` positions
        (default: as many as the pool's free locations hold). Its locations are its own until it is
        released (cache.release()) or garbage collected; a cache that does not fit in the free
        locations is a MemoryError. Under DCP it is a collective: every rank makes the same caches
        in the same order, and each takes the same KV locations on every rank (hf/locations.py)."""
        pool = self.dcp_state.kv_pool
        group = self._agreement if self.dcp_state.config.dcp_size > 1 else None
        if max_length is None and batch_size >= 1:
            free = allocator(pool).free_locations()
            max_length = max(1, (free if group is None else group.fewest_free(free)) // batch_size)
        return DCPCache(pool, batch_size, max_length, self._layer_types, group=group)

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def generate(self, *args, **kwargs):
        """transformers' generate(), with a DCP cache sized for this call (batch *
        num_return_sequences rows of prompt + max_new_tokens, else max_length, positions) unless
        one is passed. Under DCP a sampling call draws every rank's tokens with the group's first
        rank's random generator, and the ranks agree on the tokens it returns (hf/agreement.py).
        After a failed step it raises the latch's error before any collective of its own."""
        self._compiled_step.check_latch(self._agreement.tell_failure)
        cache = kwargs.pop(self.cache_kwarg, None)
        if cache is None:
            cache = kwargs.pop("past_key_values", None)  # the deprecated name
        if isinstance(kwargs.get("assistant_model"), DCPTransformersModel):
            kwargs["assistant_model"] = kwargs["assistant_model"].model  # transformers reads a PreTrainedModel's API
        setting = self._generation_settings(kwargs)
        input_ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
        refusal, length, sampling = None, 0, False
        try:
            length, sampling, fields = self._check_generate(input_ids, setting, kwargs)
        except (ValueError, TypeError) as exc:
            refusal, fields = exc, {}
        with self._peer_failures():
            self._agreement.check_generate(input_ids, length, fields, refusal)
        samples = setting("num_return_sequences") or 1
        if cache is None:
            cache_length = length
            if setting("is_assistant"):
                # transformers' assisted generation drafts with this model, a few tokens a call, and
                # hands the cache back at the next call: it holds the target's whole sequence (the
                # target's length where the target is a DCP model too, else every free location).
                target_length = _CACHE_LENGTH_IN_GENERATE.get()
                cache_length = max(length, target_length) if target_length is not None else None
            with self._peer_failures():
                cache = self.new_cache(input_ids.shape[0] * samples, cache_length)
        # The unconditional pass of guidance: the negative prompt (else the prompt's last token)
        # and every new token; at least this call's width, so that its steps reuse the decode graph.
        unconditional = kwargs.get("negative_prompt_ids")
        unconditional_length = (unconditional.shape[1] if unconditional is not None else 1) + length - input_ids.shape[1]
        token = _CACHE_LENGTH_IN_GENERATE.set(max(length, unconditional_length))
        try:
            with self._peer_failures():
                generators = self._agreement.shared_generators(self.model.device) if sampling else contextlib.nullcontext()
            with generators:
                out = type(self.model).generate(self.model, *args, **{self.cache_kwarg: cache}, **kwargs)
        finally:
            _CACHE_LENGTH_IN_GENERATE.reset(token)
        with self._peer_failures():
            self._agreement.check_result(out if isinstance(out, torch.Tensor) else out.sequences)
        return out

    @contextlib.contextmanager
    def _peer_failures(self):
        """Around generate()'s own agreements (outside any step): a peer's failure notice latches
        this rank too."""
        try:
            yield
        except PeerFailedError as exc:
            self._compiled_step.latch.record(exc)
            raise

    def _check_generate(self, input_ids, setting, kwargs) -> tuple[int, bool, dict[str, int]]:
        """A generate() call's own checks (no collective): (generated length, sampling, the
        settings its peers compare), or a ValueError saying what it cannot serve."""
        if input_ids is None:
            raise ValueError("generate() on a DCP model needs input_ids (inputs_embeds alone cannot size the cache)")
        length = self._generated_length(input_ids, setting)
        beams, samples = setting("num_beams") or 1, setting("num_return_sequences") or 1
        sampling, use_cache = bool(setting("do_sample")), setting("use_cache") is not False
        if beams > 1:
            raise ValueError(f"num_beams={beams}: beam search reorders the cache's rows at every step, and a DCP "
                             "cache's rows are fixed KV locations sharded over the DCP ranks; use num_beams=1 (greedy "
                             "or sampled decoding; num_return_sequences for several samples of one prompt)")
        if not use_cache:
            where = ("" if "use_cache" in kwargs else
                     " (from the model's generation_config: checkpoints saved for training often have it; set "
                     "model.generation_config.use_cache = True, or pass use_cache=True)")
            raise ValueError(f"use_cache=False{where}: generate() would run every step over the whole sequence without a "
                             "cache, and a DCP model's attention runs over its sharded KV cache; leave use_cache at its "
                             "default, True")
        for name in _UNSERVED_OUTPUTS:
            if setting(name):
                raise ValueError(_unserved_output(name))
        lookup, assistant = setting("prompt_lookup_num_tokens"), kwargs.get("assistant_model")
        if (lookup or assistant is not None) and input_ids.shape[0] * samples > 1:
            raise ValueError(f"assisted generation ({'prompt_lookup_num_tokens' if lookup else 'assistant_model'}) of "
                             f"{input_ids.shape[0]} row(s) x num_return_sequences={samples}: it serves one row, as "
                             "transformers' assisted decoding takes batch size 1; generate the rows one at a time, or "
                             "without assistance")
        return length, sampling, {"num_return_sequences": samples, "num_beams": beams, "sampling": int(sampling),
                                  "guidance": int(setting("guidance_scale") not in (None, 1)),
                                  "use_cache": int(use_cache),
                                  "assisted": lookup or (-1 if assistant is not None else 0)}

    def _generation_settings(self, kwargs):
        """`setting(name)`: a generation setting of this call, from its kwargs, else its
        generation_config, else the model's."""
        generation_config = kwargs.get("generation_config") or self.model.generation_config
        return lambda name: kwargs[name] if name in kwargs else getattr(generation_config, name, None)

    @staticmethod
    def _generated_length(input_ids: torch.Tensor, setting) -> int:
        if setting("max_new_tokens") is not None:
            return input_ids.shape[1] + setting("max_new_tokens")
        return setting("max_length")

    def _forward_with_the_models_signature(self):
        """The DCP step, showing the wrapped forward's signature: transformers' generate() reads it
        to decide what to pass (it builds an attention_mask from the pad token only when forward
        names one, and asks for the last position's logits only when it names logits_to_keep)."""
        def forward(*args, **kwargs):
            return self._step(*args, **kwargs)

        forward.__signature__ = self._signature
        forward.__doc__ = self.model.forward.__doc__
        return forward

    @torch.compiler.disable(reason="dcp_compile runs its own compile of the model; an outer compile cannot inline it")
    def _step(self, *args, **kwargs):
        # The failure rule (runtime/failure.py): the call's own checks run first and refuse nothing
        # by themselves; the DCP peers' agreement raises any rank's refusal on every rank alike,
        # so a refused input leaves the model serving. What runs after the agreement is the step.
        with self._compiled_step.guarded(self._agreement.tell_failure) as progress:
            inputs = input_ids = cache = mask = None
            decoding, refusal = False, None
            try:
                call = self._signature.bind_partial(*args, **kwargs).arguments
                call.update(call.pop("kwargs", {}))
                if self.cache_kwarg != "past_key_values" and "past_key_values" in call:
                    call[self.cache_kwarg] = call.pop("past_key_values")  # the deprecated name
                input_ids = call.get("input_ids")
                inputs = input_ids if input_ids is not None else call.get("inputs_embeds")
                cache, mask = call.get(self.cache_kwarg), call.get("attention_mask")
                if inputs is None:
                    raise ValueError("a DCP step needs input_ids or inputs_embeds")
                decoding = _decoding_in_generate(input_ids)
                call, made = self._checked(call, decoding)
            except Exception as exc:  # refused on every rank alike, by the agreement
                refusal = exc
            self._agreement.check_step(inputs, input_ids, cache, mask, deferred=decoding, refusal=refusal)
            with agreeing():  # from agreed values alike on every rank; the cache's allocation agrees
                call = self._prepared(call, made)
                cache = call.get(self.cache_kwarg)
                padded = cache is not None and any(cache.pads)
                self._check_padding_is_served(padded)
            try:
                out = self._run_step(call)
            except BaseException:
                if cache is not None:
                    cache.resync()  # layers that ran may have advanced their counters
                raise
            progress.collectives_done = True
            if cache is not None:
                cache.advance(inputs.shape[1])
            with agreeing():  # a layer this step's compile left as it is: alike on every rank
                self._check_padding_is_served(padded)
            return out

    def _run_step(self, call: dict):
        """The checked step, replayed from a captured graph where one serves it, else compiled."""
        key = self._graphs.key(call, self.cache_kwarg) if self._graphs is not None else None
        if key is not None:
            self._compiled_step.agree_on_shapes(self._strategy, (), call)
            return self._graphs.run(call, self.cache_kwarg, key)
        symbolic = self.symbolic_steps()
        host = self._host_metadata(call)
        return self._compiled_step.run(self._strategy, (), call, host, symbolic=symbolic and self._symbolic_lengths)

    def symbolic_steps(self) -> bool:
        """Whether the step compiles symbolic in its lengths (one graph for every prompt length):
        not where the back end plans each shape on the host, nor for a hybrid model."""
        # A hybrid model compiles per shape: its KDA layers' chunked reference code pads by a
        # length-dependent amount, which a symbolic length does not survive (a 3-layer Kimi-Linear
        # failed so: "SymIntArrayRef expected to contain only concrete integers").
        return (not self.dcp_state.lowering.static_shapes(self._strategy, self.dcp_state.config)
                and LINEAR_ATTENTION not in (self._layer_types or ()))

    def capture_decode_graphs(self, batch_sizes=(1, 2, 4, 8, 16, 32, 64), max_length: int | None = None) -> None:
        """From now on, replay one-token steps (generate()'s decode steps) of these batch sizes, over
        caches of at most `max_length` columns (default: 1 + max_position_embeddings), from device
        graphs (CUDA or NPU graphs; dcp_compile/hf/graphs.py), each captured at the first such
        step of its size. Steps that do not qualify run the compiled step as before."""
        from dcp_compile.hf.graphs import DecodeGraphs

        text = self.model.config.get_text_config(decoder=True)
        self._graphs = DecodeGraphs(self, batch_sizes, max_length or 1 + text.max_position_embeddings)

    @property
    def decode_graphs(self):
        """The captured decode graphs (capture_decode_graphs), or None."""
        return self._graphs

    def _host_metadata(self, call: dict) -> HostMetadata | None:
        """The step's local lengths and block tables on the host, for back ends that plan there
        (Lowering.plans_on_host): from the cache's host page table, its length and each row's padding."""
        cache = call.get(self.cache_kwarg)
        if not self.dcp_state.lowering.plans_on_host or cache is None:
            return None
        inputs = call["input_ids"] if call.get("input_ids") is not None else call["inputs_embeds"]
        return step_host_metadata(cache, inputs.shape[1])

    def _check_padding_is_served(self, padded: bool) -> None:
        """Padding is each row's own length in the absorbed attention; a layer left to transformers'
        own attention (dcp_size 1 only) would attend over the padding."""
        if padded and self._absorb.left_as_is:
            raise ValueError("a left-padded batch needs every attention layer rewritten into absorbed MLA (it serves "
                             "the padding as each row's own length); at dcp_size 1 these were left to transformers' "
                             "attention, which would attend to the padding:\n" + "\n".join(self._absorb.left_as_is))

    def _symbolic_lengths(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The step's rows and tokens and its cache's rows and width marked dynamic, so that one
        graph serves every batch size, prompt length and cache width (dynamo specialises sizes 1:
        a one-token step is the decode graph, a one-row batch has graphs of its own)."""
        name = "input_ids" if kwargs.get("input_ids") is not None else "inputs_embeds"
        kwargs = dict(kwargs, **{name: kwargs[name].detach()})  # a mark sticks: never on the caller's tensor
        cache = kwargs.get(self.cache_kwarg)
        tensors = [kwargs[name]] + ([kwargs["position_ids"], cache.req_to_token, cache.pad_tensor] if cache is not None
                                    else [])  # a step without a cache (use_cache=False at dcp_size 1)
        for tensor in tensors:
            for dim in range(min(tensor.dim(), 2)):
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
        return args, kwargs

    def check_errors(self) -> None:
        """Wait for the last step's device error flags and raise if one was set (a step raises
        those of the steps before it by itself)."""
        self._compiled_step.check_errors()

    def _checked(self, call: dict, decoding: bool) -> tuple[dict, tuple | None]:
        """The call's checks, with no side effect and no collective: (the call as the compiled step
        takes it but for its cache's padding and positions, the cache to make for it as
        (rows, max_length, padding), or None), else a ValueError saying what it cannot serve.
        decoding: one of generate()'s decode steps on a device (_decoding_in_generate)."""
        dcp_size = self.dcp_state.config.dcp_size
        input_ids = call.get("input_ids")
        # generate()'s decode steps on a device: the token is the model's own (in the vocabulary), the
        # positions transformers passes are the cache's and its mask grows by a one a step; reading
        # any of them back to check it would make the host wait for the device at every token.
        if input_ids is not None:
            if not decoding:
                self._check_token_ids(input_ids)
            # Strides in the standard layout: a slice of a longer sequence (guidance's unconditional
            # pass hands the model ids[:, -1:]) would otherwise compile a graph per stride.
            input_ids = call["input_ids"] = input_ids.clone(memory_format=torch.contiguous_format)
        inputs = input_ids if input_ids is not None else call["inputs_embeds"]
        batch, tokens = inputs.shape[:2]
        text = self.model.config.get_text_config(decoder=True)
        for name in _UNSERVED_OUTPUTS:
            if call.get(name) or (call.get(name) is None and getattr(text, name, False)):
                raise ValueError(_unserved_output(name))
        cache = call.get(self.cache_kwarg)
        if call.get("use_cache") is False:
            if cache is not None:
                raise ValueError("use_cache=False with a cache: a DCP step writes its tokens' KV into the cache it is "
                                 "given; pass use_cache=True, or no cache")
            if dcp_size > 1:
                raise ValueError("use_cache=False: under DCP every step writes the sharded KV cache")
            return call, None
        if cache is not None:
            if not isinstance(cache, DCPCache) or cache.pool is not self.dcp_state.kv_pool:
                raise ValueError(f"{self.cache_kwarg}={type(cache).__name__}: a DCP model takes the cache of its own KV "
                                 "pool, model.new_cache(batch_size, max_length) (a transformers cache would hold every "
                                 "token on every rank)")
            if cache.released:
                raise ValueError("this cache was released (cache.release()): its KV locations may belong to another "
                                 "cache now; make a new one with model.new_cache(batch_size, max_length)")
            if cache.rows != batch:
                raise ValueError(f"the cache has {cache.rows} rows, this step {batch}: a cache serves one "
                                 "batch of fixed rows (generate() makes one of batch * num_return_sequences rows)")
        length = cache.length() if cache is not None else 0
        if cache is not None and length + tokens > cache.max_length:
            raise ValueError(f"this step's {tokens} token(s) after {length} cached ones exceed the cache's max_length "
                             f"{cache.max_length}")
        pads = list(cache.pads) if cache is not None else [0] * batch
        mask = call.pop("attention_mask", None)  # popped, not None: the same arguments, the same graph
        if mask is not None and not (decoding and mask.device.type != "cpu" and length):
            pads = self._read_padding(mask, pads, batch, length, tokens)  # in generate()'s decode steps, its ones
        hybrid = LINEAR_ATTENTION in (self._layer_types or ())
        if hybrid and any(pads) and tokens > 1:
            # The linear-attention layers mask the padding's hidden states before their state takes
            # them in, from the attention mask: a hybrid's padded step keeps it (checked above to be
            # the cache's padding; the attention layers' masks may read it: PADDING_MASK_INPUT).
            if mask is None:
                raise ValueError("a left-padded cache of a model with linear-attention layers needs the attention_mask "
                                 "at each step of more than one token (its linear-attention layers mask the padding)")
            call["attention_mask"] = mask.to(inputs.device)
        # Each row's positions: its columns less its left padding (0 on the padding, never written).
        positions = call.get("position_ids")
        if positions is not None and not decoding:
            columns = torch.arange(length, length + tokens).unsqueeze(0)
            expected = columns - torch.tensor(pads).unsqueeze(1)
            given = positions.cpu().expand(batch, -1) if positions.dim() == 2 else None
            if given is None or given.shape[-1] != tokens or not bool(((given == expected) | (expected < 0)).all()):
                raise ValueError(f"position_ids {positions.tolist()}: a DCP step's tokens sit at the cache's positions, "
                                 f"{expected.clamp_min(0).tolist()} (row by row, after each row's left padding)")
        if cache is None:
            generating = _CACHE_LENGTH_IN_GENERATE.get()
            return call, (batch, tokens if generating is None else max(tokens, generating), pads)
        return call, (None, None, pads)

    def _prepared(self, call: dict, made: tuple | None) -> dict:
        """The checked call (_checked) made whole once the peers agreed on it: its cache (made
        here where the call has none: a collective under DCP), the cache's padding at its first
        step, and the positions."""
        if made is None:
            return call
        rows, max_length, pads = made
        cache = self.new_cache(rows, max_length) if rows is not None else call[self.cache_kwarg]
        if cache.length() == 0 and any(pads):
            cache.set_padding(pads)
        inputs = call["input_ids"] if call.get("input_ids") is not None else call["inputs_embeds"]
        length, tokens = cache.length(), inputs.shape[1]
        # Made on the device from the cache's padding: no host-to-device copy to wait for.
        columns = torch.arange(length, length + tokens, device=cache.pad_tensor.device).unsqueeze(0)
        call["position_ids"] = (columns - cache.pad_tensor.unsqueeze(1)).clamp_min(0).to(inputs.device)
        call[self.cache_kwarg] = cache
        return call

    @staticmethod
    def _read_padding(mask: torch.Tensor, pads: list[int], batch: int, length: int, tokens: int) -> list[int]:
        """Left padding from the attention mask: each row's zeros, then its ones. The first step of
        a cache sets each row's padding (returned); a later step's mask must show the same."""
        if mask.dim() != 2 or tuple(mask.shape) != (batch, length + tokens):
            raise ValueError(f"attention_mask of shape {tuple(mask.shape)}: a DCP step takes a [{batch}, "
                             f"{length + tokens}] mask (rows x the cache's columns and this step's tokens), or none")
        kept = mask.bool().cpu()
        padding = (~kept).sum(1) if length == 0 else torch.tensor(pads)
        left_padded = torch.arange(length + tokens).unsqueeze(0) >= padding.unsqueeze(1)
        if not torch.equal(kept, left_padded) or bool((padding >= length + tokens).any()):
            raise ValueError(f"attention_mask {mask.int().tolist()}: a DCP step serves left padding only (each row's "
                             "padding before its tokens, the same from a cache's first step on, and at least one token "
                             "a row), as generate() pads a batch of prompts for a decoder-only model (tokenizer "
                             "padding_side='left')")
        return padding.tolist()

    def _check_token_ids(self, input_ids: torch.Tensor) -> None:
        vocab_size = self.model.config.get_text_config(decoder=True).vocab_size
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids of dtype {input_ids.dtype}: token ids are an integer tensor (torch.long) of "
                             "shape [batch, tokens]")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids of shape {tuple(input_ids.shape)}: token ids are [batch, tokens]")
        outside = (input_ids < 0) | (input_ids >= vocab_size)
        if bool(outside.any()):
            row, column = (int(i) for i in outside.nonzero()[0])
            raise ValueError(f"input_ids[{row}, {column}] = {int(input_ids[row, column])}: token ids lie in "
                             f"[0, vocab_size {vocab_size})")
