"""On an NPU the pool holds each layer as two contiguous tensors, latent [rows, 512] and rope
[rows, 64] (issue 18, defect 3): FIA takes them as `key` and `key_rope` without the whole-shard
copy a strided view of the packed row costs on every call (docs/ascend.md §11.1), which the
stand-in counts (standin.contiguous_copies). Runs on the emulated npu device."""

from __future__ import annotations

import os

import pytest
import torch

import dcp_compile
from dcp_compile.runtime.kv_pool import PACKED
from dcp_compile.testing import npu_standin as standin
from dcp_compile.models.mla import MLAModel
from dcp_compile.runtime import devices
from dcp_compile.runtime.batch import RequestTable
from tests.npu.models import TINY_512

os.environ.setdefault(devices.EMULATOR_ENV, "1")
devices.require_torch_npu("the NPU lowering's tests")

STEPS = [[[5] * 9, [6] * 20, [7]], [[1], [2], [3]], [[1, 2, 3], [4, 5, 6], [7, 8, 9]]]  # prefill, decode, verify


def _run(device: str, kernels: str):
    model = MLAModel(TINY_512, 2048, max_requests=4, dtype=torch.bfloat16, page_size=16, device=device)
    dcp = dcp_compile.apply(model, 1, kernels=kernels)
    table = RequestTable(4, 64, 2048, 16)
    for tokens in STEPS:
        batch = table.extend_batch([0, 1, 2], tokens, pad_rows=1, all_logits=len(tokens[0]) > 1)
        dcp(*batch.to(device).args(), host_metadata=batch.host)
    return model.kv_pool


def test_fia_reads_the_split_pool_without_a_copy_and_it_holds_the_same_kv():
    standin.contiguous_copies.clear()
    pool = _run("npu", "npu")
    assert standin.contiguous_copies == []  # FIA was handed contiguous key, value and key_rope
    assert pool.layout.name == "split"
    for layer in range(pool.num_layers):
        latent, rope = pool.parts(layer)
        assert latent.is_contiguous() and rope.is_contiguous() and latent.device.type == "npu"
        allocated = pool.rows_per_rank + pool.reserved_rows_per_rank  # the native write's reserved block
        assert pool.reserved_rows_per_rank == 16 and latent.shape == (allocated, 512) and rope.shape == (allocated, 64)
        assert pool.cache(layer).stride() == (0, 0)  # the canonical ops' cache holds no memory
    packed = _run("cpu", "torch")  # the same model and batches, packed rows, torch reference kernels
    assert packed.layout.packed
    for layer in range(pool.num_layers):
        rows, want = pool.rows(layer).cpu(), packed.rows(layer)
        assert torch.equal(rows.any(dim=1), want.any(dim=1))  # the same rows written
        assert rows.any(dim=1).sum() == 9 + 20 + 1 + 3 + 9
    # The first layer's KV comes from the embeddings alone: bit for bit. The later layers' take
    # the stand-in FIA's bf16 rounding, unlike the reference's.
    assert torch.equal(pool.rows(0).cpu(), packed.rows(0))


def test_a_write_through_the_split_layouts_cache_fails():
    model = MLAModel(TINY_512, 256, max_requests=2, dtype=torch.bfloat16, page_size=16, device="npu")
    dcp_compile.apply(model, 1, kernels="npu")
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        model.kv_pool.cache(0)[3] = 1.0
    with pytest.raises(RuntimeError, match="layout can change only before the first write"):
        model.kv_pool.parts(0)[0][3] = 1.0
        model.kv_pool.use_layout(PACKED)
