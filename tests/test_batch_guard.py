"""The default mode (no debug checks) never reads outside the KV pool and never serves a real
token as padding: page-table entries in use outside the pool (negative, 0, >= capacity), a
real row with seq_len 0, lengths wider than the page table and row ids out of range raise on
the CPU, at DCP 1 here and on every rank at DCP 2 (test_contract's spawn); on a device the same
batch is masked and flagged (sanitize_batch, checked here on CPU tensors)."""

from __future__ import annotations

import pytest
import torch

import dcp_compile
from dcp_compile.ops import reference
from dcp_compile.models.config import preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.runtime import guards
from dcp_compile.runtime.batch import RequestTable

CAPACITY = 128


@pytest.fixture(scope="module", params=[False, True], ids=["default", "debug-checks"])
def model(request):
    return dcp_compile.apply(MLAModel(preset("tiny"), kv_capacity=CAPACITY, max_requests=2), 1,
                             debug_checks=request.param)


def _batch():
    return RequestTable(2, 16, CAPACITY).extend_batch([0, 1], [[3, 4, 5], [6]], pad_rows=1)


@pytest.mark.parametrize("entry", [-3, 0, CAPACITY, CAPACITY + 7])
def test_a_page_table_entry_outside_the_pool_is_an_error(model, entry):
    batch = _batch()
    batch.req_to_token[0, 1] = entry
    error = ValueError if entry < 0 and model.dcp_state.config.debug_checks else IndexError
    with pytest.raises(error, match=rf"page-table entry \[0, 1\] is {entry}"):
        model(*batch.args())


def test_a_real_row_with_seq_len_zero_is_an_error(model):
    batch = _batch()
    batch.seq_lens[1] = 0  # its token still writes a real location
    with pytest.raises(ValueError, match="row 1 has seq_len 0 .* writes KV at location"):
        model(*batch.args())


def test_a_seq_len_wider_than_the_page_table_is_an_error(model):
    batch = _batch()
    batch.seq_lens[0] = batch.req_to_token.shape[1] + 1
    with pytest.raises(ValueError, match="seq_lens"):
        model(*batch.args())


def _kv(model) -> list[torch.Tensor]:
    pool = model.model.kv_pool
    return [pool.cache(layer).clone() for layer in range(pool.num_layers)]


def test_a_refused_batch_writes_no_kv(model):
    """A padded row whose token points at a live request's location is refused before the first
    layer's KV write: the victim's KV and its next logits are a clean run's."""
    table = RequestTable(2, 16, CAPACITY)
    model(*table.extend_batch([0], [[3, 4, 5]]).args())
    kv = _kv(model)
    bad = table.extend_batch([1], [[6]], pad_rows=1)
    bad.out_loc[1] = int(table.req_to_token[0, 1])  # the padded row writes request 0's second token
    with pytest.raises(ValueError, match="row 1 has seq_len 0"):
        model(*bad.args())
    assert all(torch.equal(before, after) for before, after in zip(kv, _kv(model)))
    table.truncate(1, 0)
    logits = model(*table.extend_batch([0], [[7]]).args())
    clean = dcp_compile.apply(MLAModel(preset("tiny"), kv_capacity=CAPACITY, max_requests=2), 1)
    clean_table = RequestTable(2, 16, CAPACITY)
    clean(*clean_table.extend_batch([0], [[3, 4, 5]]).args())
    torch.testing.assert_close(logits, clean(*clean_table.extend_batch([0], [[7]]).args()), rtol=0, atol=0)


def test_the_model_runs_on_after_a_rejected_batch(model):
    assert model(*_batch().args()).isfinite().all()


def test_on_a_device_the_batch_is_masked_and_each_error_flagged():
    table = torch.tensor([[5, -1, 7, 0], [9, 200, 0, 0], [0, 0, 0, 0]])
    seq_lens = torch.tensor([3, 2, 0])
    q_seq_ids = torch.tensor([0, 1, 2, 5])
    out_loc = torch.tensor([7, 0, 3, 0])
    safe_table, lens, ids, found = reference.sanitize_batch(table, seq_lens, q_seq_ids, out_loc, CAPACITY)
    assert safe_table.tolist() == [[5, 0, 7, 0], [9, 0, 0, 0], [0, 0, 0, 0]]
    assert lens.tolist() == [3, 2, 0] and ids.tolist() == [0, 1, 2, 2]
    assert found["page_table_entry"].nonzero().tolist() == [[0, 1], [1, 1]]
    assert found["row_id"].tolist() == [False, False, False, True]
    assert found["padded_row_write"].tolist() == [False, False, True, False]  # row 2 is padding, loc 3 is real
    assert not found["seq_len"].any()
    _, lens, _, found = reference.sanitize_batch(table, torch.tensor([-1, 9, 0]), q_seq_ids[:2], None, CAPACITY)
    assert lens.tolist() == [0, 4, 0] and found["seq_len"].tolist() == [True, True, False]


def test_flags_raise_every_error_they_hold():
    values = [0] * len(guards.ERRORS)
    guards.raise_for(values)  # nothing set: nothing raised
    values[guards.INDEX["page_table_entry"]] = values[guards.INDEX["padded_row_write"]] = 1
    with pytest.raises(IndexError, match="page-table entry in use outside the pool.*padded row"):
        guards.raise_for(values)
