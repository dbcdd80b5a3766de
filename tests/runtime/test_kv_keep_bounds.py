"""kv_keep='capacity': the pool's capacity is exactly the locations its rows hold, so that no KV
location at or past the capacity it reports is accepted (the writers and the guard bound a
location by the rows over the DCP group)."""

from __future__ import annotations

import math

import pytest
import torch

from dcp_compile.ops import reference
from dcp_compile.runtime import layout
from dcp_compile.runtime.kv_pool import MLAKVPool

KV_LORA_RANK, ROPE_DIM = 4, 2


def _shards(capacity: int, dcp_size: int, interleave: int = 1, page_size: int = 1) -> list[MLAKVPool]:
    shards = []
    for rank in range(dcp_size):
        pool = MLAKVPool(1, capacity, KV_LORA_RANK, ROPE_DIM, page_size=page_size)
        pool.reshard(dcp_size, rank, interleave, keep="capacity")
        shards.append(pool)
    return shards


def _write(pool: MLAKVPool, loc: int) -> None:
    """One token's KV at `loc`, through the reference writer of this rank's shard."""
    latent, rope = torch.ones(1, KV_LORA_RANK), torch.ones(1, ROPE_DIM)
    reference.kv_write(pool.cache(0), latent, rope, torch.tensor([loc]), pool.dcp_rank, pool.dcp_size, pool.interleave)


@pytest.mark.parametrize("capacity", [7, 9, 4097])
def test_an_odd_capacity_at_dcp_2_refuses_the_location_equal_to_the_capacity(capacity):
    shards = _shards(capacity, dcp_size=2)
    reported = shards[0].capacity
    assert reported >= capacity and all(pool.capacity == reported for pool in shards)
    for pool in shards:
        with pytest.raises(IndexError, match=f"KV write location {reported} is outside the pool"):
            _write(pool, reported)
    for pool in shards:
        _write(pool, reported - 1)  # the last location the pool reports is a row of one rank
    assert sum(bool(pool.cache(0).any()) for pool in shards) == 1


@pytest.mark.parametrize("capacity, dcp_size, interleave, page_size", [
    (7, 2, 1, 1), (9, 4, 1, 1), (21, 2, 1, 7), (48, 2, 16, 16), (48, 4, 4, 16), (100, 3, 2, 4), (64, 2, 1, 64),
])
def test_keep_capacity_reports_exactly_the_locations_its_rows_hold(capacity, dcp_size, interleave, page_size):
    pool = _shards(capacity, dcp_size, interleave, page_size)[-1]
    assert pool.capacity == layout.logical_capacity(pool.rows_per_rank, dcp_size, interleave)  # what the guard bounds
    assert pool.capacity >= capacity and pool.capacity % page_size == 0
    assert pool.capacity - capacity < math.lcm(interleave * dcp_size, page_size)  # rounded up to whole strides only
