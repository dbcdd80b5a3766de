"""dcp_compile.apply: reshard a model's KV pool and compile it with the DCP passes."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dcp_compile import cost_model, shapes, strategy
from dcp_compile.binding import bind
from dcp_compile.compiled_step import CompiledStep, DCPState
from dcp_compile.config import DCPConfig
from dcp_compile.lowering import registry
from dcp_compile.runtime import parallel
from dcp_compile.runtime.host_metadata import HostMetadata, HostMetadataSource
from dcp_compile.runtime.kv_pool import MLAKVPool


def _refuse_direct_calls(module: nn.Module, args) -> None:
    """Forward pre-hook on a module passed to apply(): only the DCPModel may run it."""
    if not getattr(module, "_dcp_step_running", False):
        raise RuntimeError(
            f"this {type(module).__name__} was passed to dcp_compile.apply, which resharded its KV pool: call the "
            "module apply() returned (model = dcp_compile.apply(model, ...)), not the original"
        )


def _batch_facts(model: nn.Module, args, kwargs, host: HostMetadata | None, costs: bool) -> strategy.BatchFacts | None:
    """What the strategy decision reads of a call: the host metadata's query counts where there
    is one, and, where `costs` (the cost model decides), the model's attention_metadata(). No
    device sync: on a device the visible keys are bounded by the shapes (attention FLOPs are the
    same under both strategies anyway)."""
    metadata = getattr(model, "attention_metadata", None) if costs else None
    max_query_len = max(host.query_lens, default=0) if host is not None else None
    if metadata is None:
        return None if max_query_len is None else strategy.BatchFacts(0, host.rows, 0, 0, max_query_len)
    meta = metadata(*args, **kwargs)
    tokens, (rows, width) = meta["q_seq_ids"].numel(), meta["req_to_token"].shape
    if meta["seq_lens"].device.type == "cpu":
        lens = meta["seq_lens"][meta["q_seq_ids"]]
        visible = int(torch.minimum(meta["q_positions"] + 1, lens).clamp_min(0).sum())
    else:
        visible = tokens * width
    return strategy.BatchFacts(tokens, rows, width, visible, max_query_len if max_query_len is not None else tokens)


class DCPModel(nn.Module):
    """The compiled model. Each call picks the attention strategy for its batch (strategy.decide)
    and runs that strategy's compiled graph, symbolic in the batch shape where the kernel back end
    allows (dcp_compile/shapes.py).

    Wrapping it in torch.compile works (fullgraph too): its forward is opaque to an outer
    compile, so DCP's own compile still runs. Inside a larger module compiled with
    fullgraph=True it is a graph break, which that compile reports with the reason."""

    def __init__(self, model: nn.Module, state: DCPState):
        super().__init__()
        self.model = model
        self.dcp_state = state
        config, pool = state.config, state.kv_pool
        self._compiled_step = CompiledStep(model, state, too_many_shapes=(
            f"(kernels={state.lowering.name!r} plans each shape on the host): pad batches to a few shapes "
            "(RequestTable.extend_batch(..., bucket=True) rounds tokens and rows up to powers of two)"))
        self._host = (HostMetadataSource(config.dcp_size, config.interleave, pool.page_size, pool.rows_per_rank,
                                         f"kernels={state.lowering.name!r}")
                      if state.lowering.plans_on_host else None)
        element_bytes = torch.empty((), dtype=pool.dtype).element_size()
        self._model_facts = strategy.ModelFacts(getattr(model, "num_local_heads", None), pool.kv_lora_rank,
                                                pool.rope_dim, element_bytes, strategy.REPLICATED_Q in state.backends)
        model._dcp_step_running = False
        model.register_forward_pre_hook(_refuse_direct_calls)

    def compiled(self, strategy_name: str = "gather-q", symbolic: bool = False):
        """The compiled step of one strategy, for callers that fix it (a GraphRunner: one device
        graph per batch bucket). Static shapes by default: one compile per bucket. symbolic=True:
        one compile for every batch size (the first dimension of every tensor argument symbolic, a
        size of 1 included), from which a runner captures each bucket; where the back end compiles
        this strategy per batch shape (Lowering.static_shapes), a ValueError. Call it first with
        the largest bucket: the first call's sizes are the compile's size hints, which inductor
        tiles and fuses for (a compile hinted at one row failed in inductor's codegen on an H100,
        torch 2.11). The step shares the model's failure latch (`step.latch`), which a GraphRunner
        built over it takes for its replays."""
        state = self.dcp_state
        if symbolic and state.lowering.static_shapes(strategy_name, state.config):
            raise ValueError(f"kernels={state.lowering.name!r} compiles the {strategy_name} step per batch shape (with "
                             f"inner_compile={state.config.inner_compile!r}, debug_checks={state.config.debug_checks}): "
                             "ask for compiled(..., symbolic=False)")
        compiled, model = self._compiled_step.variant(strategy_name, symbolic), self.model

        def step(*args, **kwargs):
            model._dcp_step_running = True
            try:
                if not symbolic:
                    return compiled(*args, **kwargs)
                args, kwargs = shapes.symbolic_batch(args, kwargs)
                with shapes.distinct_sizes(), shapes.size_oblivious():
                    return compiled(*args, **kwargs)
            finally:
                model._dcp_step_running = False

        # The model's latch: a failed step stops the compiled steps and a runner's replays too.
        return self._compiled_step.latched(step)

    @torch.compiler.disable(reason="dcp_compile runs its own compile of the model; an outer compile cannot inline it")
    def forward(self, *args, host_metadata: HostMetadata | None = None, **kwargs):
        """Run one step. host_metadata: the batch's host-side local metadata (`ForwardBatch.host`),
        needed by back ends whose kernels plan on the host (Lowering.plans_on_host); without it, it is
        computed from the batch tensors where they are on the CPU."""
        with self._compiled_step.guarded():
            return self._run(args, kwargs, host_metadata)

    def check_errors(self) -> None:
        """Wait for the last step's device error flags and raise if one was set (steps replayed
        by a GraphRunner do not pass through the model: call this there from time to time)."""
        self._compiled_step.check_errors()

    def decide(self, *args, host_metadata: HostMetadata | None = None, **kwargs) -> cost_model.Decision:
        """The attention strategy a call with these arguments runs (what a graph runner captures)."""
        if self._host is not None:
            host_metadata = self._host.for_step(self.model, args, kwargs, host_metadata)
        return self._decide(args, kwargs, host_metadata)

    def _decide(self, args, kwargs, host_metadata) -> cost_model.Decision:
        state = self.dcp_state
        costs = state.config.dcp_size > 1 and state.config.attention_strategy == "auto"
        facts = _batch_facts(self.model, args, kwargs, host_metadata, costs)
        return strategy.decide(state.config, state.lowering, facts, self._model_facts)

    def _run(self, args, kwargs, host_metadata):
        state = self.dcp_state
        if self._host is not None:
            host_metadata = self._host.for_step(self.model, args, kwargs, host_metadata)
        decision = self._decide(args, kwargs, host_metadata)
        state.strategy_counts[decision.strategy] += 1
        state.last_decision = decision
        symbolic = not state.lowering.static_shapes(decision.strategy, state.config)
        self.model._dcp_step_running = True
        try:
            return self._compiled_step.run(decision.strategy, args, kwargs, host_metadata, symbolic=symbolic)
        finally:
            self.model._dcp_step_running = False


def _check_model(model: nn.Module) -> tuple[MLAKVPool, parallel.ParallelState]:
    pool = getattr(model, "kv_pool", None)
    if not isinstance(pool, MLAKVPool):
        raise ValueError(
            f"{type(model).__name__} has no MLA sites: dcp_compile needs a model with a `kv_pool` "
            "(dcp_compile.runtime.MLAKVPool) whose attention calls dcp_compile.ops.mla_kv_write and "
            "mla_attention (see the README, 'Writing a model for dcp_compile')"
        )
    state = getattr(model, "parallel", None)
    if not isinstance(state, parallel.ParallelState):
        raise ValueError(f"{type(model).__name__} has no `parallel` (dcp_compile.runtime.ParallelState) attribute")
    return pool, state


def apply(model: nn.Module, dcp_size: int = 1, *, config: DCPConfig | None = None, kv_keep: str = "memory",
          kv_capacity: int | None = None, block_size: int | None = None, regions: bool = False,
          **config_fields) -> nn.Module:
    """Shard `model`'s latent KV cache over `dcp_size` ranks of its TP group and compile it.

    Collective: call on every rank. Call before any KV is written (the pool is reallocated).
    kv_keep='memory' keeps the rows per rank and grows the logical capacity N-fold;
    kv_keep='capacity' keeps (at least) the logical capacity, rounded up to whole pages and
    strides of interleave x dcp_size, and shrinks the rows. With dcp_size=1 the
    result is the plain compiled model, the baseline every DCP run is compared with.

    An unmodified transformers model of a known MLA family (DeepSeek-V3 / V2) gets a KV pool of
    `kv_capacity` locations (default 1 + max_position_embeddings) and returns a
    dcp_compile.hf.model.DCPTransformersModel, whose generate() and forward() are transformers'
    own (dcp_compile/hf). kv_capacity and block_size (the KV rows of one page on one rank, for
    back ends that read the pool as blocks: Lowering.pool_page_size) are for those models only, as
    is regions=True: each attention decoder layer a compile region, so that compiling a step
    costs one layer of each kind, not every layer (dcp_compile/hf/regions.py; a model written for
    dcp_compile makes its own layers regions, as MLAModel(regions=True) does).
    """
    if isinstance(model, DCPModel) or getattr(model, "dcp_state", None) is not None:
        raise ValueError("this model was already applied (it is what dcp_compile.apply returned): apply the original "
                         "model once")
    fields, option_values = DCPConfig.split_fields(config_fields)  # the rest: the back end's options, by name
    config = config.replace(dcp_size=dcp_size, **fields) if config else DCPConfig(dcp_size=dcp_size, **fields)
    config = config.with_options(option_values)
    registry.check_pass_names(config.disabled_passes)
    from dcp_compile.hf import is_transformers_model

    if is_transformers_model(model):
        from dcp_compile.hf.model import apply_transformers

        return apply_transformers(model, config, kv_capacity, kv_keep, block_size, regions)
    for name, value in (("kv_capacity", kv_capacity), ("block_size", block_size)):
        if value is not None:
            raise ValueError(f"{name} sizes the KV pool of a transformers model; this model owns its kv_pool")
    if regions:
        raise ValueError("regions=True wraps a transformers model's decoder layers; a model written for dcp_compile "
                         "makes its layers compile regions itself (torch.compiler.nested_compile_region, as "
                         "MLAModel(regions=True) does)")
    pool, current = _check_model(model)
    if config.dcp_size > 1 and not dist.is_initialized():
        raise RuntimeError(f"dcp_size {config.dcp_size} needs torch.distributed initialised with >= {config.dcp_size} ranks "
                           "(init_process_group on every rank, or dcp_compile.runtime.launch)")
    world = dist.get_world_size() if dist.is_initialized() else 1
    replicated = _replicated_heads(current, config)
    if not replicated:
        parallel.validate_sizes(current.tp_size, config.dcp_size, world)
    binding = bind(config, pool, model, replicated=replicated)
    groups = parallel.build_replicated(config.dcp_size) if replicated else parallel.build(current.tp_size, config.dcp_size)
    binding.shard_pool(groups.dcp_rank, kv_keep)
    return DCPModel(model, DCPState.build(binding, groups))


def _replicated_heads(current: parallel.ParallelState, config: DCPConfig) -> bool:
    """Whether the model's heads are not split (tp_size 1) while its KV is (dcp_size > 1): the
    DCP group is then a block of the world, and every step runs replicated-q."""
    replicated = current.tp_size == 1 and config.dcp_size > 1
    if replicated and config.attention_strategy not in ("auto", strategy.REPLICATED_Q):
        raise ValueError(f"attention_strategy {config.attention_strategy!r}: at tp_size 1 every rank has every head, and "
                         f"dcp_size {config.dcp_size} runs {strategy.REPLICATED_Q!r} (no Q to gather)")
    if not replicated and config.attention_strategy == strategy.REPLICATED_Q and config.dcp_size > 1:
        raise ValueError(f"attention_strategy {strategy.REPLICATED_Q!r} serves models whose heads are not split "
                         f"(tp_size 1); this model's tp_size is {current.tp_size}: use 'auto', 'gather-q' or 'gather-kv'")
    return replicated


def state(compiled: nn.Module) -> DCPState:
    """The DCPState of a module returned by apply()."""
    found = getattr(compiled, "dcp_state", None)
    if not isinstance(found, DCPState):
        raise ValueError("this module was not produced by dcp_compile.apply")
    return found
