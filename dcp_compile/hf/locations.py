"""Disjoint KV locations for the caches of one pool.

Every `DCPCache` of a pool takes its locations from the pool's one `LocationAllocator`, so two
live caches (two conversations, or a `generate()` while another cache is live) never write each
other's KV. A cache gives its locations back when it is released (`DCPCache.release()`) or
garbage collected; a cache that does not fit in the free locations is a `MemoryError` naming the
sizes. Location 0 stays reserved for padding.

Locations are logical (the pool shards them over the DCP ranks by token), so a cache needs no
contiguous range: it takes the lowest free ones, and a pool with enough free locations always
serves a cache, however fragmented. They are handed out in whole pages of the pool (a page of 1
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

    def allocate(self, count: int, what: str) -> tuple[int, torch.Tensor]:
        """`count` free locations (a multiple of the page size), ascending, as (allocation id,
        int64 tensor); `what` names the request in the error when they are not free."""
        if count % self.page_size:
            raise ValueError(f"{what}: {count} locations are not whole pages of {self.page_size}")
        if count > self.free_locations():
            gc.collect()  # caches dropped inside reference cycles (outside the lock: gc runs arbitrary code)
        with self._lock:
            self._take_back_returned()
            free = self._free_count()
            if count > free:
                raise MemoryError(
                    f"{what} needs {count} KV locations; the pool has {self.capacity - self.page_size} "
                    f"({reserved(self.page_size)}), "
                    f"{free} of them free: {len(self._live)} live cache(s) hold the rest. Release a "
                    "cache (cache.release(), or drop every reference to it), make a smaller one, or pass a larger "
                    "kv_capacity to dcp_compile.apply")
            taken: Ranges = []
            needed = count
            while needed:
                start, end = self._free[0]
                piece_end = min(end, start + needed)
                taken.append((start, piece_end))
                needed -= piece_end - start
                if piece_end == end:
                    self._free.pop(0)
                else:
                    self._free[0] = (piece_end, end)
            allocation = self._next_id
            self._next_id += 1
            self._live[allocation] = taken
        locations = torch.cat([torch.arange(start, end, dtype=torch.int64) for start, end in taken])
        return allocation, locations

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
