"""Owner/local math: property tests."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from dcp_compile.runtime import layout

sizes = st.sampled_from([1, 2, 3, 4, 8])
interleaves = st.sampled_from([1, 2, 4, 16, 64])


@given(dcp_size=sizes, interleave=interleaves, capacity=st.integers(2, 3000))
def test_every_location_has_one_owner_and_a_distinct_row(dcp_size, interleave, capacity):
    locs = torch.arange(capacity)
    owners = layout.owner(locs, dcp_size, interleave)
    rows = layout.local_row(locs, dcp_size, interleave)
    assert int(owners.min()) >= 0 and int(owners.max()) < dcp_size
    assert int(rows.max()) < layout.rows_per_rank(capacity, dcp_size, interleave)
    pairs = owners * (rows.max() + 1) + rows
    assert pairs.unique().numel() == capacity  # no two locations share a (rank, row)


@given(dcp_size=sizes, interleave=interleaves, loc=st.integers(0, 10**9))
def test_global_loc_inverts_owner_and_local_row(dcp_size, interleave, loc):
    rank = layout.owner(loc, dcp_size, interleave)
    row = layout.local_row(loc, dcp_size, interleave)
    assert layout.global_loc(row, rank, dcp_size, interleave) == loc


@given(dcp_size=sizes, interleave=interleaves, blocks=st.integers(1, 50), start_block=st.integers(0, 100))
def test_contiguous_allocation_is_balanced(dcp_size, interleave, blocks, start_block):
    stride = dcp_size * interleave
    locs = torch.arange(start_block * stride, (start_block + blocks) * stride)
    counts = torch.bincount(layout.owner(locs, dcp_size, interleave), minlength=dcp_size)
    assert counts.tolist() == [blocks * interleave] * dcp_size


@given(dcp_size=sizes, interleave=interleaves, rows=st.integers(1, 5000))
def test_logical_capacity_fits_in_rows(dcp_size, interleave, rows):
    capacity = layout.logical_capacity(rows, dcp_size, interleave)
    assert layout.rows_per_rank(capacity, dcp_size, interleave) <= rows
    assert rows - layout.rows_per_rank(capacity, dcp_size, interleave) < interleave
