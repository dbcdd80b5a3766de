"""dcp_compile.apply: reshard a model's KV pool and compile it with the DCP passes."""

from __future__ import annotations

import collections
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from dcp_compile import cost_model, shapes
from dcp_compile.backend import DCPBackend
from dcp_compile.config import DCPConfig
from dcp_compile.passes.cache_use import CacheMisuseError
from dcp_compile.passes.graph_utils import RewriteError
from dcp_compile.passes.manager import check_pass_names
from dcp_compile.runtime import guards, layout, parallel
from dcp_compile.passes.lower_flashinfer_attention import MAX_WINDOW_QUERY_TOKENS
from dcp_compile.runtime.host_metadata import MAX_FIA_QUERY_TOKENS, HostMetadata, HostSlot
from dcp_compile.runtime.kv_pool import CapacityReport, MLAKVPool


@dataclass
class DCPState:
    """What apply() did to a model: config, layout, KV pool, pass reports, strategy decisions."""

    config: DCPConfig
    parallel: parallel.ParallelState
    kv_pool: MLAKVPool
    backends: dict[str, DCPBackend]
    strategy_counts: collections.Counter = field(default_factory=collections.Counter)
    last_decision: cost_model.Decision | None = None
    host_slot: HostSlot = field(default_factory=HostSlot)

    @property
    def needs_host_metadata(self) -> bool:
        """Whether attention runs kernels that take host values (Ascend FIA's lengths, FlashInfer's plan)."""
        return self.config.kernels in ("npu", "flashinfer")

    @property
    def capacity(self) -> CapacityReport:
        return self.kv_pool.report()

    @property
    def reports(self):
        return [report for backend in self.backends.values() for report in backend.reports]

    def pass_summary(self) -> dict[str, int]:
        """Sites rewritten per pass, summed over every graph captured so far."""
        total: dict[str, int] = {}
        for report in self.reports:
            for name, sites in report.summary().items():
                total[name] = total.get(name, 0) + sites
        return total


MAX_PAGED_QUERY_TOKENS = min(MAX_FIA_QUERY_TOKENS, MAX_WINDOW_QUERY_TOKENS)
"""Query tokens per row that the paged lowerings (FIA; FlashInfer under DCP) serve in gather-q."""

RECOMPILE_LIMIT = 256
"""Static-shape graphs (paged kernels, graph capture) are one per batch shape and strategy, so
allow many per model."""
ACCUMULATED_RECOMPILE_LIMIT = 1 << 14
"""Dynamo counts the graphs of one forward() over every instance of the model class: a process
that builds several models (a DCP and a dcp_size=1 one, or test after test) must not share 256."""


def _raise_recompile_limit() -> None:
    config = torch._dynamo.config
    for name, limit in (("recompile_limit", RECOMPILE_LIMIT), ("cache_size_limit", RECOMPILE_LIMIT),
                        ("accumulated_recompile_limit", ACCUMULATED_RECOMPILE_LIMIT),
                        ("accumulated_cache_size_limit", ACCUMULATED_RECOMPILE_LIMIT)):
        if hasattr(config, name) and getattr(config, name) < limit:
            setattr(config, name, limit)


MAX_AGREED_SHAPES = 4096
"""Batch shapes whose agreement among DCP peers is remembered (then checked anew)."""


def static_shapes(config: DCPConfig, strategy: str) -> bool:
    """Whether a strategy's graphs are compiled per batch shape: where FIA or FlashInfer serve
    attention over the pool (their rows and tokens are planned on the host per graph), and under
    torchair's NPU graphs. Everything else runs symbolic-shape graphs (dcp_compile/shapes.py)."""
    paged = config.kernels in ("npu", "flashinfer") and strategy == "gather-q"
    return paged or config.inner_compile == "torchair"


class _Variant:
    """A strategy's backend under a distinct identity: one per (strategy, static or symbolic)."""

    def __init__(self, backend: DCPBackend):
        self.backend = backend

    def __call__(self, gm, example_inputs):
        return self.backend(gm, example_inputs)


def _refuse_direct_calls(module: nn.Module, args) -> None:
    """Forward pre-hook on a module passed to apply(): only the DCPModel may run it."""
    if not getattr(module, "_dcp_step_running", False):
        raise RuntimeError(
            f"this {type(module).__name__} was passed to dcp_compile.apply, which resharded its KV pool: call the "
            "module apply() returned (model = dcp_compile.apply(model, ...)), not the original"
        )


class DCPModel(nn.Module):
    """The compiled model. Each call picks the attention strategy for its batch (forced, or by
    the cost model) and runs that strategy's compiled graph.

    Wrapping it in torch.compile works (fullgraph too): its forward is opaque to an outer
    compile, so DCP's own compile still runs. Inside a larger module compiled with
    fullgraph=True it is a graph break, which that compile reports with the reason."""

    def __init__(self, model: nn.Module, state: DCPState):
        super().__init__()
        _raise_recompile_limit()
        self.model = model
        self.dcp_state = state
        # A static and a symbolic-shape variant per strategy. They share the strategy's backend
        # (its pass manager and reports) through distinct callables: dynamo keys its cache by
        # the backend object, so a static call never reuses a symbolic graph.
        self._compiled = {(name, symbolic): torch.compile(model, backend=_Variant(backend), fullgraph=True, dynamic=False)
                          for name, backend in state.backends.items() for symbolic in (False, True)}
        self._agreed_shapes: set[tuple] = set()
        self._failure: str | None = None
        self._error_check = None
        self._host_flags: torch.Tensor | None = None
        model._dcp_step_running = False
        model.register_forward_pre_hook(_refuse_direct_calls)

    def compiled(self, strategy: str = "gather-q"):
        """The compiled step of one strategy with static shapes, for callers that fix it (graph
        capture: one graph per batch bucket)."""
        if (strategy, False) not in self._compiled:
            raise ValueError(f"no {strategy!r} variant; this model has {sorted(self.dcp_state.backends)}")
        compiled, model = self._compiled[(strategy, False)], self.model

        def step(*args, **kwargs):
            model._dcp_step_running = True
            try:
                return compiled(*args, **kwargs)
            finally:
                model._dcp_step_running = False

        return step

    @torch.compiler.disable(reason="dcp_compile runs its own compile of the model; an outer compile cannot inline it")
    def forward(self, *args, host_metadata: HostMetadata | None = None, **kwargs):
        """Run one step. host_metadata: the batch's host-side local metadata (`ForwardBatch.host`),
        needed by kernels that take host values (kernels='npu'); without it, it is computed from
        the batch tensors where they are on the CPU."""
        if self._failure is not None:
            raise RuntimeError(
                f"an earlier step failed on this rank ({self._failure}); its TP/DCP peers may still be inside that "
                "step's collectives, so this model runs no more steps: restart the ranks"
            )
        try:
            self._raise_on_errors(wait=False)
            out = self._step(args, kwargs, host_metadata)
            self._watch_errors()
            return out
        except BaseException as exc:
            # With collectives, a rank that goes on after a failed step would pair its next
            # collectives with its peers' pending ones of the failed step: finite, wrong results.
            # It stops instead; peers blocked in a collective fail at the process group's timeout.
            if self.dcp_state.parallel.tp_size > 1 or self.dcp_state.config.dcp_size > 1:
                self._failure = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            raise

    def _watch_errors(self) -> None:
        """Start reading back this device's error flags (runtime/guards.py: bad batch input a
        kernel masked) without waiting for them: a step's error is reported at the next step
        (at once on CPU, where reading costs nothing)."""
        flags = guards.allocated_flags(self.dcp_state.kv_pool.cache(0).device)
        if flags is None:
            return
        if flags.device.type == "cpu":
            self._error_check = (flags, None)
            self._raise_on_errors(wait=True)
            return
        if self._host_flags is None:  # pinned once: no host allocation per step
            self._host_flags = torch.zeros(flags.shape, dtype=flags.dtype, pin_memory=True)
        self._host_flags.copy_(flags, non_blocking=True)  # the flags are sticky: a newer copy covers older steps
        event = getattr(torch, flags.device.type).Event()
        event.record()
        self._error_check = (self._host_flags, event)

    def _raise_on_errors(self, wait: bool) -> None:
        if self._error_check is None:
            return
        host, event = self._error_check
        if event is not None and not wait and not event.query():
            return  # not read back yet: checked at a later step
        if event is not None:
            event.synchronize()
        self._error_check = None
        values = host.tolist()
        if any(values):
            guards.allocated_flags(self.dcp_state.kv_pool.cache(0).device).zero_()
            guards.raise_for(values)

    def check_errors(self) -> None:
        """Wait for the last step's error flags and raise if one was set (steps replayed by a
        GraphRunner do not pass through the model: call this there from time to time)."""
        self._raise_on_errors(wait=True)

    def _step(self, args, kwargs, host_metadata):
        state = self.dcp_state
        if state.needs_host_metadata:
            host_metadata = self._host_metadata(args, kwargs, host_metadata)
        decision = self._decide(args, kwargs, host_metadata)
        self._check_peers_agree(args, kwargs, decision.strategy)
        state.strategy_counts[decision.strategy] += 1
        state.last_decision = decision
        state.host_slot.current = host_metadata
        self.model._dcp_step_running = True
        try:
            if static_shapes(state.config, decision.strategy):
                return self._compiled[(decision.strategy, False)](*args, **kwargs)
            args, kwargs = shapes.symbolic_batch(args, kwargs)
            with shapes.distinct_sizes():
                return self._compiled[(decision.strategy, True)](*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as exc:
            # The passes' own errors say what is wrong with the model or the batch: surface them as
            # they are, not wrapped in dynamo's compiler-failure report.
            if isinstance(exc.inner_exception, (ValueError, TypeError, CacheMisuseError, RewriteError)):
                raise exc.inner_exception from None
            raise
        except torch._dynamo.exc.FailOnRecompileLimitHit as exc:
            raise RuntimeError(
                f"this model compiled {RECOMPILE_LIMIT} graphs, one per distinct batch shape (kernels="
                f"{state.config.kernels!r} plans each shape on the host): pad batches to a few shapes "
                "(RequestTable.extend_batch(..., bucket=True) rounds tokens and rows up to powers of two)"
            ) from exc
        finally:
            self.model._dcp_step_running = False
            state.host_slot.current = None

    def _check_peers_agree(self, args, kwargs, strategy: str) -> None:
        """At the first step of each batch shape, the DCP peers compare shapes (one all-gather of
        one int): ranks given different batches get a clear error instead of a hang or garbage."""
        state = self.dcp_state
        if state.config.dcp_size == 1:
            return
        tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
        key = (tuple(tuple(t.shape) for t in tensors), cost_model.STRATEGIES.index(strategy))
        if key in self._agreed_shapes:
            return
        if len(self._agreed_shapes) >= MAX_AGREED_SHAPES:  # a scheduler that never pads: bounded memory
            self._agreed_shapes.clear()
        signature = torch.tensor([hash(key) & ((1 << 62) - 1)], dtype=torch.int64, device=tensors[0].device)
        group = dist.distributed_c10d._resolve_process_group(state.parallel.dcp_group_name)
        gathered = torch.empty(state.config.dcp_size, dtype=torch.int64, device=signature.device)
        dist.all_gather_into_tensor(gathered, signature, group=group)
        if bool((gathered != signature).any()):
            raise ValueError(
                f"DCP rank {state.parallel.dcp_rank} was given a batch of shapes {list(key[0])} ({strategy}), and a "
                "DCP peer a different one: every rank of a DCP group must run the same step with the same batch"
            )
        self._agreed_shapes.add(key)

    def _host_metadata(self, args, kwargs, host: HostMetadata | None) -> HostMetadata:
        state = self.dcp_state
        pool, config = state.kv_pool, state.config
        if host is None:
            metadata = getattr(self.model, "attention_metadata", None)
            if metadata is None:
                raise ValueError(
                    f"kernels={config.kernels!r} needs the batch's host-side metadata: pass host_metadata=batch.host (a ForwardBatch "
                    "from RequestTable), or give the model an attention_metadata() method (README, model contract)"
                )
            meta = metadata(*args, **kwargs)
            host = HostMetadata.from_tensors(meta["req_to_token"], meta["seq_lens"], meta["q_seq_ids"],
                                             config.dcp_size, config.interleave, pool.page_size)
        else:
            host.check_batch([a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)])
        block_size = layout.local_block_size(pool.page_size, config.dcp_size, config.interleave)
        if block_size and host.max_block >= pool.rows_per_rank // block_size:
            raise IndexError(f"the host block tables name local block {host.max_block}, but a rank's KV shard holds "
                             f"{pool.rows_per_rank // block_size} blocks of {block_size}: the request table hands out "
                             "locations past the pool (build it with the pool's capacity)")
        expected = (config.dcp_size, config.interleave, pool.page_size)
        if (host.dcp_size, host.interleave, host.page_size) != expected:
            raise ValueError(
                f"host metadata was built for dcp_size {host.dcp_size}, interleave {host.interleave}, page size "
                f"{host.page_size}; this model has {expected[0]}, {expected[1]}, {expected[2]}: build the RequestTable "
                "with the model's dcp_size, interleave and page size"
            )
        return host

    def _decide(self, args, kwargs, host: HostMetadata | None = None) -> cost_model.Decision:
        state = self.dcp_state
        strategy = state.config.attention_strategy
        paged = {"npu": "FIA", "flashinfer": "the FlashInfer lowering under DCP"}.get(state.config.kernels)
        # FlashInfer's own causal mask serves any chunk at dcp_size 1; FIA and the DCP split do not.
        limited = paged is not None and (state.config.kernels == "npu" or state.config.dcp_size > 1)
        if host is not None and limited and max(host.query_lens, default=0) > MAX_PAGED_QUERY_TOKENS:
            if strategy == "gather-q" and state.config.dcp_size > 1:
                raise ValueError(f"attention_strategy='gather-q' with kernels={state.config.kernels!r} serves at most "
                                 f"{MAX_PAGED_QUERY_TOKENS} query tokens per request ({paged}); this batch has "
                                 f"{max(host.query_lens)}")
            return cost_model.Decision("gather-kv", True, {}, f"a row has more than {MAX_PAGED_QUERY_TOKENS} query tokens, "
                                       f"which {paged} does not serve")
        if state.config.dcp_size == 1:
            return cost_model.Decision("gather-q", True, {}, "dcp_size 1: attention is local")
        if strategy != "auto":
            return cost_model.Decision(strategy, True, {}, f"forced {strategy}")
        metadata = getattr(self.model, "attention_metadata", None)
        heads = getattr(self.model, "num_local_heads", None)
        if metadata is None or heads is None:
            return cost_model.Decision("gather-q", True, {}, "the model exposes no attention_metadata / num_local_heads")
        meta = metadata(*args, **kwargs)
        tokens, (rows, width) = meta["q_seq_ids"].numel(), meta["req_to_token"].shape
        if meta["seq_lens"].device.type == "cpu":
            lens = meta["seq_lens"][meta["q_seq_ids"]]
            visible = int(torch.minimum(meta["q_positions"] + 1, lens).clamp_min(0).sum())
        else:
            # Attention FLOPs are the same under both strategies, so the choice does not depend
            # on the visible keys: bound them by the shapes rather than sync with the device.
            visible = tokens * width
        pool = state.kv_pool
        return cost_model.choose(
            "auto",
            query_tokens=tokens,
            rows=rows,
            width=width,
            visible_keys=visible,
            heads=heads,
            dcp_size=state.config.dcp_size,
            kv_lora_rank=pool.kv_lora_rank,
            rope_dim=pool.rope_dim,
            element_bytes=torch.empty((), dtype=pool.dtype).element_size(),
        )


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
          **config_fields) -> DCPModel:
    """Shard `model`'s latent KV cache over `dcp_size` ranks of its TP group and compile it.

    Collective: call on every rank. Call before any KV is written (the pool is reallocated).
    kv_keep='memory' keeps the rows per rank and grows the logical capacity N-fold;
    kv_keep='capacity' keeps the logical capacity and shrinks the rows. With dcp_size=1 the
    result is the plain compiled model, the baseline every DCP run is compared with.
    """
    if isinstance(model, DCPModel):
        raise ValueError("this model was already applied (it is what dcp_compile.apply returned): apply the original "
                         "model once")
    config = config.replace(dcp_size=dcp_size, **config_fields) if config else DCPConfig(dcp_size=dcp_size, **config_fields)
    check_pass_names(config.disabled_passes)
    pool, current = _check_model(model)
    if config.dcp_size > 1 and not dist.is_initialized():
        raise RuntimeError(f"dcp_size {config.dcp_size} needs torch.distributed initialised with >= {config.dcp_size} ranks "
                           "(init_process_group on every rank, or dcp_compile.runtime.launch)")
    world = dist.get_world_size() if dist.is_initialized() else 1
    parallel.validate_sizes(current.tp_size, config.dcp_size, world)
    if config.kernels == "auto" and pool.device.type == "npu":
        config = config.replace(kernels="npu")
    if config.kernels == "auto" and pool.device.type == "cuda":
        config = config.replace(kernels=_cuda_kernels(pool, config))
    if config.kernels == "npu":
        _check_npu_lowering(model, pool, config)
    if config.kernels == "flashinfer":
        _check_flashinfer_lowering(pool, config)
    if config.inner_compile == "torchair":
        from dcp_compile.lowering.npu import require_torch_npu

        require_torch_npu("inner_compile='torchair'")
    groups = parallel.build(current.tp_size, config.dcp_size)
    pool.reshard(groups.dcp_size, groups.dcp_rank, config.interleave, kv_keep)
    # At dcp_size 1 with kernels='npu', 'gather-kv' names the graph without FIA, for chunks FIA does not serve.
    strategies = cost_model.STRATEGIES if config.dcp_size > 1 or config.kernels == "npu" else ("gather-q",)
    host_slot = HostSlot(groups.dcp_rank)
    backends = {name: DCPBackend(config, groups, name, pool.page_size, host_slot, pool) for name in strategies}
    return DCPModel(model, DCPState(config, groups, pool, backends, host_slot=host_slot))


def _check_npu_lowering(model: nn.Module, pool: MLAKVPool, config: DCPConfig) -> None:
    """What FIA and npu_attention_update need, checked before anything is compiled."""
    from dcp_compile.passes.base import PassConfig
    from dcp_compile.passes.lower_npu_attention import MAX_UPDATE_SHARDS, fia_block_size, padded_heads

    if pool.device.type == "npu":
        from dcp_compile.lowering.npu import require_torch_npu

        require_torch_npu("a KV pool on an NPU")
    if pool.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"kernels='npu' needs a bf16 or fp16 KV cache (FIA's query and KV dtypes, ASCEND.md §1.9), got {pool.dtype}")
    if pool.kv_lora_rank != 512 or pool.rope_dim != 64:
        raise ValueError(f"FIA's MLA path needs kv_lora_rank 512 and a rope dim of 64 (ASCEND.md §1.4), got "
                         f"{pool.kv_lora_rank} and {pool.rope_dim}")
    if config.dcp_size > MAX_UPDATE_SHARDS:
        raise ValueError(f"npu_attention_update merges at most {MAX_UPDATE_SHARDS} shards, dcp_size is {config.dcp_size}")
    fia_block_size(PassConfig(dcp_size=config.dcp_size, interleave=config.interleave, page_size=pool.page_size))
    heads = getattr(model, "num_local_heads", None)
    if heads is not None:
        padded_heads(heads * config.dcp_size)


def _cuda_kernels(pool: MLAKVPool, config: DCPConfig) -> str:
    """kernels='auto' on CUDA: FlashInfer where it serves this GPU and model, else Triton."""
    from dcp_compile.lowering import flashinfer

    reason = flashinfer.unsupported_reason(pool.device, pool.kv_lora_rank, pool.rope_dim, pool.dtype)
    if reason is None and config.inner_compile != "eager":
        reason = f"inner_compile={config.inner_compile!r} (FlashInfer runs with 'eager')"
    if reason is None and layout.local_block_size(pool.page_size, config.dcp_size, config.interleave) is None:
        reason = (f"page size {pool.page_size} with interleave {config.interleave} over dcp_size {config.dcp_size} "
                  "does not map onto whole local blocks (FlashInfer's pages)")
    if reason is None:
        return "flashinfer"
    flashinfer.log.info("kernels='auto': the Triton attention kernel, not FlashInfer: %s", reason)
    return "triton"


def _check_flashinfer_lowering(pool: MLAKVPool, config: DCPConfig) -> None:
    """What the FlashInfer lowering needs, checked before anything is compiled. On the CPU it runs
    a torch stand-in of FlashInfer (tests, the demo); elsewhere it needs FlashInfer on a Hopper GPU."""
    from dcp_compile.lowering import flashinfer
    from dcp_compile.passes.base import PassConfig
    from dcp_compile.passes.lower_flashinfer_attention import flashinfer_block_size

    if pool.device.type != "cpu":
        reason = flashinfer.unsupported_reason(pool.device, pool.kv_lora_rank, pool.rope_dim, pool.dtype)
        if reason is not None:
            raise RuntimeError(f"kernels='flashinfer': {reason}")
    block_size = flashinfer_block_size(PassConfig(dcp_size=config.dcp_size, interleave=config.interleave,
                                                  page_size=pool.page_size))
    if pool.device.type == "cuda":  # the nvcc build of its kernel here, not in the first step
        flashinfer.warm_up(pool.device, pool.kv_lora_rank, pool.rope_dim, pool.dtype, block_size)


def state(compiled: nn.Module) -> DCPState:
    """The DCPState of a module returned by apply()."""
    if not isinstance(compiled, DCPModel):
        raise ValueError("this module was not produced by dcp_compile.apply")
    return compiled.dcp_state
