"""Host-side local metadata: RequestTable keeps it incrementally, and it equals the metadata
recomputed from the batch tensors (and the in-graph local view) after appends, verify
accept/reject truncations, shared prefixes and frees."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_compile.ops import reference
from dcp_compile.runtime import layout
from dcp_compile.runtime.batch import RequestTable
from dcp_compile.runtime.host_metadata import HostMetadata

# (dcp_size, interleave, page_size): token-interleaved pages of block x N, page-interleaved
# pages, and a layout whose pages do not form whole local blocks (no block table).
LAYOUTS = [(1, 1, 16), (2, 1, 32), (4, 1, 64), (2, 16, 16), (4, 2, 16), (3, 2, 4)]


def assert_equal_to_recomputed(table: RequestTable, requests, tokens, pad_rows=1):
    batch = table.extend_batch(requests, tokens, pad_rows=pad_rows)
    expected = HostMetadata.from_tensors(batch.req_to_token, batch.seq_lens, batch.q_seq_ids,
                                         table.dcp_size, table.interleave, table.page_size)
    host = batch.host
    assert host.query_lens == expected.query_lens == tuple(len(t) for t in tokens) + (1,) * pad_rows
    assert host.local_seq_lens == expected.local_seq_lens
    assert host.local_prefix_lens == expected.local_prefix_lens
    if table.block_size is None:
        assert host.block_tables is None and expected.block_tables is None
    else:
        # Entries past a rank's last used block are never read (a page's blocks are listed from
        # its allocation on, before a rank holds a key in them).
        lens = torch.tensor(host.local_seq_lens)[..., None]
        used = torch.arange(host.block_tables.shape[2]) * table.block_size < lens
        assert torch.equal(torch.where(used, host.block_tables, 0), expected.block_tables)
    for rank in range(table.dcp_size):
        _, lens, _ = reference.local_metadata(batch.req_to_token, batch.seq_lens, rank, table.dcp_size, table.interleave)
        assert host.local_seq_lens[rank] == tuple(lens.tolist())
    return batch


@settings(max_examples=25, deadline=None, derandomize=True)
@given(data=st.data(), layout_index=st.integers(0, len(LAYOUTS) - 1))
def test_incremental_host_metadata_equals_recomputed(data, layout_index):
    dcp_size, interleave, page_size = LAYOUTS[layout_index]
    table = RequestTable(4, 160, 4096, page_size, dcp_size=dcp_size, interleave=interleave)
    for _ in range(data.draw(st.integers(1, 5))):
        requests = sorted(data.draw(st.sets(st.integers(0, 3), min_size=1, max_size=4)))
        counts = [data.draw(st.integers(1, 20)) for _ in requests]
        if any(int(table.seq_lens[r]) + c > table.max_context for r, c in zip(requests, counts)):
            continue
        assert_equal_to_recomputed(table, requests, [[1] * c for c in counts])
        # Verify accept/reject: keep a random number of the appended tokens.
        for r, c in zip(requests, counts):
            if data.draw(st.booleans()):
                table.truncate(r, int(table.seq_lens[r]) - data.draw(st.integers(0, c)))
    if int(table.seq_lens[0]) >= page_size and int(table.seq_lens[3]) == 0:
        table.fork(0, 3, page_size)
    table.truncate(1, 0)  # free a request
    assert_equal_to_recomputed(table, [0, 1, 2, 3], [[1]] * 4, pad_rows=2)


def test_block_table_reads_each_ranks_keys_in_position_order():
    """The FIA view: local key j of a row sits at block_table[j // bs] * bs + j % bs."""
    for dcp_size, interleave, page_size in LAYOUTS[:5]:
        table = RequestTable(3, 200, 4096, page_size, dcp_size=dcp_size, interleave=interleave)
        batch = table.extend_batch([0, 1, 2], [[1] * 1, [1] * 70, [1] * 150])
        bs = table.block_size
        assert bs == layout.local_block_size(page_size, dcp_size, interleave)
        for rank in range(dcp_size):
            rows, lens, _ = reference.local_metadata(batch.req_to_token, batch.seq_lens, rank, dcp_size, interleave)
            blocks = batch.host.block_tables[rank].long()
            for b in range(3):
                j = torch.arange(int(lens[b]))
                assert torch.equal(blocks[b, j // bs] * bs + j % bs, rows[b, : int(lens[b])])


def test_prefix_lengths_after_rejected_drafts_are_current():
    """After a verify step rejects drafts, the next batch's host lengths count only kept keys."""
    table = RequestTable(2, 64, 1024, 8, dcp_size=2)
    table.extend_batch([0, 1], [[1] * 5, [1] * 9])
    verify = table.extend_batch([0, 1], [[1] * 7, [1] * 7])
    assert verify.host.query_lens == (7, 7)
    table.truncate(0, 5 + 2)
    table.truncate(1, 9 + 0)
    after = assert_equal_to_recomputed(table, [0, 1], [[1], [1]])
    assert [sum(lens[b] for lens in after.host.local_seq_lens) for b in range(2)] == [8, 10]
