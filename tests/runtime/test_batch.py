"""Request table: page allocation, accept/reject truncation, shared prefixes, bad input."""

from __future__ import annotations

import pytest
import torch

from dcp_compile.ops import reference
from dcp_compile.runtime import layout
from dcp_compile.runtime.batch import RequestTable, check_draft_len


def test_local_lengths_follow_accept_reject():
    """After rejected drafts, every rank's local length must count only the accepted tokens."""
    table = RequestTable(2, 64, 256)
    table.append(0, 13)
    table.append(1, 3)
    verify = table.extend_batch([0, 1], [[1] * 7, [2] * 7], all_logits=True)
    assert verify.logits_index.tolist() == list(range(14))
    rejected = table.req_to_token[0, 13 + 3 : 20].tolist() + table.req_to_token[1, 4:10].tolist()
    table.truncate(0, 13 + 3)  # the last token and 2 drafts accepted
    table.truncate(1, 3 + 1)  # no draft accepted
    assert table.seq_lens.tolist() == [16, 4]
    assert torch.all(table.req_to_token[0, 16:] == 0) and torch.all(table.req_to_token[1, 4:] == 0)
    for dcp_size in (2, 4):
        counts = [reference.local_metadata(table.req_to_token, table.seq_lens, r, dcp_size, 1)[1] for r in range(dcp_size)]
        assert torch.stack(counts).sum(0).tolist() == [16, 4]
    # The rejected drafts' locations are handed out again (overwritten), never read in between.
    again = table.append(1, 4).tolist()
    assert set(again) <= set(rejected)


def test_pages_are_contiguous_and_owned_by_one_rank():
    table = RequestTable(2, 64, 256, page_size=8)
    locs = table.append(0, 20)
    assert locs.tolist()[:8] == list(range(locs[0], locs[0] + 8)) and int(locs[0]) % 8 == 0
    pages = locs.view(-1, 4)  # interleave 4 divides the page size: each run of 4 has one owner
    owners = layout.owner(pages, 2, 4)
    assert torch.all(owners == owners[:, :1])
    assert 0 not in locs.tolist()


def test_shared_prefix_pages_outlive_one_user():
    table = RequestTable(2, 64, 64, page_size=4)
    table.append(0, 10)
    table.fork(0, 1, 8)
    assert torch.equal(table.req_to_token[1, :8], table.req_to_token[0, :8])
    free = table.free_locations()
    table.truncate(0, 0)
    assert table.free_locations() == free + 4  # only the unshared third page returns
    table.truncate(1, 0)
    assert table.free_locations() == free + 12
    table.append(0, 6)
    with pytest.raises(ValueError, match="whole pages"):
        table.fork(0, 1, 6)


def test_chunk_that_overflows_the_pool():
    table = RequestTable(1, 512, 64)
    with pytest.raises(MemoryError, match="overflows the KV pool"):
        table.append(0, 100)
    assert int(table.seq_lens[0]) == 0


@pytest.mark.parametrize("k", [0, 17, -3])
def test_draft_len_out_of_range(k):
    with pytest.raises(ValueError, match=r"verify length k must be in \[1, 16\]"):
        check_draft_len(k)


def test_padded_rows_write_location_zero():
    table = RequestTable(2, 16, 64)
    batch = table.extend_batch([0], [[5, 6]], pad_rows=2)
    assert batch.out_loc.tolist()[-2:] == [0, 0]
    assert batch.seq_lens.tolist() == [2, 0, 0]


def test_extend_batch_is_atomic_when_the_pool_runs_out():
    table = RequestTable(3, 64, 32, page_size=4)
    table.extend_batch([0], [[1] * 8])
    before = (table.req_to_token.clone(), table.seq_lens.clone(), [list(p) for p in table.pages],
              list(table.free_pages), table.local_seq_lens.clone())
    with pytest.raises(MemoryError, match="overflows the KV pool"):
        table.extend_batch([1, 2, 0], [[1] * 8, [1] * 8, [1] * 8])  # 6 pages asked, 5 free
    after = (table.req_to_token, table.seq_lens, table.pages, table.free_pages, table.local_seq_lens)
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(before, after))


@pytest.mark.parametrize("call, message", [
    (lambda t: t.append(0, -2), "whole number of tokens >= 0"),
    (lambda t: t.append(-1, 2), "request must be an int in \\[0, 2\\)"),
    (lambda t: t.append(True, 2), "request must be an int"),
    (lambda t: t.extend_batch([0, 1], [[1], []]), "empty token list"),
    (lambda t: t.extend_batch([0, 0], [[1], [2]]), "appears twice"),
    (lambda t: t.truncate(5, 0), "request must be an int"),
    (lambda t: t.extend_batch([0], [[5, -5]]), r"request 0's token id -5 is outside the vocabulary \[0, 100\)"),
    (lambda t: t.extend_batch([0, 1], [[1], [2, 10**12]]), r"request 1's token id 1000000000000 is outside the vocabulary"),
    (lambda t: t.extend_batch([0], [[1, 100]]), r"request 0's token id 100 is outside the vocabulary \[0, 100\)"),
    (lambda t: t.extend_batch([0], [[1, 2.0]]), r"request 0's token ids must be ints, got 2.0"),
    (lambda t: t.extend_batch([0], [[True]]), r"request 0's token ids must be ints, got True"),
])
def test_request_table_rejects_bad_calls_and_changes_nothing(call, message):
    table = RequestTable(2, 16, 64, vocab_size=100)
    with pytest.raises(ValueError, match=message):
        call(table)
    assert int(table.seq_lens.sum()) == 0 and len(table.free_pages) == 63


@pytest.mark.parametrize("length", [True, 2.0])
def test_truncate_takes_an_int_length(length):
    table = RequestTable(1, 16, 64)
    table.append(0, 3)
    with pytest.raises(ValueError, match=rf"a request is truncated to a whole number of tokens in \[0, 3\], got {length}"):
        table.truncate(0, length)
    assert int(table.seq_lens[0]) == 3 and table.req_to_token[0, :3].tolist() == [1, 2, 3]


def test_token_ids_are_not_checked_without_a_vocabulary():
    table = RequestTable(1, 16, 64)
    assert table.extend_batch([0], [[5, 10**6]]).input_ids.tolist() == [5, 10**6]
    assert RequestTable(1, 16, 64, vocab_size=10**6 + 1).extend_batch([0], [[0, 10**6]]).input_ids.tolist() == [0, 10**6]


@pytest.mark.parametrize("args, kwargs, message", [
    ((2, 32, -4), {}, r"capacity must be an int >= 2 \(location 0 is reserved\), got -4"),
    ((2, 32, 1), {}, r"capacity must be an int >= 2 \(location 0 is reserved\), got 1"),
    ((2, 32, 64.0), {}, r"capacity must be an int >= 2 \(location 0 is reserved\), got 64.0"),
    ((0, 32, 64), {}, r"max_requests must be an int >= 1, got 0"),
    ((True, 32, 64), {}, r"max_requests must be an int >= 1, got True"),
    ((2, 0, 64), {}, r"max_context must be an int >= 1, got 0"),
    ((2, 32.5, 64), {}, r"max_context must be an int >= 1, got 32.5"),
    ((2, 32, 64), dict(page_size=True), r"page_size must be an int >= 1, got True"),
    ((2, 32, 64), dict(dcp_size=2.0), r"dcp_size must be an int >= 1, got 2.0"),
    ((2, 32, 64), dict(interleave=False), r"interleave must be an int >= 1, got False"),
    ((2, 32, 64), dict(vocab_size=0), r"vocab_size must be an int >= 1, got 0"),
    ((2, 32, 64), dict(vocab_size=True), r"vocab_size must be an int >= 1, got True"),
])
def test_request_table_rejects_bad_sizes(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        RequestTable(*args, **kwargs)
