"""The compiled step every front end runs: one core for apply()'s DCPModel (dcp_compile/api.py)
and the transformers front end's DCPTransformersModel (dcp_compile/hf/model.py).

What a front end gets from CompiledStep:
- the dynamo variants: a static and a symbolic-shape compile of its function per strategy,
  each through the strategy's DCPBackend, under recompile limits that suit one graph per shape;
- `guarded()`, around a whole step: one step at a time per model (a second thread waits for
  the first's step: a step's host inputs sit in the model's one host slot), the failure rule
  (runtime/failure.py: agreed errors leave the model serving, any other latches it) and the
  device error flags (runtime/guards.py), read back after each step and raised at the next;
- `run()`, the compiled call: the DCP peers' agreement on the batch shapes (runtime/peers.py),
  the step's host metadata in the host slot (runtime/host_inputs.py), and the passes' own
  errors raised as they are, not wrapped in dynamo's compiler-failure report.

What stays with the front end: what it compiles, how it checks and decides a call (the strategy,
static or symbolic shapes), and what it returns.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from dcp_compile import cost_model, shapes, strategy
from dcp_compile.backend import DCPBackend
from dcp_compile.binding import Binding
from dcp_compile.config import DCPConfig
from dcp_compile.lowering.base import Lowering
from dcp_compile.passes.cache_use import CacheMisuseError
from dcp_compile.passes.graph_utils import RewriteError
from dcp_compile.runtime import guards, parallel
from dcp_compile.runtime.failure import FailureLatch, agreed
from dcp_compile.runtime.host_inputs import HostSlot
from dcp_compile.runtime.host_metadata import HostMetadata
from dcp_compile.runtime.kv_pool import CapacityReport, MLAKVPool
from dcp_compile.runtime.peers import ShapeAgreement


@dataclass
class DCPState:
    """What apply() did to a model: config, kernel back end, layout, KV pool, pass reports,
    strategy decisions."""

    config: DCPConfig
    lowering: Lowering
    parallel: parallel.ParallelState
    kv_pool: MLAKVPool
    backends: dict[str, DCPBackend]
    strategy_counts: collections.Counter = field(default_factory=collections.Counter)
    last_decision: cost_model.Decision | None = None
    host_slot: HostSlot = field(default_factory=HostSlot)

    @classmethod
    def build(cls, binding: Binding, groups: parallel.ParallelState, front_end_passes=()) -> "DCPState":
        """The state of a bound model whose pool is sharded over `groups`: one DCPBackend per
        strategy of the binding (with the front end's passes first), sharing one host slot."""
        config, pool = binding.config, binding.pool
        host_slot = HostSlot(groups.dcp_rank)
        backends = {name: DCPBackend(config, groups, binding.lowering, name, pool.page_size, host_slot, pool,
                                     front_end_passes=front_end_passes)
                    for name in binding.strategies}
        return cls(config, binding.lowering, groups, pool, backends, host_slot=host_slot)

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


RECOMPILE_LIMIT = 256
"""Static-shape graphs (host-planned kernels, graph capture) are one per batch shape and
strategy, so allow many per model."""
ACCUMULATED_RECOMPILE_LIMIT = 1 << 14
"""Dynamo counts the graphs of one forward() over every instance of the model class: a process
that builds several models (a DCP and a dcp_size=1 one, or test after test) must not share 256."""

PASS_ERRORS = (ValueError, TypeError, CacheMisuseError, RewriteError)
"""What the passes raise about the model or the batch: surfaced as they are."""


def raise_recompile_limit() -> None:
    config = torch._dynamo.config
    for name, limit in (("recompile_limit", RECOMPILE_LIMIT), ("cache_size_limit", RECOMPILE_LIMIT),
                        ("accumulated_recompile_limit", ACCUMULATED_RECOMPILE_LIMIT),
                        ("accumulated_cache_size_limit", ACCUMULATED_RECOMPILE_LIMIT)):
        if hasattr(config, name) and getattr(config, name) < limit:
            setattr(config, name, limit)


class _RegionsKept:
    """While a compiled step runs (when dynamo may trace it), a compile region called once stays a
    region. torch 2.13 inlines an invoke_subgraph with a single call site
    (inline_single_use_invoke_subgraph), so a model with one layer of a kind (the one dense layer
    of Kimi-K2 and Moonlight, first_k_dense_replace = 1) gave MLA sites both inside and outside
    its regions, which the backend refuses. Restored after the outermost step: other compiles of
    the process keep dynamo's setting. Counted, for steps of several models in several threads."""

    NAME = "inline_single_use_invoke_subgraph"

    def __init__(self):
        self._lock, self._depth, self._saved = threading.Lock(), 0, None

    def __enter__(self):
        with self._lock:
            if self._depth == 0:
                self._saved = getattr(torch._dynamo.config, self.NAME)
                setattr(torch._dynamo.config, self.NAME, False)
            self._depth += 1

    def __exit__(self, *exc):
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                setattr(torch._dynamo.config, self.NAME, self._saved)


_REGIONS_KEPT = _RegionsKept() if hasattr(torch._dynamo.config, _RegionsKept.NAME) else None


def _keeping_regions(compiled):
    """`compiled`, called with single-use compile regions kept (where this torch inlines them)."""
    if _REGIONS_KEPT is None:
        return compiled

    @functools.wraps(compiled)
    def call(*args, **kwargs):
        with _REGIONS_KEPT:
            return compiled(*args, **kwargs)

    return call


class _Variant:
    """A strategy's backend under a distinct identity: one per (strategy, static or symbolic)."""

    def __init__(self, backend: DCPBackend, symbolic: bool):
        self.backend, self.symbolic = backend, symbolic

    def __call__(self, gm, example_inputs):
        return self.backend(gm, example_inputs)

    def __repr__(self) -> str:  # dynamo names the backend by it in its errors
        return f"dcp_compile({self.backend.strategy}, {'symbolic' if self.symbolic else 'static'} shapes)"


class StepProgress:
    """How far a guarded step got: the front end sets `collectives_done` once the step's
    collectives have all run, so that an error after them tells the peers (runtime/failure.py)."""

    def __init__(self):
        self.collectives_done = False


class CompiledStep:
    """`function` (a module, or a bound forward) compiled once per strategy of `state`, and run
    one step at a time.

    errors: exception types of the front end's own passes, surfaced as the DCP passes' are.
    too_many_shapes: what follows "this model compiled 256 graphs, one per distinct batch
    shape" when a model runs into the recompile limit: why its shapes are static, and how to
    bound them."""

    def __init__(self, function, state: DCPState, *, too_many_shapes: str,
                 errors: tuple[type[BaseException], ...] = ()):
        raise_recompile_limit()
        self.state = state
        # The static and the symbolic variant share the strategy's backend (its pass manager and
        # reports) through distinct callables: dynamo keys its cache by the backend object, so a
        # static call never reuses a symbolic graph. Made here, so no two threads make one twice.
        self._compiled = {(name, symbolic): _keeping_regions(torch.compile(function, backend=_Variant(backend, symbolic),
                                                                           fullgraph=True, dynamic=False))
                          for name, backend in state.backends.items() for symbolic in (False, True)}
        self._too_many_shapes = too_many_shapes
        self._errors = PASS_ERRORS + tuple(errors)
        config, groups = state.config, state.parallel
        self.latch = FailureLatch(has_peers=groups.tp_size > 1 or config.dcp_size > 1)
        """The model's one latch: its steps, compiled steps, graph replays and generate() share it."""
        # One step at a time per model: a step's host inputs sit in the model's one host slot.
        self._one_step = threading.Lock()
        self._stepping_thread: int | None = None
        self._peers = ShapeAgreement(config.dcp_size, groups.dcp_rank, groups.dcp_group_name)
        # The device the kernels flag errors on: the cache's (npu:0, not the pool's npu).
        self._flags = guards.ErrorWatcher(state.kv_pool.cache(0).device)

    def variant(self, strategy_name: str, symbolic: bool = False):
        """The compiled function of one strategy, static or symbolic in the batch shape."""
        if strategy_name not in self.state.backends:
            raise ValueError(f"no {strategy_name!r} variant; this model has {sorted(self.state.backends)}")
        return self._compiled[(strategy_name, symbolic)]

    @contextlib.contextmanager
    def guarded(self, notify=None):
        """Around one whole step (its host-side checks included): wait for a step another thread
        runs on this model (steps of one model run one at a time), refuse it after a failed one
        where the rank has peers, raise the device error flags an earlier step set, and start
        reading back those this one sets. Yields the step's StepProgress. An error inside latches
        the model unless it is agreed (runtime/failure.py). notify(failure): the front end's
        agreement, which tells the peers of a failure after a step's collectives."""
        if self._stepping_thread == threading.get_ident():
            raise RuntimeError("a step of this model called the model again from inside the step (a re-entrant call): "
                               "steps of one model run one at a time")
        with self._one_step:
            self._stepping_thread = threading.get_ident()
            try:
                self.latch.check(notify)
                progress = StepProgress()
                try:
                    try:
                        self._flags.raise_if_set(wait=False)
                    except BaseException:
                        progress.collectives_done = True  # an earlier step's: this one's have not begun
                        raise
                    yield progress
                    progress.collectives_done = True
                    self._flags.watch()
                except BaseException as exc:
                    self.latch.record(exc, collectives_done=progress.collectives_done)
                    raise
            finally:
                self._stepping_thread = None

    def check_latch(self, notify=None) -> None:
        """Raise the latch's error if a step of this model failed (telling the peers through
        `notify` where they are still to be told): for entry points that run no step themselves
        before their own collectives (generate())."""
        self.latch.check(notify)

    def latched(self, step):
        """`step` (a compiled step called directly, or by a graph runner) under the model's latch:
        refused after a failed step, and latching on an error that is not agreed."""
        latch = self.latch

        @functools.wraps(step)
        def call(*args, **kwargs):
            latch.check()
            try:
                try:
                    return step(*args, **kwargs)
                except torch._dynamo.exc.BackendCompilerFailed as exc:
                    self._raise_refusal(exc)
            except BaseException as exc:
                latch.record(exc)
                raise

        call.latch = latch
        return call

    def check_errors(self) -> None:
        """Wait for the last step's device error flags and raise if one was set (after the step
        another thread may be running on this model)."""
        with self._one_step:
            self._flags.raise_if_set(wait=True)

    def _raise_refusal(self, exc: torch._dynamo.exc.BackendCompilerFailed):
        """The passes' own errors say what is wrong with the model or the batch: raised as they
        are, not wrapped in dynamo's compiler-failure report, and agreed: a compile runs before
        the graph's first collective and decides from the shapes the ranks agreed on. Any other
        compiler failure is raised as it is."""
        inner = exc.inner_exception
        if isinstance(inner, self._errors):
            raise agreed(inner) from None
        raise exc

    def agree_on_shapes(self, strategy_name: str, args: tuple, kwargs: dict) -> None:
        """The DCP peers' agreement on a step's batch shapes and strategy (run() makes it; a step
        replayed from a captured graph makes it before the replay). Its error is agreed."""
        try:
            self._peers.check(args, kwargs, strategy.STRATEGIES.index(strategy_name))
        except ValueError as exc:
            raise agreed(exc)

    def run(self, strategy_name: str, args: tuple, kwargs: dict, host_metadata: HostMetadata | None = None, *,
            symbolic: bool | Callable[[tuple, dict], tuple[tuple, dict]] = False):
        """The compiled call of one strategy, once the DCP peers agree on the batch shapes, with
        `host_metadata` in the host slot. symbolic: True makes the batch dimension of every tensor
        argument symbolic (shapes.symbolic_batch), so that one graph serves many batch shapes; a
        function `(args, kwargs) -> (args, kwargs)` marks the front end's own dynamic dimensions.
        A pass's refusal at compile time is agreed: the shapes it was decided from are."""
        compiled = self.variant(strategy_name, bool(symbolic))
        self.agree_on_shapes(strategy_name, args, kwargs)
        slot = self.state.host_slot
        slot.begin(host_metadata)
        try:
            if not symbolic:
                return compiled(*args, **kwargs)
            args, kwargs = (shapes.symbolic_batch if symbolic is True else symbolic)(args, kwargs)
            with shapes.distinct_sizes():
                return compiled(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as exc:
            self._raise_refusal(exc)
        except torch._dynamo.exc.FailOnRecompileLimitHit as exc:
            raise agreed(RuntimeError(f"this model compiled {RECOMPILE_LIMIT} graphs, one per distinct batch shape "
                                      f"{self._too_many_shapes}")) from exc
        finally:
            slot.end()
