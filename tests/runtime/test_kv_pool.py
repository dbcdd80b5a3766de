"""KV pool sharding: memory per rank and logical capacity."""

from __future__ import annotations

import pytest
import torch

from dcp_compile.runtime.kv_pool import MLAKVPool

REALISTIC_ROWS = 1 << 20  # a million tokens per rank; tiny rows keep the test's memory small


@pytest.mark.parametrize("dcp_size,floor", [(2, 1.99), (4, 3.98), (8, 7.96)])
def test_capacity_ratio_at_same_memory(dcp_size, floor):
    pool = MLAKVPool(1, REALISTIC_ROWS, kv_lora_rank=4, rope_dim=2, dtype=torch.bfloat16)
    bytes_before = pool.report().bytes_per_rank
    pool.reshard(dcp_size, dcp_rank=dcp_size - 1)
    report = pool.report()
    assert report.bytes_per_rank == bytes_before
    assert report.capacity_ratio >= floor
    assert report.usable_locations == REALISTIC_ROWS * dcp_size - 1
    assert report.rows_lost == 1  # location 0


@pytest.mark.parametrize("dcp_size,interleave", [(2, 1), (4, 1), (4, 16), (3, 64)])
def test_same_capacity_shrinks_rows_to_ceil(dcp_size, interleave):
    capacity = 100_032  # whole pages of 64
    pool = MLAKVPool(2, capacity, kv_lora_rank=4, rope_dim=2, page_size=interleave)
    pool.reshard(dcp_size, 0, interleave, keep="capacity")
    stride = dcp_size * interleave
    assert pool.rows_per_rank == -(-capacity // stride) * interleave
    assert pool.cache(1).shape == (pool.rows_per_rank, 6)
    assert pool.report().rows_lost == pool.rows_per_rank * dcp_size - (capacity - interleave)


def test_unsupported_dtype_is_rejected():
    with pytest.raises(TypeError, match="unsupported KV cache dtype"):
        MLAKVPool(1, 16, 4, 2, dtype=torch.int8)


def test_bad_reshard_arguments():
    pool = MLAKVPool(1, 16, 4, 2)
    with pytest.raises(ValueError, match="dcp_rank"):
        pool.reshard(2, 2)
    with pytest.raises(ValueError, match="keep"):
        pool.reshard(2, 0, keep="everything")


def test_interleave_must_divide_page_size():
    pool = MLAKVPool(1, 64, 4, 2, page_size=8)
    with pytest.raises(ValueError, match="must divide the page size 8"):
        pool.reshard(2, 0, interleave=3)
    pool.reshard(2, 0, interleave=8)
    assert pool.report().usable_locations == 64 * 2 - 8  # the first page holds location 0


def test_a_shard_of_one_page_per_rank_reports_its_capacity():
    """Unsharded, a pool of one page holds no usable location (the page holds location 0): the
    sharded pool's ratio to it is infinite, not a division by zero."""
    pool = MLAKVPool(1, 32, 4, 2, page_size=16)
    pool.reshard(2, 1, keep="capacity")
    report = pool.report()
    assert pool.rows_per_rank == 16 and report.usable_locations == 16 and report.unsharded_usable_locations == 0
    assert report.capacity_ratio == float("inf")
