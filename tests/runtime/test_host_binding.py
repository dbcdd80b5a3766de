"""Host metadata is bound to the batch it was built from: under the paged kernels (FIA's
stand-in on the emulated npu device, FlashInfer's CPU stand-in), a step given another step's host metadata, a copy with a
shortened local length, or a wrong block table is an error in the default mode (no debug
checks), caught on the host before anything runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dcp_compile
from dcp_compile.models.config import preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.runtime.batch import RequestTable
from dcp_compile.runtime.host_metadata import HostMetadata, StaleHostMetadataError

PAGE = 16
KERNELS = {"npu": ("tiny-512", torch.bfloat16, "npu_emulator"), "flashinfer": ("tiny", torch.float32, None)}


class Served:
    """A model under a paged lowering that has run a prefill, its request table, and its device."""

    def __init__(self, model, table, device):
        self.model, self.table, self.device = model, table, device
        self.prefill = self.batch([0, 1], [[1] * 5, [2] * 20])
        model(*self.prefill.args(), host_metadata=self.prefill.host)

    def batch(self, requests, tokens, table=None):
        """A step of `table` (this one's by default) on the model's device."""
        return (self.table if table is None else table).extend_batch(requests, tokens).to(self.device)

    def decode(self):
        return self.batch([0, 1], [[3], [4]])


@pytest.fixture(scope="module", params=sorted(KERNELS))
def served(request):
    name, dtype, device_fixture = KERNELS[request.param]
    device = request.getfixturevalue(device_fixture) if device_fixture else torch.device("cpu")
    model = dcp_compile.apply(MLAModel(preset(name), 1024, max_requests=2, dtype=dtype, page_size=PAGE, device=device),
                              1, kernels=request.param)
    return Served(model, RequestTable(2, 64, 1024, PAGE), device)


def test_the_right_metadata_runs(served):
    model = served.model
    batch = served.decode()
    assert torch.isfinite(model(*batch.args(), host_metadata=batch.host)).all()


def test_the_previous_steps_metadata_is_an_error(served):
    model, prefill = served.model, served.prefill
    batch = served.decode()
    with pytest.raises(StaleHostMetadataError, match="belongs to another batch"):
        model(*batch.args(), host_metadata=prefill.host)


def test_a_shortened_local_length_is_an_error(served):
    model = served.model
    batch = served.decode()
    lens = batch.host.local_seq_lens
    shortened = dataclasses.replace(batch.host, local_seq_lens=((lens[0][0] - 1,) + lens[0][1:],))
    with pytest.raises(StaleHostMetadataError, match="belongs to another batch"):
        model(*batch.args(), host_metadata=shortened)


def test_a_wrong_block_table_is_an_error(served):
    model = served.model
    batch = served.decode()
    swapped = dataclasses.replace(batch.host, block_tables=batch.host.block_tables.flip(1).contiguous())
    with pytest.raises(StaleHostMetadataError, match="belongs to another batch"):
        model(*batch.args(), host_metadata=swapped)
    batch = served.decode()
    batch.host.block_tables[0, 0, 0] += 1  # edited in place
    with pytest.raises(StaleHostMetadataError, match="block tables were changed in place"):
        model(*batch.args(), host_metadata=batch.host)


def test_a_block_table_edited_through_numpy_is_an_error(served):
    """numpy and .data writes do not bump a tensor's version: the tables' checksum sees them."""
    model = served.model
    batch = served.decode()
    batch.host.block_tables.numpy()[0, 0, 0] += 1
    with pytest.raises(StaleHostMetadataError, match="block tables were changed in place"):
        model(*batch.args(), host_metadata=batch.host)
    batch = served.decode()
    batch.host.block_tables.data[0, 1, 0] += 1
    with pytest.raises(StaleHostMetadataError, match="block tables were changed in place"):
        model(*batch.args(), host_metadata=batch.host)


@pytest.mark.parametrize("edit", ["in place", "numpy", ".data"])
def test_a_batch_edited_before_its_copy_to_the_device_is_an_error(served, edit):
    """ForwardBatch.to() binds the copies it makes to the metadata: only after checking that the
    batch it copies is still the one the metadata was built for."""
    cpu_batch = served.table.extend_batch([0, 1], [[3], [4]])
    lens = {"in place": cpu_batch.seq_lens, "numpy": cpu_batch.seq_lens.numpy(), ".data": cpu_batch.seq_lens.data}[edit]
    lens[0] -= 1
    with pytest.raises(StaleHostMetadataError, match="changed in place"):
        cpu_batch.to(served.device)
    with pytest.raises(StaleHostMetadataError, match="changed in place"):
        cpu_batch.padded(4, 1)


def test_a_replaced_batch_tensor_is_an_error(served):
    """A clone of the page table, edited, in place of the one the metadata was built from."""
    model = served.model
    batch = served.decode()
    args = list(batch.args())
    args[4] = batch.req_to_token.clone()
    args[4][0, 0] = args[4][1, 0]
    with pytest.raises(StaleHostMetadataError, match="req_to_token is not a tensor host_metadata was built for"):
        model(*args, host_metadata=batch.host)


def test_a_batch_tensor_edited_after_its_metadata_is_an_error(served):
    model = served.model
    batch = served.decode()
    batch.seq_lens[0] -= 1
    with pytest.raises(StaleHostMetadataError, match="changed in place"):
        model(*batch.args(), host_metadata=batch.host)


def test_metadata_made_by_hand_must_be_bound(served):
    model = served.model
    batch = served.decode()
    host = batch.host
    by_hand = HostMetadata(host.dcp_size, host.interleave, host.page_size, host.query_lens, host.local_seq_lens,
                           host.local_prefix_lens, host.block_tables)
    with pytest.raises(StaleHostMetadataError, match="belongs to another batch"):
        model(*batch.args(), host_metadata=by_hand)
    copies = [t.clone() for t in batch.args()]  # bound to no metadata
    with pytest.raises(StaleHostMetadataError, match="not built for this batch"):
        model(*copies, host_metadata=by_hand)
    assert torch.isfinite(model(*copies, host_metadata=by_hand.bind(*copies))).all()
    rebuilt = HostMetadata.from_tensors(batch.req_to_token.cpu(), batch.seq_lens.cpu(), batch.q_seq_ids.cpu(), 1, 1, PAGE)
    assert rebuilt.local_seq_lens == host.local_seq_lens and torch.equal(rebuilt.block_tables, host.block_tables)
    rebuilt.bind(*batch.args())
    assert torch.isfinite(model(*batch.args(), host_metadata=rebuilt)).all()


def test_a_block_table_past_the_pool_is_an_error_before_any_kernel_reads(served):
    model = served.model
    big = RequestTable(25, 64, 4096, PAGE)  # hands out locations past the model's 1024
    for request in range(25):
        big.append(request, 48)
    batch = served.batch([23, 24], [[1] * 3, [2] * 3], table=big)  # their pages lie past the pool
    assert batch.host.max_block >= 1024 // PAGE
    with pytest.raises(IndexError, match="name local block .* past the pool"):
        model(*batch.args(), host_metadata=batch.host)


def test_host_tables_shorter_than_a_length_are_an_error():
    host = RequestTable(1, 64, 1024, PAGE).extend_batch([0], [[1] * 20]).host
    with pytest.raises(ValueError, match="cover 64 local keys a row"):
        dataclasses.replace(host, local_seq_lens=((65,),))
