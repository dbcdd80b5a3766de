"""The lowering interface: one object per kernel back end (torch, triton, flashinfer, npu, or one
registered from outside the package), looked up by name in lowering/registry.py.

A back end owns its parts, and everything above lowering/ (binding, the compiled step, the
backend, the demo, the dump) asks it through these members and never names one:

- its options: `Options`, a frozen dataclass of its own (one field per option, a docstring
  each, `metadata` giving the CLI flag's choices; registry.options_for builds them from
  values by name); `options`, the values it was configured with; `configured(options)` and
  `resolve_options(pool)` (its 'auto' choices);
- one way to say no: `unsupported_reasons(pool, config, model=None)`, a list of reasons;
  `check_layout(page_size, dcp_size, interleave)` for pages alone (the demo's flags);
- its KV layout: `kv_layout` (a runtime.kv_pool.KVLayout: the shapes a generic pool allocates),
  `page_size(dcp_size, interleave, block_size)` (the pages its kernels read, where it sets
  them), `pool_page_size(...)` and `default_block_size` (the pages of a pool made for it: the
  transformers front end's), `model_dims` and `dtypes` (data: the widths and dtypes its kernels
  take);
- its passes: `passes()`, run after the DCP rewrites, before cleanup and the verifier, and its
  answer to `fuse_projections='auto'`;
- its inner compilers: `inner_compilers` (the names it runs under, 'eager' and 'inductor' or
  its own), `inner_compile(pool)` for 'auto', `inner_compiler(name)` for one of its own;
- work at apply: `prepare(pool, config)` (a kernel build);
- its query limit: `window` tokens per request where `windowed(dcp_size)`, more going to the
  gather-kv strategy, which `strategies(dcp_size)` then compiles at dcp_size 1 too;
- which dcp_size=1 baseline a comparison runs it against: `baseline` (the demo);
- its graphs' shapes: `static_shapes(strategy, config)` (compiled per batch shape, or symbolic);
- its lowering per step: `step_options(host)`, where one captured graph is lowered under other
  options for steps whose host metadata its own lowering does not serve;
- its host inputs: `plans_on_host` (each step needs the batch's host metadata) and
  `host_feed(gm, dcp_rank)`, the runtime.host_inputs.HostFeed of a lowered graph, which the
  backend and the graph runner feed before every run and replay.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from dcp_compile.runtime.host_inputs import HostFeed
from dcp_compile.runtime.kv_pool import PACKED, KVLayout

GENERIC_INNER_COMPILERS = ("eager", "inductor")
POOL_STRATEGIES = ("gather-q", "replicated-q")
"""The strategies whose attention reads the KV pool in place (gather-kv reads gathered rows): a
back end that plans that read on the host may compile their graphs per batch shape."""


class Unsupported(ValueError):
    """A back end cannot serve this pool, model or config (its unsupported_reasons)."""


@dataclass(frozen=True)
class Options:
    """A back end's options (this one has none). A back end subclasses it with one field per
    option; `field(metadata={"choices": ..., "help": ...})` gives the CLI flag (`--name-with-
    dashes`, or metadata["flag"], taking metadata["flag_choices"] where given, which
    metadata["parse"] turns into the value). metadata["baseline"] = True marks a fact of the
    deployment (what its kernels accept, not a choice of kernels or layout): a dcp_size=1 baseline
    on the same back end takes it too (`baseline_values`)."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            choices = field.metadata.get("choices")
            value = getattr(self, field.name)
            if choices is not None and (value not in choices or type(value) is not type(choices[0])):
                raise ValueError(f"{field.name} must be one of {list(choices)}, got {value!r}")

    @classmethod
    def baseline_values(cls, values) -> dict:
        """Of option values by name (a run's, on any back end), those a baseline on this back end
        takes: the fields of these Options marked metadata["baseline"]. The others keep their
        defaults there, so that the baseline stays the reference the options are checked against."""
        shared = {field.name for field in dataclasses.fields(cls) if field.metadata.get("baseline")}
        return {name: value for name, value in dict(values).items() if name in shared}


class Lowering:
    name: str = ""
    description: str = ""
    """One line for --help and logs."""
    Options: type[Options] = Options
    """Its options' dataclass."""
    options: Options = Options()
    """The options it was configured with (configured())."""
    window: int | None = None
    """Most query tokens per request its attention over the pool serves, where windowed()."""
    model_dims: tuple[int, int] | None = None
    """(kv_lora_rank, rope dim) its kernels need, or None for any."""
    dtypes: tuple[torch.dtype, ...] | None = None
    """KV cache dtypes its kernels take, or None for any."""
    kv_layout: KVLayout = PACKED
    """How the pool holds a layer's rows for its kernels (a KVLayout the pool allocates); a back end
    whose options choose it makes this a property of its options."""
    plans_on_host: bool = False
    """Whether its kernels read host metadata of each step (lengths, block tables, plans)."""
    default_block_size: int = 1
    """The local block (rows of one page on one rank) of a KV pool made for it, where the caller
    does not say (the transformers front end's pool)."""
    inner_compilers: tuple[str, ...] = GENERIC_INNER_COMPILERS
    """The inner compilers its graphs run under (DCPConfig.inner_compile)."""
    baseline: str | None = None
    """The back end a DCP run of it is compared with at dcp_size 1 (None: the torch reference on
    the CPU, 'auto' on a device); itself where its numerics differ from the reference's."""

    def configured(self, options: Options) -> "Lowering":
        """This back end with `options` (a copy where they differ from its own)."""
        if options == self.options:
            return self
        lowering = copy.copy(self)
        lowering.options = options
        return lowering

    def resolve_options(self, pool) -> Options:
        """Its options with each 'auto' decided for this pool."""
        return self.options

    def unsupported_reasons(self, pool, config, model=None) -> list[str]:
        """Why it cannot serve `pool` (its device, widths, dtype, pages), `model` and `config`
        (resolved by bind(); 'auto' fields may still stand where the registry or the demo asks
        early); empty where it can. By default: model_dims, dtypes, check_layout."""
        reasons = []
        if self.model_dims is not None and (pool.kv_lora_rank, pool.rope_dim) != self.model_dims:
            reasons.append(f"its kernels need kv_lora_rank {self.model_dims[0]} and a rope dim of {self.model_dims[1]}, "
                           f"the KV pool has {pool.kv_lora_rank} and {pool.rope_dim}")
        if self.dtypes is not None and pool.dtype not in self.dtypes:
            reasons.append(f"it takes a {' or '.join(map(str, self.dtypes))} KV cache, not {pool.dtype}")
        try:
            self.check_layout(pool.page_size, config.dcp_size, config.interleave)
        except ValueError as exc:
            reasons.append(str(exc))
        return reasons

    def check(self, pool, config, model=None) -> None:
        """Raise Unsupported with every reason unsupported_reasons gives, and for an inner
        compiler it does not run under."""
        reasons = self.unsupported_reasons(pool, config, model)
        if config.inner_compile not in ("auto", *self.inner_compilers):
            reasons.append(f"its graphs run under inner_compile {' or '.join(map(repr, self.inner_compilers))}, "
                           f"not {config.inner_compile!r}")
        if reasons:
            raise Unsupported(f"kernels={self.name!r}: " + "; ".join(reasons))

    def prepare(self, pool, config) -> None:
        """Work at apply that no step should pay (building a kernel)."""

    def inner_compile(self, pool) -> str:
        """The inner compiler for inner_compile='auto': 'eager' by default."""
        return "eager"

    def inner_compiler(self, name: str):
        """The `(gm, example_inputs) -> callable` compiler of one of its own inner_compilers."""
        raise ValueError(f"kernels={self.name!r} has no inner compiler {name!r}")

    def fuse_projections(self, pool) -> bool:
        """fuse_projections='auto': whether fusing the projections pays on this pool."""
        return False

    def options_report(self) -> dict:
        """Its option values by name, for a run's report (the demo's JSON)."""
        return {field.name: getattr(self.options, field.name) for field in dataclasses.fields(self.options)}

    def device_counters(self) -> dict | None:
        """What its device counted in this process, where something counts it (an emulated device):
        {"host_syncs": int, "ops_off_device": {op: calls}}; None elsewhere."""
        return None

    def passes(self) -> list:
        """Its lowering passes (passes.base.GraphPass), in order."""
        return []

    def windowed(self, dcp_size: int) -> bool:
        """Whether `window` limits the query tokens per request at this dcp_size."""
        return self.window is not None

    def prefers_gather_q(self) -> bool:
        """Whether the cost model's 'auto' is not asked: a lowering whose gather-kv attention is not
        one to run (dense over gathered rows) serves every chunk in gather-q."""
        return False

    def strategies(self, dcp_size: int) -> tuple[str, ...]:
        """The attention strategies compiled. At dcp_size 1 'gather-kv' names the graph without
        this lowering's windowed attention, for longer chunks."""
        if dcp_size > 1 or self.windowed(1):
            return ("gather-q", "gather-kv")
        return ("gather-q",)

    def static_shapes(self, strategy: str, config) -> bool:
        """Whether this strategy's graphs are compiled per batch shape (host inputs of one per row,
        or captured whole by its inner compiler), under this DCPConfig (its inner_compile, its
        debug_checks)."""
        return False

    def page_size(self, dcp_size: int, interleave: int, block_size: int) -> int | None:
        """The page size its kernels read, given a block size, or None where any page serves."""
        return None

    def check_layout(self, page_size: int, dcp_size: int, interleave: int) -> None:
        """Raise ValueError unless its kernels can read pages of `page_size` over this layout."""

    def pool_page_size(self, dcp_size: int, interleave: int, block_size: int | None = None) -> int:
        """The page size of a KV pool made for it (`block_size` local rows a page, default
        default_block_size): page_size() where it sets pages; whole local blocks where it plans on
        the host (its block tables); else 1, any location anywhere."""
        block_size = block_size or self.default_block_size
        page = self.page_size(dcp_size, interleave, block_size)
        if page is not None:
            return page
        if self.plans_on_host:
            return dcp_size * math.lcm(block_size, interleave)
        return 1

    def step_options(self, host) -> Options | None:
        """The options a step's graph is lowered under, read from the step's host metadata
        (runtime.host_metadata.HostMetadata, or None where the step has none), for a back end one
        of whose options lowers a graph that serves only some of the batches of its shape. The
        backend lowers a captured graph once per distinct answer, when a step first needs it, and
        picks the lowering on the host at every call (a replay of a captured device graph runs
        the lowering it captured). None (the default): every step runs the graph lowered under
        `options`, with no choice made per call."""
        return None

    def host_feed(self, gm: fx.GraphModule, dcp_rank: int) -> HostFeed | None:
        """The feed of a graph it lowered, or None where the graph reads nothing from the host."""
        return None
