"""Debug checks and the Triton KV writer's guard. (Page-table entries, padded rows and lengths in
both modes: tests/test_batch_guard.py.)"""

from __future__ import annotations

import pytest
import torch

import dcp_compile
from dcp_compile.models.config import preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.runtime.batch import RequestTable


@pytest.fixture(scope="module")
def model():
    return dcp_compile.apply(MLAModel(preset("tiny"), kv_capacity=128, max_requests=2), 1, debug_checks=True)


def _batch():
    table = RequestTable(2, 16, 128)
    return table.extend_batch([0, 1], [[3, 4, 5], [6]], pad_rows=1)


def test_a_valid_batch_still_runs(model):
    assert model(*_batch().args()).isfinite().all()


def test_the_triton_writer_drops_an_out_of_pool_location_and_the_step_fails():
    """Default mode (no debug checks), Triton kernels (on the GPU where there is one, else
    interpreted on CPU): location -1 used to overwrite the last row; now nothing is written, and
    the error surfaces (at once on CPU; on a GPU without a host sync, so by the next check)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = dcp_compile.apply(MLAModel(preset("tiny"), kv_capacity=128, max_requests=2, device=device), 1,
                              kernels="triton")
    batch = _batch().to(device)
    batch.out_loc[0] = -1
    caches = [model.dcp_state.kv_pool.cache(i).clone() for i in range(3)]
    with pytest.raises(IndexError, match="outside the pool"):
        model(*batch.args())
        model.check_errors()
    assert all(torch.equal(model.dcp_state.kv_pool.cache(i)[-1], caches[i][-1]) for i in range(3))
    assert model(*_batch().to(device).args()).isfinite().all()  # the flag was cleared; dcp_size 1 runs on
    model.check_errors()
