"""The batch guard on a device (the emulated npu): nothing raises inside a step, so the guard
masks what it found and flags it, and a padded row's token that points at a live location
writes location 0 instead (the CPU refuses the batch before any write: tests/test_batch_guard.py)."""

from __future__ import annotations

import torch

from dcp_compile.ops import reference
from dcp_compile.runtime import guards

CAPACITY = 128


def test_a_padded_rows_write_is_sent_to_location_zero_and_flagged():
    device = torch.device("npu", 0)
    table = torch.tensor([[5, 6, 7, 0], [0, 0, 0, 0]], device=device)
    seq_lens = torch.tensor([3, 0], device=device)
    q_seq_ids = torch.tensor([0, 1], device=device)
    out_loc = torch.tensor([7, 6], device=device)  # row 1 is padding, yet its token writes request 0's location 6
    guards.error_flags(device).zero_()
    _, lens, ids, loc = reference.guard_batch(table, seq_lens, q_seq_ids, out_loc, CAPACITY)
    assert loc.device == device and loc.tolist() == [7, 0]
    assert lens.tolist() == [3, 0] and ids.tolist() == [0, 1]
    flags = guards.error_flags(device).tolist()
    assert flags[guards.INDEX["padded_row_write"]] == 1 and sum(flags) == 1
    guards.error_flags(device).zero_()
