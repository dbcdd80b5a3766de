"""The lowering interface: one object per kernel back end (torch, triton, flashinfer, npu, or one
registered from outside the package), looked up by name in lowering/registry.py.

Everything above lowering/ (apply, the backend, the compiled model, the demo, the dump) asks a
back end through these methods and never names one:

- serves: `unsupported_reason(pool, config)`: None, or one reason string;
- its options: `options` (the DCPConfig fields it reads; apply refuses the others set away from
  their defaults) and `configured(config)`, the back end with them applied, which apply keeps;
- checks at apply: `check(model, pool, config)`; `prepare(pool, config)` (a kernel build);
- its passes: `passes()`, run after the DCP rewrites, before cleanup and the verifier;
- its query limit: `window` tokens per request where `windowed(dcp_size)`, more going to the
  gather-kv strategy, which `strategies(dcp_size)` then compiles at dcp_size 1 too;
- its KV layout: `kv_layout` (the pool's rows packed, or split in two tensors),
  `page_size(dcp_size, interleave, block_size)` (the pages its kernels read,
  where it sets them), `check_layout(page_size, dcp_size, interleave)`, `model_dims` (the
  latent and rope widths it needs) and `dtypes`;
- its inner compiler where the config says 'auto': `inner_compile(pool)` (the fastest measured),
  and `skinny_matmuls(pool)`;
- which dcp_size=1 baseline a comparison runs it against: `baseline` (the demo);
- its graphs' shapes: `static_shapes(strategy)` (planned per batch shape on the host);
- its host inputs: `plans_on_host` (each step needs the batch's host metadata) and
  `host_feed(gm, dcp_rank)`, the runtime.host_inputs.HostFeed of a lowered graph, which the
  backend and the graph runner feed before every run and replay.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from dcp_compile.runtime.host_inputs import HostFeed


class Lowering:
    name: str = ""
    description: str = ""
    """One line for --help and logs."""
    window: int | None = None
    """Most query tokens per request its attention over the pool serves, where windowed()."""
    model_dims: tuple[int, int] | None = None
    """(kv_lora_rank, rope dim) its kernels need, or None for any."""
    dtypes: tuple[torch.dtype, ...] | None = None
    """KV cache dtypes its kernels take, or None for any."""
    kv_layout: str = "packed"
    """How the pool holds a layer's rows for its kernels (runtime.kv_pool.KV_LAYOUTS): 'packed',
    or 'split', whose lowering then ends with lowering.kv_layout.SplitKVCache."""
    plans_on_host: bool = False
    """Whether its kernels read host metadata of each step (lengths, block tables, plans)."""
    options: tuple[str, ...] = ()
    """DCPConfig fields that only this back end reads (config.BACK_END_OPTIONS)."""
    baseline: str | None = None
    """The back end a DCP run of it is compared with at dcp_size 1 (None: the torch reference on
    the CPU, 'auto' on a device); itself where its numerics differ from the reference's."""

    def configured(self, config) -> "Lowering":
        """This back end with the options `config` sets for it (a copy where they change anything)."""
        return self

    def unsupported_reason(self, pool, config) -> str | None:
        """Why it cannot serve `pool` (its device, widths, dtype, pages) under `config`; None if it can."""
        if self.model_dims is not None and (pool.kv_lora_rank, pool.rope_dim) != self.model_dims:
            return (f"kernels={self.name!r} needs kv_lora_rank {self.model_dims[0]} and a rope dim of {self.model_dims[1]}, "
                    f"the KV pool has {pool.kv_lora_rank} and {pool.rope_dim}")
        if self.dtypes is not None and pool.dtype not in self.dtypes:
            return f"kernels={self.name!r} takes a {' or '.join(map(str, self.dtypes))} KV cache, not {pool.dtype}"
        return None

    def check(self, model, pool, config) -> None:
        """Checks at apply; raise if one fails. By default: unsupported_reason, then check_layout."""
        reason = self.unsupported_reason(pool, config)
        if reason is not None:
            raise RuntimeError(f"kernels={self.name!r}: {reason}")
        self.check_layout(pool.page_size, config.dcp_size, config.interleave)

    def prepare(self, pool, config) -> None:
        """Work at apply that no step should pay (building a kernel)."""

    def inner_compile(self, pool) -> str:
        """The inner compiler for inner_compile='auto' (config.INNER_COMPILERS): 'eager' by default."""
        return "eager"

    def skinny_matmuls(self, pool) -> bool:
        """skinny_matmuls='auto': whether its passes run few-token projections through the
        skinny-matmul kernel on this pool (where the kernel has configs tuned for its GPU)."""
        return False

    def passes(self) -> list:
        """Its lowering passes (passes.base.GraphPass), in order."""
        return []

    def windowed(self, dcp_size: int) -> bool:
        """Whether `window` limits the query tokens per request at this dcp_size."""
        return self.window is not None

    def strategies(self, dcp_size: int) -> tuple[str, ...]:
        """The attention strategies compiled. At dcp_size 1 'gather-kv' names the graph without
        this lowering's windowed attention, for longer chunks."""
        if dcp_size > 1 or self.windowed(1):
            return ("gather-q", "gather-kv")
        return ("gather-q",)

    def static_shapes(self, strategy: str) -> bool:
        """Whether this strategy's graphs are compiled per batch shape (planned on the host)."""
        return False

    def page_size(self, dcp_size: int, interleave: int, block_size: int) -> int | None:
        """The page size its kernels read, given a block size, or None where any page serves."""
        return None

    def check_layout(self, page_size: int, dcp_size: int, interleave: int) -> None:
        """Raise ValueError unless its kernels can read pages of `page_size` over this layout."""

    def host_feed(self, gm: fx.GraphModule, dcp_rank: int) -> HostFeed | None:
        """The feed of a graph it lowered, or None where the graph reads nothing from the host."""
        return None
