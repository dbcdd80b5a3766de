"""Per-layer latent KV caches with a logical capacity, sharded by tokens under DCP."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from dcp_compile.ops import nz
from dcp_compile.runtime import layout

SUPPORTED_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KV_LAYOUTS = ("packed", "split", "nz")
"""packed: one [rows, R + P] tensor per layer. split: latent [rows, R] and rope [rows, P], two
contiguous tensors per layer, as a kernel that takes them as two inputs needs them (Ascend's fused
attention, docs/ascend.md §11.1). nz: the split layout's two parts in the NZ layout over the
local blocks of the pages, [blocks, 1, D/16, block, 16] each (ops/nz.py; Ascend's FIA with an
NZ cache, docs/ascend.md §11.4). A kernel back end chooses (Lowering.kv_layout)."""


@dataclass(frozen=True)
class CapacityReport:
    dcp_size: int
    interleave: int
    rows_per_rank: int
    bytes_per_rank: int
    usable_locations: int
    unsharded_usable_locations: int
    capacity_ratio: float
    rows_lost: int

    def as_dict(self) -> dict:
        return asdict(self)


def check_cache_dtype(dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_CACHE_DTYPES:
        raise TypeError(f"unsupported KV cache dtype {dtype}; supported: {list(SUPPORTED_CACHE_DTYPES)}")


class MLAKVPool(nn.Module):
    """One [rows, R + P] cache per MLA layer. Location 0 is reserved for padding.

    Unsharded, rows == capacity. `reshard` keeps the rows per rank (the memory) and grows the
    logical capacity N-fold, or keeps the capacity and shrinks the rows.

    In the split layout (`use_layout('split')`) a layer's rows live in two tensors, `parts(i)`;
    `cache(i)`, the tensor the model hands the canonical ops, then holds no memory of its own (a
    [rows, R + P] expansion of one element) and the back end's passes read and write the parts:
    a write into it fails, so nothing reaches the pool through it unseen.
    """

    def __init__(self, num_layers: int, capacity: int, kv_lora_rank: int, rope_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", page_size: int = 1):
        super().__init__()
        for name, value in (("num_layers", num_layers), ("capacity", capacity), ("kv_lora_rank", kv_lora_rank),
                            ("rope_dim", rope_dim), ("page_size", page_size)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if page_size < 1 or capacity % page_size:
            raise ValueError(f"page_size must be >= 1 and divide the capacity {capacity}, got {page_size}")
        self.page_size = page_size
        check_cache_dtype(dtype)
        if num_layers < 1:
            raise ValueError("an MLA KV pool needs at least one MLA layer")
        if capacity < 2:
            raise ValueError(f"capacity must be >= 2 (location 0 is reserved), got {capacity}")
        if kv_lora_rank < 1 or rope_dim < 0:
            raise ValueError(f"kv_lora_rank must be >= 1 and rope_dim >= 0, got {kv_lora_rank} and {rope_dim}")
        self.num_layers, self.row_dim = num_layers, kv_lora_rank + rope_dim
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, rope_dim
        if str(device).startswith("npu"):
            from dcp_compile.runtime.devices import require_torch_npu

            require_torch_npu("a KV pool on an NPU device")
        self.dtype, self.device = dtype, torch.device(device)
        self.dcp_size, self.dcp_rank, self.interleave = 1, 0, 1
        self.unsharded_rows = capacity
        self.capacity = capacity
        self.layout = "packed"
        self._allocate(capacity)

    def _allocate(self, rows: int) -> None:
        self.rows_per_rank = rows
        for i in range(self.num_layers):
            for name in (f"layer_{i}_latent", f"layer_{i}_rope"):
                if hasattr(self, name):
                    delattr(self, name)
            if self.layout == "packed":
                cache = torch.zeros(rows, self.row_dim, dtype=self.dtype, device=self.device)
            else:
                for name, width in ((f"layer_{i}_latent", self.kv_lora_rank), (f"layer_{i}_rope", self.rope_dim)):
                    part = (rows, width) if self.layout == "split" else nz.shape(rows, width, self.nz_block())
                    self.register_buffer(name, torch.zeros(part, dtype=self.dtype, device=self.device), persistent=False)
                cache = torch.zeros(1, 1, dtype=self.dtype, device=self.device).expand(rows, self.row_dim)
            self.register_buffer(f"layer_{i}", cache, persistent=False)

    def use_layout(self, layout: str) -> None:
        """Hold each layer as `layout` (KV_LAYOUTS): reallocates, so only before any KV is written."""
        if layout not in KV_LAYOUTS:
            raise ValueError(f"unknown KV layout {layout!r}; choose one of {KV_LAYOUTS}")
        if layout == self.layout:
            return
        if self.holds_kv():
            raise RuntimeError("the KV pool already holds KV: its layout can change only before the first write")
        self.layout = layout
        self._allocate(self.rows_per_rank)

    def nz_block(self) -> int:
        """The NZ layout's block: the rows of this rank's share of a page (its local block)."""
        return layout.require_local_block_size(self.page_size, self.dcp_size, self.interleave, "the NZ KV layout")

    def cache(self, layer: int) -> torch.Tensor:
        """The [rows, R + P] tensor the model passes to the canonical ops (in the split layout, one
        without memory: see the class docstring)."""
        return getattr(self, f"layer_{layer}")

    def parts(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's latent rows [rows, R] and rope rows [rows, P]: views of the packed cache, or
        the split layout's two tensors (in the nz layout, [blocks, 1, D/16, block, 16] each)."""
        if self.layout == "packed":
            cache = self.cache(layer)
            return cache[:, :self.kv_lora_rank], cache[:, self.kv_lora_rank:]
        return getattr(self, f"layer_{layer}_latent"), getattr(self, f"layer_{layer}_rope")

    def rows(self, layer: int) -> torch.Tensor:
        """A layer's [rows, R + P] contents, in any layout (a copy in the split and nz ones), to inspect."""
        if self.layout == "packed":
            return self.cache(layer)
        latent, rope = self.parts(layer)
        if self.layout == "nz":
            latent, rope = nz.to_rows(latent), nz.to_rows(rope)
        return torch.cat([latent, rope], dim=-1)

    def storage(self) -> list[torch.Tensor]:
        """Every tensor that holds the pool's KV (what a captured graph reads and writes)."""
        if self.layout == "packed":
            return [self.cache(i) for i in range(self.num_layers)]
        return [part for i in range(self.num_layers) for part in self.parts(i)]

    def holds_kv(self) -> bool:
        """Whether any row was written (a fresh pool is all zeros). One pass over the pool."""
        if self.device.type == "meta":
            return False
        return any(bool(t.any()) for t in self.storage())

    def reshard(self, dcp_size: int, dcp_rank: int, interleave: int = 1, keep: str = "memory") -> None:
        """Reallocate as rank `dcp_rank`'s shard. Contents would be dropped, so a pool that holds
        KV is an error: reshard before any write."""
        layout.validate(dcp_size, dcp_rank, interleave)
        if self.holds_kv():
            raise RuntimeError(
                "the KV pool already holds KV (rows were written): apply() reallocates it as this rank's shard, which "
                "would drop every cached token. Call dcp_compile.apply before the first forward"
            )
        if self.page_size % interleave:
            raise ValueError(
                f"interleave size {interleave} must divide the page size {self.page_size}: use 1 "
                f"(token-interleaved) or a divisor of the page size (page-interleaved)"
            )
        if keep == "memory":
            rows = (self.unsharded_rows // interleave) * interleave
            if rows == 0:
                raise ValueError(f"interleave {interleave} exceeds the pool's {self.unsharded_rows} rows")
            capacity = layout.logical_capacity(rows, dcp_size, interleave)
        elif keep == "capacity":
            capacity = self.unsharded_rows
            rows = layout.rows_per_rank(capacity, dcp_size, interleave)
        else:
            raise ValueError(f"keep must be 'memory' or 'capacity', got {keep!r}")
        self.dcp_size, self.dcp_rank, self.interleave, self.capacity = dcp_size, dcp_rank, interleave, capacity
        self._allocate(rows)

    def report(self) -> CapacityReport:
        # The first page holds the reserved location 0 and is never handed out.
        usable = self.capacity - self.page_size
        per_row = self.row_dim * torch.empty((), dtype=self.dtype).element_size()
        unsharded_usable = self.rows_per_rank - self.page_size
        return CapacityReport(
            dcp_size=self.dcp_size,
            interleave=self.interleave,
            rows_per_rank=self.rows_per_rank,
            bytes_per_rank=self.rows_per_rank * per_row * self.num_layers,
            usable_locations=usable,
            unsharded_usable_locations=unsharded_usable,
            capacity_ratio=usable / unsharded_usable,
            rows_lost=self.rows_per_rank * self.dcp_size - usable,
        )


@dataclass(frozen=True)
class PoolSpec:
    """What a kernel back end reads of a KV pool to say whether it serves it (an MLAKVPool has
    the same attributes): for checks before any pool exists."""

    device: torch.device
    kv_lora_rank: int
    rope_dim: int
    dtype: torch.dtype
    page_size: int
