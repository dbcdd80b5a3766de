"""The transformers front end's per-step host metadata (hf/cache.step_host_metadata, for the back
ends that plan on the host: FIA, FlashInfer) equals HostMetadata.from_tensors of the same step,
the O(context) oracle, with each padding token stored nowhere: over DCP sizes, token- and
page-interleaved layouts, caches of several pages a row, left padding, prefill, verify-sized and
decode steps, and graph widths past the cache's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from dcp_compile.config import DCPConfig  # noqa: E402
from dcp_compile.hf.cache import DCPCache, step_host_metadata  # noqa: E402
from dcp_compile.runtime import layout  # noqa: E402
from dcp_compile.runtime.host_metadata import HostMetadata  # noqa: E402
from dcp_compile.runtime.kv_pool import MLAKVPool  # noqa: E402


def oracle(cache: DCPCache, tokens: int, config: DCPConfig, length: int, width: int) -> HostMetadata:
    pads = torch.tensor(cache.pads, dtype=torch.int64)
    seq_lens = (length + tokens - pads).clamp_min(0)
    table = torch.nn.functional.pad(cache.host_table, (0, width - cache.host_table.shape[1]))
    host = HostMetadata.from_tensors(table, seq_lens, torch.arange(cache.rows).repeat_interleave(tokens),
                                     config.dcp_size, config.interleave, cache.pool.page_size)
    positions = torch.arange(length, length + tokens).unsqueeze(0) - pads.unsqueeze(1)
    owners = torch.where(positions >= 0, layout.owner(cache.host_table.gather(1, positions.clamp_min(0)),
                                                       config.dcp_size, config.interleave), -1)
    return dataclasses.replace(host, query_owners=tuple(owners.reshape(-1).tolist()))


@pytest.mark.parametrize("dcp_size,interleave,page", [(1, 1, 4), (2, 1, 4), (4, 1, 4), (2, 4, 4), (2, 2, 8)])
def test_step_host_metadata_equals_from_tensors(dcp_size, interleave, page):
    """Token-interleaved pages of 1 to 4 rows a rank, page-interleaved (interleave = page) and
    pages of whole interleave strides."""
    pool = MLAKVPool(1, page * 64, 16, 8, torch.float32, "cpu", page_size=page)
    pool.reshard(dcp_size, 0, interleave)  # the layout the host view reads
    config = DCPConfig(dcp_size=dcp_size, interleave=interleave)
    other = DCPCache(pool, 1, 3 * page + 1)  # the next cache's locations start past a taken range
    cache = DCPCache(pool, 3, 5 * page - 3)
    cache.set_padding([0, 3, page + 1])
    checked = 0
    for length, tokens in ((0, page + 2), (page + 2, 1), (page + 3, 4), (3 * page, 1)):
        for width in (cache.max_length, cache.max_length + 2 * page):
            if length + tokens > cache.max_length:
                continue
            got = step_host_metadata(cache, tokens, length=length, width=width)
            want = oracle(cache, tokens, config, length, width)
            assert got.query_lens == want.query_lens
            assert got.local_seq_lens == want.local_seq_lens and got.local_prefix_lens == want.local_prefix_lens
            assert got.query_owners == want.query_owners
            assert _same_used_blocks(got, want)
            checked += 1
    assert checked >= 6
    del other


def _same_used_blocks(got: HostMetadata, want: HostMetadata) -> bool:
    """The block ids a kernel reads (those of each row's local keys) agree; entries past them may differ."""
    block = layout.local_block_size(got.page_size, got.dcp_size, got.interleave)
    for rank in range(got.dcp_size):
        for row, length in enumerate(want.local_seq_lens[rank]):
            used = -(-length // block)
            if not torch.equal(got.block_tables[rank, row, :used], want.block_tables[rank, row, :used]):
                return False
    return True


def test_a_cache_keeps_its_length_on_the_host():
    pool = MLAKVPool(1, 64, 16, 8, torch.float32, "cpu")
    cache = DCPCache(pool, 2, 8)
    cache.advance(3)
    cache.advance(1)
    assert cache.length() == 4
    cache.resync()  # no step ran on the device: its counters say 0
    assert cache.length() == 0
