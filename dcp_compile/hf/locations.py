"""Disjoint KV locations for the caches of one pool.

Every `DCPCache` of a pool takes its locations from the pool's one `LocationAllocator`, so two
live caches (two conversations, or a `generate()` while another cache is live) never write each
other's KV. A cache gives its locations back when it is released (`DCPCache.release()`) or
garbage collected; a cache that does not fit in the free locations is a `MemoryError` naming the
sizes. Location 0 stays reserved for padding.

Locations are logical (the pool shards them over the DCP ranks by token), so a cache needs no
contiguous range: it takes the lowest free ones, and a pool with enough free locations always
serves a cache, however fragmented.

Under DCP a cache takes the same locations on every rank (`allocate(..., group)`): each rank's
allocator is its own, and a cache dropped inside a reference cycle comes back when that rank's
garbage collector runs, so the ranks' free locations can differ. The ranks compare their free
lists (one small all-gather); where they differ, they take the lowest locations free on every
rank (one all-gather of a page bitmap). A location free on one rank only stays free there until
its peer's collector gives it back too. They are handed out in whole pages of the pool (a page of 1
where its back end reads any location; whole local blocks where it reads block tables), so that
a row of whole pages is whole blocks on every rank; the first page, which holds location 0, is
never handed out.
"""

from __future__ import annotations

import collections
import gc
import threading
import weakref

import torch

from dcp_compile.runtime.failure import agreed
from dcp_compile.runtime.kv_pool import MLAKVPool

Ranges = list[tuple[int, int]]
"""Half-open [start, end) ranges of locations, ascending and disjoint."""


class LocationAllocator:
    """The free locations [page_size, capacity) of one pool, handed out as ranges of whole pages."""

    def __init__(self, capacity: int, page_size: int = 1):
        if page_size < 1 or capacity % page_size:
            raise ValueError(f"a page size of {page_size} does not tile a capacity of {capacity}")
        self.capacity, self.page_size = capacity, page_size
        self._free: Ranges = [(page_size, capacity)] if capacity > page_size else []
        self._live: dict[int, Ranges] = {}
        """The ranges each live allocation holds, by allocation id."""
        self._next_id = 0
        self._lock = threading.Lock()
        # A garbage-collected cache's finalizer may run in the middle of allocate() on the same
        # thread (gc runs at any allocation): it only queues its allocation, which the next call takes back.
        self._returned: collections.deque[int] = collections.deque()

    def allocate(self, count: int, what: str, group=None) -> tuple[int, torch.Tensor]:
        """`count` free locations (a multiple of the page size), ascending, as (allocation id,
        int64 tensor); `what` names the request in the error when they are not free. group: the
        DCP group's agreement (same_free, common_free), under which every rank takes the same
        locations (a collective; its MemoryError is raised on every rank alike)."""
        if count % self.page_size:
            raise ValueError(f"{what}: {count} locations are not whole pages of {self.page_size}")
        for attempt in range(2):
            if group is None and count > self.free_locations():
                gc.collect()  # caches dropped inside reference cycles (outside the lock: gc runs arbitrary code)
            with self._lock:
                self._take_back_returned()
                free = list(self._free)
            usable = free if group is None else self._common(free, count, group)
            if count <= _size(usable):
                break
            if group is None or attempt:
                raise agreed(MemoryError(
                    f"{what} needs {count} KV locations; the pool has {self.capacity - self.page_size} "
                    f"({reserved(self.page_size)}), {_size(usable)} of them free"
                    f"{'' if group is None else ' on every DCP rank'}: {self.live_caches()} live cache(s) hold the "
                    "rest. Release a cache (cache.release(), or drop every reference to it), make a smaller one, or "
                    "pass a larger kv_capacity to dcp_compile.apply"))
            gc.collect()  # on every rank: caches dropped inside reference cycles
        taken = _lowest(usable, count)
        with self._lock:
            self._free = _subtract(self._free, taken)
            allocation = self._next_id
            self._next_id += 1
            self._live[allocation] = taken
        locations = torch.cat([torch.arange(start, end, dtype=torch.int64) for start, end in taken])
        return allocation, locations

    def _common(self, free: Ranges, count: int, group) -> Ranges:
        """The ranges free on every rank of `group` (this rank's `free` where the ranks agree)."""
        if group.same_free(count, free):
            return free
        pages = torch.zeros(self.capacity // self.page_size, dtype=torch.bool)
        for start, end in free:
            pages[start // self.page_size:end // self.page_size] = True
        common = group.common_free(pages)
        edges = torch.diff(torch.nn.functional.pad(common.to(torch.int8), (1, 1))).nonzero().flatten().tolist()
        return [(start * self.page_size, end * self.page_size) for start, end in zip(edges[::2], edges[1::2])]

    def release(self, allocation: int) -> None:
        """Give an allocation's locations back (once: a second call does nothing)."""
        with self._lock:
            self._give_back(allocation)

    def release_later(self, allocation: int) -> None:
        """release() for a finalizer: queued, taken back by the next call that takes the lock."""
        self._returned.append(allocation)

    def free_locations(self) -> int:
        with self._lock:
            self._take_back_returned()
            return self._free_count()

    def live_caches(self) -> int:
        with self._lock:
            self._take_back_returned()
            return len(self._live)

    def _free_count(self) -> int:
        return sum(end - start for start, end in self._free)

    def _take_back_returned(self) -> None:
        while self._returned:
            self._give_back(self._returned.popleft())

    def _give_back(self, allocation: int) -> None:
        ranges = self._live.pop(allocation, None)
        if ranges is None:
            return
        merged: Ranges = []
        for start, end in sorted(self._free + ranges):
            if merged and merged[-1][1] == start:
                merged[-1] = (merged[-1][0], end)
            else:
                merged.append((start, end))
        self._free = merged


def _size(ranges: Ranges) -> int:
    return sum(end - start for start, end in ranges)


def _lowest(ranges: Ranges, count: int) -> Ranges:
    """The first `count` locations of `ranges`, as ranges."""
    taken: Ranges = []
    for start, end in ranges:
        if count <= 0:
            break
        piece_end = min(end, start + count)
        taken.append((start, piece_end))
        count -= piece_end - start
    return taken


def _subtract(ranges: Ranges, taken: Ranges) -> Ranges:
    """`ranges` less `taken` (each within one of `ranges`)."""
    left: Ranges = []
    for start, end in ranges:
        for take_start, take_end in taken:
            if start < take_end and take_start < end:
                if start < take_start:
                    left.append((start, take_start))
                start = max(start, take_end)
        if start < end:
            left.append((start, end))
    return left


def reserved(page_size: int) -> str:
    """What of a pool no cache gets, for the errors."""
    return "location 0 is reserved" if page_size == 1 else f"the page of location 0, {page_size} locations, is reserved"


_ALLOCATORS: "weakref.WeakKeyDictionary[MLAKVPool, LocationAllocator]" = weakref.WeakKeyDictionary()
_ALLOCATORS_LOCK = threading.Lock()


def allocator(pool: MLAKVPool) -> LocationAllocator:
    """The one allocator of `pool`'s locations, made at its first cache (over its logical capacity)."""
    with _ALLOCATORS_LOCK:
        found = _ALLOCATORS.get(pool)
        if found is None or found.capacity != pool.capacity or found.page_size != pool.page_size:
            if found is not None and found.live_caches():
                raise RuntimeError(f"the KV pool's capacity changed from {found.capacity} to {pool.capacity} while "
                                   f"{found.live_caches()} cache(s) of it are live: reshard a pool before any cache")
            found = _ALLOCATORS[pool] = LocationAllocator(pool.capacity, pool.page_size)
        return found
