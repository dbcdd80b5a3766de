"""Host metadata cut into pieces of at most 16 queries of a row (lowering/npu/pieces.py), the rows
FIA's MLA path runs for chunks of any length: each piece's local prefix length against the rank's
local view of the page table, on RequestTable's batches and on from_tensors alike, with mixed
chunk lengths, ranks owning none of a piece, and padded rows."""

from __future__ import annotations

import pytest
import torch

from dcp_compile.runtime import layout
from dcp_compile.runtime.batch import RequestTable
from dcp_compile.lowering.npu.pieces import piece_prefix_lens, pieces
from dcp_compile.ops.targets import WINDOW_QUERIES as PIECE_QUERIES
from dcp_compile.runtime.host_metadata import HostMetadata


def _expected(batch, rank, dcp_size, interleave):
    """Per piece: the rank's keys of the row at positions before the piece's first query."""
    _, lens, positions = layout.local_view(batch.req_to_token, batch.seq_lens, rank, dcp_size, interleave)
    valid = torch.arange(batch.req_to_token.shape[1])[None, :] < lens[:, None]
    expected = []
    for row, count in enumerate(batch.host.query_lens):
        first = int(batch.seq_lens[row]) - count if int(batch.seq_lens[row]) else 0
        for start in range(0, count, PIECE_QUERIES):
            expected.append(int((valid[row] & (positions[row] < first + start)).sum()))
    return expected


@pytest.mark.parametrize("dcp_size, interleave, page", [(1, 1, 16), (2, 1, 32), (4, 1, 64), (2, 16, 16)])
def test_piece_prefix_lengths_equal_the_local_view(dcp_size, interleave, page):
    table = RequestTable(4, 512, 4096, page, dcp_size=dcp_size, interleave=interleave)
    table.extend_batch([0, 1], [[1] * 5, [2] * 33])
    batch = table.extend_batch([0, 1, 2], [[3] * 40, [4] * 7, [5] * 17], pad_rows=2)
    assert [count for _, _, count in pieces(batch.host.for_rank(0))] == [16, 16, 8, 7, 16, 1, 1, 1]
    rebuilt = HostMetadata.from_tensors(batch.req_to_token, batch.seq_lens, batch.q_seq_ids, dcp_size, interleave, page)
    assert rebuilt.query_owners == batch.host.query_owners
    for rank in range(dcp_size):
        expected = _expected(batch, rank, dcp_size, interleave)
        assert piece_prefix_lens(batch.host.for_rank(rank)) == expected
        assert piece_prefix_lens(rebuilt.for_rank(rank)) == expected


def test_padding_keeps_the_owners_aligned_with_the_tokens():
    table = RequestTable(4, 256, 2048, 32, dcp_size=2)
    batch = table.extend_batch([0], [[1] * 20])
    padded = batch.host.padded(3, 4)
    assert len(padded.query_owners) == 20 + 2 * 4 and padded.query_owners[20:] == (-1,) * 8
    assert piece_prefix_lens(padded.for_rank(1)) == [0, 8, 0, 0]


def test_pieces_of_rows_over_sixteen_queries_need_the_owners():
    table = RequestTable(2, 256, 2048, 32, dcp_size=2)
    host = table.extend_batch([0], [[1] * 20]).host
    bare = HostMetadata(host.dcp_size, host.interleave, host.page_size, host.query_lens, host.local_seq_lens,
                        host.local_prefix_lens, host.block_tables)
    with pytest.raises(ValueError, match="without query owners"):
        piece_prefix_lens(bare.for_rank(0))
