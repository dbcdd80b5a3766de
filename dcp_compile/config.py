"""User-facing configuration. Frozen, so its hash can key compile caches."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dcp_compile.lowering.base import Options

FUSE_PROJECTIONS = ("auto", "on", "off")


def option_values(values) -> tuple[tuple[str, object], ...]:
    """Back-end option values by name (a dict, or (name, value) pairs) as sorted pairs, so that
    equal options give equal, hashable configs."""
    try:
        pairs = tuple(sorted(dict(values or ()).items()))
        hash(pairs)
    except (TypeError, ValueError):
        raise ValueError(f"options must be a back end's Options or option values by name (hashable), got {values!r}") \
            from None
    if not all(isinstance(name, str) for name, _ in pairs):
        raise ValueError(f"option names are strings, got {values!r}")
    return pairs


@dataclass(frozen=True)
class DCPConfig:
    dcp_size: int = 1
    """N: ranks the latent KV cache is sharded over by tokens. Must divide the TP size."""

    interleave: int = 1
    """I: consecutive logical locations owned by one rank (1 = token-interleaved)."""

    inner_compile: str = "auto"
    """Compiler run on the rewritten graph: 'eager' (run the FX graph), 'inductor', one of the
    kernel back end's own (Lowering.inner_compilers, e.g. the NPU back end's torchair), or 'auto':
    the back end's fastest measured one (Lowering.inner_compile).
    bind() records the compiler it resolved here."""

    kernels: str = "auto"
    """The kernel back end: a name registered in dcp_compile.lowering.registry (the built-in ones,
    e.g. the torch reference kernels, or one registered by the user), or 'auto': the back end the
    registry picks for the KV pool's device. bind() records the back end it resolved here."""

    options: object = ()
    """The kernel back end's options: its Options dataclass (Lowering.Options, e.g.
    dcp_compile.lowering.npu.options.NPUOptions), or option values by name (apply's keyword
    arguments that are no field here, e.g. npu_kv_format='nz' for kernels='npu'), which bind()
    checks against the back end it resolves. bind() records the back end's Options here, each
    'auto' among them resolved."""

    fuse_projections: str = "auto"
    """'on': the projections that read one input become one matmul at compile time (q_a with kv_a,
    gate with up; passes/fuse_projections.py), the parameters becoming views of the fused weight;
    'off'; 'auto' (default): the kernel back end decides for the pool (Lowering.fuse_projections:
    on where it was measured to pay). bind() records what it resolved here."""

    attention_strategy: str = "auto"
    """'gather-q', 'gather-kv', or 'auto': the cost model picks per batch (dcp_compile.cost_model).
    A model whose heads are not split (tp_size 1, dcp_size up to the world size) runs
    'replicated-q' (passes/replicated_q_attention.py), which 'auto' resolves to there."""

    debug_checks: bool = False
    """Validate KV write locations and query positions before use (costs host syncs)."""

    disabled_passes: tuple[str, ...] = ()
    """Pass names the pass manager skips, for debugging."""

    dump_dir: str | None = None
    """Folder for per-pass graph dumps; also set by the DCP_COMPILE_DUMP environment variable."""

    def __post_init__(self) -> None:
        if isinstance(self.dcp_size, bool) or not isinstance(self.dcp_size, int) or self.dcp_size < 1:
            raise ValueError(f"dcp_size must be an integer >= 1, got {self.dcp_size!r}")
        if isinstance(self.interleave, bool) or not isinstance(self.interleave, int) or self.interleave < 1:
            raise ValueError(f"interleave must be an integer >= 1, got {self.interleave!r}")
        from dcp_compile.lowering import registry  # the registered back ends, user ones included

        if not isinstance(self.inner_compile, str) or self.inner_compile not in registry.inner_compilers():
            raise ValueError(f"inner_compile must be one of {list(registry.inner_compilers())}, got {self.inner_compile!r}")
        if self.kernels != registry.AUTO:
            registry.get(self.kernels)  # raises for a name no back end is registered under
        if not isinstance(self.options, Options):
            object.__setattr__(self, "options", option_values(self.options))
        if self.fuse_projections not in FUSE_PROJECTIONS:
            raise ValueError(f"fuse_projections must be one of {FUSE_PROJECTIONS}, got {self.fuse_projections!r}")
        if not isinstance(self.debug_checks, bool):
            raise ValueError(f"debug_checks must be True or False, got {self.debug_checks!r}")
        if self.attention_strategy not in ("auto", "gather-q", "gather-kv", "replicated-q"):
            raise ValueError("attention_strategy must be 'auto', 'gather-q', 'gather-kv' or 'replicated-q', got "
                             f"{self.attention_strategy!r}")
        object.__setattr__(self, "disabled_passes", tuple(self.disabled_passes))

    @classmethod
    def split_fields(cls, fields: dict) -> tuple[dict, dict]:
        """(DCPConfig fields, back-end option values) of apply's keyword arguments."""
        own = {f.name for f in dataclasses.fields(cls)}
        return ({k: v for k, v in fields.items() if k in own}, {k: v for k, v in fields.items() if k not in own})

    def with_options(self, values: dict) -> "DCPConfig":
        """This config with more back-end option values by name (an error over an Options instance)."""
        if not values:
            return self
        if isinstance(self.options, Options):
            raise ValueError(f"options are set as {type(self.options).__name__} already; set {sorted(values)} there")
        return self.replace(options={**dict(self.options), **values})

    def replace(self, **changes) -> "DCPConfig":
        return dataclasses.replace(self, **changes)

