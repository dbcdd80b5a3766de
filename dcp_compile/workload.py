"""One workload spec: the model, the parallel layout, the batch's mode and the kernel back end.

`dcp-compile demo` (harness.scenario.Scenario) and `dcp-compile dump` (debug.fake_capture.
GraphSpec) both extend it, so they agree on the modes, the defaults a back end implies (a model
with the latent widths it needs, a dtype it takes, the page size it reads), and the checks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dcp_compile import cost_model
from dcp_compile.config import DCPConfig, option_values
from dcp_compile.lowering import registry
from dcp_compile.lowering.base import Lowering
from dcp_compile.models.config import MLAModelConfig, preset
from dcp_compile.ops.targets import WINDOW_QUERIES

MODES = ("decode", "verify", "extend")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SMALL_PRESETS = {None: "tiny", (512, 64): "tiny-512"}
"""The small preset a workload defaults to, by the latent widths its back end needs."""


@dataclass(frozen=True)
class Workload:
    mode: str = "decode"
    """decode (1 token per request), verify (draft_len k tokens) or extend (a chunk of tokens)."""
    dcp_size: int = 2
    """N, the ranks the KV cache is sharded over."""
    tp_size: int | None = 2
    """TP ranks the heads are split over (None: as many as dcp_size)."""
    batch: int = 4
    """Requests in a batch."""
    draft_len: int = 7
    """verify: query tokens per request (k), 1..16."""
    chunk: int | None = None
    """extend: new tokens per request and step."""
    model: str | None = None
    """A preset of dcp_compile.models.config (None: tiny, or the small preset with the latent
    widths the back end needs: tiny-512 for kernels='npu')."""
    layers: int | None = None
    """Layer count, keeping the preset's layer pattern; None keeps the preset's."""
    num_heads: int | None = None
    """Override the preset's attention heads (e.g. a count FIA needs padded to a power of two)."""
    interleave: int = 1
    """I, the interleave size."""
    page_size: int | None = None
    """KV page size; None: the one the back end reads (kernels='npu': from block_size), else I."""
    block_size: int = 128
    """Rows of one local block, where the back end sets pages from it (kernels='npu': FIA's
    block size, 16 or 128; pages are block_size x N locations at interleave 1, or block_size)."""
    kernels: str = "auto"
    """The kernel back end (dcp_compile.lowering.registry names)."""
    dtype: str | None = None
    """Weights and KV cache dtype; None: `default_dtype`, or bfloat16 where the back end takes no fp32."""
    attention_strategy: str = "auto"
    """gather-q, gather-kv, or auto (the cost model's pick per batch)."""
    debug_checks: bool = False
    """Run the debug-check passes too."""
    inner_compile: str = "auto"
    """The DCP model's inner compiler (DCPConfig.inner_compile: auto, eager, inductor, or one of the back end's own)."""
    options: tuple = ()
    """The DCP model's back-end option values by name (DCPConfig.options; a dict is taken too),
    checked by the back end; the dcp_size=1 baseline keeps its back end's defaults, but for the
    facts of the deployment its Options mark (Options.baseline_values, e.g. fia_block_sizes)."""

    default_dtype = "float32"
    device_type = "cpu"
    """The device the back end runs on here ('auto' resolves by it)."""

    def __post_init__(self) -> None:
        for name in ("dcp_size", "batch", "draft_len", "interleave", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
        for name in ("dcp_size", "batch", "interleave"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("tp_size", "layers", "num_heads", "page_size", "chunk"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name.replace('_', '-')} must be an int >= 1, got {value!r}")
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {list(MODES)}")
        if not 1 <= self.draft_len <= WINDOW_QUERIES:
            raise ValueError(f"draft-len must be in [1, {WINDOW_QUERIES}] (verify's k), got {self.draft_len}")
        cost_model.check_strategy(self.attention_strategy)
        if self.inner_compile not in registry.inner_compilers():
            raise ValueError(f"inner-compile must be one of {list(registry.inner_compilers())}, got {self.inner_compile!r}")
        object.__setattr__(self, "options", option_values(self.options))
        lowering = self.lowering()  # an unknown back end, or an option it does not read, raises here
        if self.model is None:
            object.__setattr__(self, "model", SMALL_PRESETS.get(lowering.model_dims, "tiny"))
        if self.dtype is None:
            takes_fp32 = lowering.dtypes is None or torch.float32 in lowering.dtypes
            object.__setattr__(self, "dtype", self.default_dtype if takes_fp32 else "bfloat16")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {list(DTYPES)}")
        self._check_model(lowering)
        if lowering.page_size(self.dcp_size, self.interleave, self.block_size) is not None:
            if self.page_size is not None:
                raise ValueError(f"kernels={lowering.name!r} sets the page size from the block size (--block-size)")
            if self.block_size < 1:
                raise ValueError(f"block-size must be >= 1, got {self.block_size}")
        if self.pages % self.interleave:
            raise ValueError(f"interleave size {self.interleave} must divide the page size {self.pages}")

    def _check_model(self, lowering: Lowering) -> None:
        cfg = self.model_config()  # an unknown preset, or a bad checkpoint config, raises here
        dims = (cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        if lowering.model_dims is not None and dims != lowering.model_dims:
            hint = f" (try {SMALL_PRESETS[lowering.model_dims]})" if lowering.model_dims in SMALL_PRESETS else ""
            raise ValueError(f"--kernels {lowering.name}: its kernels need kv_lora_rank {lowering.model_dims[0]} and a rope "
                             f"dim of {lowering.model_dims[1]}; model {self.model} has {dims[0]} and {dims[1]}{hint}")
        if lowering.dtypes is not None and DTYPES[self.dtype] not in lowering.dtypes:
            raise ValueError(f"--kernels {lowering.name} takes a {' or '.join(str(d) for d in lowering.dtypes)} KV cache, "
                             f"not {self.dtype}")

    @property
    def tp(self) -> int:
        return self.dcp_size if self.tp_size is None else self.tp_size

    def lowering(self) -> Lowering:
        """The back end `kernels` names; for 'auto', the one it falls back to on this device (what
        its demo and dump checks read: the options and page rules of CUDA's two, FlashInfer and
        Triton, are the same; bind() picks the one that serves the pool)."""
        name = self.kernels if self.kernels != registry.AUTO else registry.auto_choices(self.device_type)[-1]
        lowering = registry.get(name)
        return lowering.configured(registry.options_for(lowering, self.options))

    def pages_for(self, dcp_size: int) -> int:
        """The page size of the model at `dcp_size`."""
        pages = self.lowering().page_size(dcp_size, self.interleave, self.block_size)
        return pages if pages is not None else self.page_size or self.interleave

    @property
    def pages(self) -> int:
        return self.pages_for(self.dcp_size)

    def check_layout(self) -> None:
        """The back end can read the DCP model's pages (a clear error naming the flag if not)."""
        lowering = self.lowering()
        sets_pages = lowering.page_size(self.dcp_size, self.interleave, self.block_size) is not None
        try:
            lowering.check_layout(self.pages, self.dcp_size, self.interleave)
        except ValueError as exc:
            flag = f"--block-size {self.block_size}" if sets_pages else f"--page-size {self.pages}"
            raise ValueError(f"{flag} does not suit kernels={lowering.name!r}: {exc}") from None

    def config(self, **fields) -> DCPConfig:
        return DCPConfig(dcp_size=self.dcp_size, interleave=self.interleave, kernels=self.kernels,
                         attention_strategy=self.attention_strategy, debug_checks=self.debug_checks,
                         inner_compile=self.inner_compile, options=self.options, **fields)

    def model_config(self) -> MLAModelConfig:
        cfg = preset(self.model)
        if self.num_heads is not None:
            cfg = cfg.replace(num_heads=self.num_heads)
        return cfg.with_layers(self.layers) if self.layers is not None else cfg
