"""Per-layer latent KV caches with a logical capacity, sharded by tokens under DCP."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from dcp_compile.runtime import layout

SUPPORTED_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class KVLayout:
    """How a kernel back end wants each layer's rows held (Lowering.kv_layout), as data a generic
    pool allocates: this class is the packed layout, one [rows, R + P] tensor per layer, the one
    the model hands the canonical ops. A back end whose kernels take the latent and rope rows as
    separate tensors declares a subclass whose `part_shapes` gives their shapes; the pool then
    allocates those, and the back end's passes point the graph at them (lowering/kv_layout.py)."""

    name = "packed"
    packed = True
    """Whether the rows live in the one [rows, R + P] tensor per layer (part_shapes gives None)."""

    def part_shapes(self, rows: int, kv_lora_rank: int, rope_dim: int, pool) -> tuple[tuple[int, ...], ...] | None:
        """The shapes of a layer's (latent, rope) tensors for `rows` rows of `pool` (its page size
        and shard), or None where the packed tensor holds them."""
        return None

    def part_rows(self, part: torch.Tensor) -> torch.Tensor:
        """A part's contents as [rows, D], to inspect (a copy where the part is not row-major)."""
        return part

    def reserved_rows(self, pool) -> int:
        """Rows each part holds past the locations' rows of `pool` (its page size and shard): no
        location maps to them and no read sees them, so a back end's KV write can aim there the
        tokens it must not keep (another rank's, padding) where its vendor op takes no slot that
        writes nothing. 0 for the packed layout, whose one tensor is the locations' rows."""
        return 0

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(vars(self).items()))))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


PACKED = KVLayout()


@dataclass(frozen=True)
class CapacityReport:
    dcp_size: int
    interleave: int
    rows_per_rank: int
    reserved_rows_per_rank: int
    """Rows a rank holds past the locations' rows (KVLayout.reserved_rows), in bytes_per_rank and rows_lost."""
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
    logical capacity N-fold, or keeps the capacity (rounded up to whole strides over the group)
    and shrinks the rows.

    In a layout with separate parts (`use_layout(layout)`, a back end's KVLayout) a layer's rows
    live in two tensors, `parts(i)`; `cache(i)`, the tensor the model hands the canonical ops,
    then holds no memory of its own (a [rows, R + P] expansion of one element) and the back end's
    passes read and write the parts: a write into it fails, so nothing reaches the pool through
    it unseen. A layout may hold reserved rows past the locations' rows in each part
    (KVLayout.reserved_rows: `reserved_rows_per_rank`), which no location maps to.
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
        self.layout: KVLayout = PACKED
        self._allocate(capacity)

    def _allocate(self, rows: int) -> None:
        self.rows_per_rank = rows
        self.reserved_rows_per_rank = self.layout.reserved_rows(self)
        shapes = self.layout.part_shapes(rows + self.reserved_rows_per_rank, self.kv_lora_rank, self.rope_dim, self)
        for i in range(self.num_layers):
            for name in (f"layer_{i}_latent", f"layer_{i}_rope"):
                if hasattr(self, name):
                    delattr(self, name)
            if shapes is None:
                cache = torch.zeros(rows, self.row_dim, dtype=self.dtype, device=self.device)
            else:
                for name, shape in zip((f"layer_{i}_latent", f"layer_{i}_rope"), shapes):
                    self.register_buffer(name, torch.zeros(shape, dtype=self.dtype, device=self.device), persistent=False)
                cache = torch.zeros(1, 1, dtype=self.dtype, device=self.device).expand(rows, self.row_dim)
            self.register_buffer(f"layer_{i}", cache, persistent=False)

    def use_layout(self, layout: KVLayout) -> None:
        """Hold each layer as `layout` (a back end's KVLayout): reallocates, so only before any KV is written."""
        if not isinstance(layout, KVLayout):
            raise TypeError(f"a KV layout is a dcp_compile.runtime.kv_pool.KVLayout, got {layout!r}")
        if layout == self.layout:
            return
        if self.holds_kv():
            raise RuntimeError("the KV pool already holds KV: its layout can change only before the first write")
        self.layout = layout
        self._allocate(self.rows_per_rank)

    def cache(self, layer: int) -> torch.Tensor:
        """The [rows, R + P] tensor the model passes to the canonical ops (in the split layout, one
        without memory: see the class docstring)."""
        return getattr(self, f"layer_{layer}")

    def parts(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's latent rows [rows, R] and rope rows [rows, P]: views of the packed cache, or
        the layout's two tensors (of the shapes it gives)."""
        if self.layout.packed:
            cache = self.cache(layer)
            return cache[:, :self.kv_lora_rank], cache[:, self.kv_lora_rank:]
        return getattr(self, f"layer_{layer}_latent"), getattr(self, f"layer_{layer}_rope")

    def rows(self, layer: int) -> torch.Tensor:
        """A layer's [rows, R + P] contents, the locations' rows in any layout (a copy where the
        parts are separate; without the reserved rows), to inspect."""
        if self.layout.packed:
            return self.cache(layer)
        return torch.cat([self.layout.part_rows(part) for part in self.parts(layer)], dim=-1)[:self.rows_per_rank]

    def storage(self) -> list[torch.Tensor]:
        """Every tensor that holds the pool's KV (what a captured graph reads and writes)."""
        if self.layout.packed:
            return [self.cache(i) for i in range(self.num_layers)]
        return [part for i in range(self.num_layers) for part in self.parts(i)]

    def holds_kv(self) -> bool:
        """Whether any row was written (a fresh pool is all zeros). One pass over the pool."""
        if self.device.type == "meta":
            return False
        return any(bool(t.any()) for t in self.storage())

    def reshard(self, dcp_size: int, dcp_rank: int, interleave: int = 1, keep: str = "memory") -> None:
        """Reallocate as rank `dcp_rank`'s shard. Contents would be dropped, so a pool that holds
        KV is an error: reshard before any write.

        keep='memory': the rows per rank stay, the capacity grows N-fold. keep='capacity': at least
        the capacity stays, rounded up to a multiple of interleave x dcp_size and of the page size,
        so that `capacity` is exactly the locations the rows hold: every bound on a location (the
        writers', the guard's: the rows over the group) is then `capacity`."""
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
            # Every row a rank holds is a location: the guards and writers bound locations by the
            # rows over the group, so the capacity grows to whole strides of I x N (and whole pages).
            step = math.lcm(interleave * dcp_size, self.page_size)
            capacity = -(-self.unsharded_rows // step) * step
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
        allocated = self.rows_per_rank + self.reserved_rows_per_rank
        return CapacityReport(
            dcp_size=self.dcp_size,
            interleave=self.interleave,
            rows_per_rank=self.rows_per_rank,
            reserved_rows_per_rank=self.reserved_rows_per_rank,
            bytes_per_rank=allocated * per_row * self.num_layers,
            usable_locations=usable,
            unsharded_usable_locations=unsharded_usable,
            # Rows of one page per rank: unsharded, the reserved page is all there is.
            capacity_ratio=usable / unsharded_usable if unsharded_usable > 0 else math.inf,
            rows_lost=allocated * self.dcp_size - usable,
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
