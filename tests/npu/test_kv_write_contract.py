"""Hardware bring-up defects of the native NPU KV write (npu_kernels='native') and its neighbours,
where the emulator agreed with the code because both encoded one reading of the vendor's ops; each
with a test on the emulated npu device that failed before its fix (docs/ascend.md §17, §19):

1. int64 slots: the 2025 A2/A3 ND kernel of npu_scatter_pa_kv_cache reads slot_mapping as int32
   (token i reads the i-th 32-bit word: KV in wrong slots, no error). The lowering hands it int32.
2. Negative slots are outside the op's contract (slots lie in [0, blocks x block - 1]; an A5 ND
   kernel writes slot -1 before the cache). Tokens another rank owns and padded rows write the
   pool's reserved block, past the locations' rows, which no location maps to and no read sees.
3. The A2/A3 tiling refuses a write of more tokens than the cache has slots. The write is split
   into calls of at most that many tokens (static slices: no host sync, graph-capturable).
4. npu_attention_update(update_type=0) leaves its second output undefined. The lowering never
   reads it; the stand-in returns NaN there.
5. inner_compile='torchair' captures its own NPU graph: under the runtime's capture (GraphRunner,
   capture_decode_graphs) that is a nested capture, refused.

DCP 2 (tokens other ranks own, under graph replay): tests/distributed/test_npu_lowering.py.
"""

from __future__ import annotations

import math

import pytest
import torch

import dcp_compile
from dcp_compile.lowering.npu import ensure_ops, inner_compile, native_ops
from dcp_compile.lowering.npu.lower_attention import attention_update_op
from dcp_compile.ops import nz, reference
from dcp_compile.runtime import layout
from dcp_compile.runtime.graph_runner import GraphRunner, NPUGraphs
from dcp_compile.testing.npu_emulator.module import CANN_ENV, SOC_ENV
from tests.npu.test_defects import PAGE, Replayed, npu_model
from tests.npu.test_native_lowering import FORMATS, lowered

ensure_ops()
NPU = "npu"
R, P = 512, 64
SCATTER = torch.ops.npu.npu_scatter_pa_kv_cache


def _nd_caches(blocks: int, block: int, dtype=torch.bfloat16):
    return (torch.zeros(blocks, block, 1, R, dtype=dtype, device=NPU),
            torch.zeros(blocks, block, 1, P, dtype=dtype, device=NPU))


def _tokens(count: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(count, 1, R, generator=generator).bfloat16().to(NPU),
            torch.randn(count, 1, P, generator=generator).bfloat16().to(NPU))


def _pool_parts(rows: int, block: int, kv_format: str):
    """A layer's two parts as the native layout holds them: the locations' rows, then the reserved block."""
    parts = [torch.zeros(rows + block, dim, dtype=torch.bfloat16) for dim in (R, P)]
    if kv_format == "nz":
        parts = [nz.from_rows(part, block) for part in parts]
    return parts


def _rows_of(part: torch.Tensor) -> torch.Tensor:
    return nz.to_rows(part) if nz.is_nz(part) else part


# --- 1. int32 slots ----------------------------------------------------------------------------


def test_the_2025_a2_a3_nd_kernel_takes_int32_slots_only(monkeypatch):
    """Before: the stand-in took int64 slots on every CANN (DID NOT RAISE)."""
    key, value = _tokens(3)
    slots = torch.tensor([5, 0, 17])
    monkeypatch.setenv(SOC_ENV, "Ascend910_9391")  # an A3
    monkeypatch.setenv(CANN_ENV, "8.5.0")  # SGLang's A2/A3 image: the 2025 kernels
    with pytest.raises(ValueError, match="reads slot_mapping as int32"):
        SCATTER(key, value, *_nd_caches(2, 16), slots.to(NPU), cache_mode="Norm")
    caches = _nd_caches(2, 16)
    SCATTER(key, value, *caches, slots.to(torch.int32).to(NPU), cache_mode="Norm")
    assert torch.equal(caches[0].cpu().view(32, R)[slots], key.cpu().view(3, R))
    monkeypatch.setenv(CANN_ENV, "9.0.0")  # the 2026 kernels template on the slot dtype
    SCATTER(key, value, *_nd_caches(2, 16), slots.to(NPU), cache_mode="Norm")


CASES = [(dict(mode="decode"), FORMATS[0], 2), (dict(mode="verify", draft_len=7, npu_verify="mask"), FORMATS[1], 2),
         (dict(mode="extend", chunk=64), FORMATS[0], 1)]


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case[0]['mode']}-{case[1]['npu_kv_format']}-dcp{case[2]}")
def test_the_native_lowering_hands_the_kv_write_int32_slots_and_fia_int32_block_tables(case):
    """Before: `slot_mapping` gave int64 slots (the dtype of the locations)."""
    mode, options, dcp_size = case
    gm = lowered(mode, options, dcp_size)
    writes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is native_ops.SCATTER_KV_CACHE]
    assert writes and all(write.args[3].meta["val"].dtype == torch.int32 for write in writes)
    fia = [n for n in gm.graph.nodes if n.op == "call_function" and "npu_fused_infer_attention_score" in str(n.target)]
    assert fia and all(call.kwargs["block_table"].meta["val"].dtype == torch.int32 for call in fia)


# --- 2. No negative slot -----------------------------------------------------------------------


def test_a_negative_slot_is_refused():
    """Before: the stand-in skipped slot -1, as the op-plugin test's golden does (DID NOT RAISE)."""
    key, value = _tokens(2)
    with pytest.raises(ValueError, match=r"slot -1 is negative"):
        SCATTER(key, value, *_nd_caches(2, 16), torch.tensor([3, -1], dtype=torch.int32, device=NPU), cache_mode="Norm")


@pytest.mark.parametrize("kv_format", ["nd", "nz"])
def test_tokens_this_rank_does_not_keep_write_only_the_reserved_row(kv_format):
    """Rank 0 of 2: locations 0 (padding), 1 and 3 (rank 1's) go to the reserved row, the first row
    past the locations' rows; 2 and 130 to their local rows 1 and 65. Before: slot -1, int64."""
    block, rows = 128, 256
    loc = torch.tensor([0, 1, 2, 3, 130])
    slots = native_ops.SLOT_MAPPING(loc.to(NPU), rows, 0, 2, 1)
    assert slots.dtype == torch.int32 and slots.cpu().tolist() == [rows, rows, 1, rows, 65]
    latent, rope = (t.view(loc.shape[0], -1) for t in _tokens(loc.shape[0], seed=1))
    parts = [part.to(NPU) for part in _pool_parts(rows, block, kv_format)]
    native_ops.SCATTER_KV_CACHE(parts[0], latent, rope, slots, block, parts[1])
    for part, source in zip(parts, (latent, rope)):
        written = _rows_of(part.cpu())
        assert torch.equal(written[[1, 65]], source.cpu()[[2, 4]])
        untouched = torch.ones(rows, dtype=torch.bool)
        untouched[[1, 65]] = False
        assert not written[:rows][untouched].any()  # no location's row but the two owned ones


def test_the_npu_pool_reserves_a_block_that_no_location_maps_to_and_reports_it():
    """Before: the parts held the locations' rows only, and the report said nothing reserved."""
    model = npu_model()
    state = dcp_compile.state(model)
    pool = state.kv_pool
    latent, rope = pool.parts(0)
    assert latent.shape == (pool.rows_per_rank + PAGE, R) and rope.shape == (pool.rows_per_rank + PAGE, P)
    assert pool.rows(0).shape == (pool.rows_per_rank, R + P)  # what the locations hold
    assert layout.logical_capacity(pool.rows_per_rank, 1) == pool.capacity  # no location maps past them
    report = pool.report()
    assert report.reserved_rows_per_rank == PAGE
    assert report.bytes_per_rank == (pool.rows_per_rank + PAGE) * (R + P) * 2 * pool.num_layers
    assert report.rows_lost == PAGE + pool.page_size  # the reserved block, and the page of location 0


def test_replayed_steps_write_padding_to_the_reserved_row_and_never_read_it():
    """Decode steps replayed from NPU graphs, padded to the bucket (padded rows write location 0),
    give the eager logits; the reserved rows, poisoned with NaN, are never read. Before: the
    capture's fully padded batch handed npu_scatter_pa_kv_cache slot -1 ("slot -1 is negative")."""
    replayed = Replayed(runner_debug=False)
    for model in (replayed.model, replayed.eager):
        pool = dcp_compile.state(model).kv_pool
        for layer in range(pool.num_layers):
            for part in pool.parts(layer):
                part[pool.rows_per_rank:] = math.nan
    for step, requests in enumerate([[0, 1, 2], [1, 3], [0, 1, 2]]):
        tokens = [[40 + step + r] for r in requests]
        out = replayed.runner(replayed.batch(requests, tokens))
        expected = replayed.expected(requests, tokens)
        assert torch.isfinite(out.cpu()).all() and torch.equal(out.cpu(), expected.cpu()), f"step {step}"
    pool = dcp_compile.state(replayed.model).kv_pool
    for layer in range(pool.num_layers):  # the last step's padded row wrote its KV there
        assert all(torch.isfinite(part[pool.rows_per_rank].cpu()).all() for part in pool.parts(layer))


# --- 3. At most the cache's slots per call ---------------------------------------------------------


def test_the_a2_a3_tiling_refuses_more_tokens_than_the_cache_has_slots():
    """`numBlocks * blockSize should larger than numTokens` (ops-transformer scatter_pa_kv_cache_tiling.cpp).
    Before: the stand-in wrote them (DID NOT RAISE)."""
    key, value = _tokens(33)
    slots = torch.arange(33, dtype=torch.int32) % 32
    with pytest.raises(ValueError, match=r"numBlocks \* blockSize should larger than numTokens"):
        SCATTER(key, value, *_nd_caches(2, 16), slots.to(NPU), cache_mode="Norm")


@pytest.mark.parametrize("kv_format", ["nd", "nz"])
def test_a_write_of_more_tokens_than_the_local_cache_holds_lands_every_owned_token(kv_format):
    """A long chunk on a small shard: 600 tokens (every location of the pool, and padding), each rank
    of 4 holding 128 rows (+ the reserved block of 128). Before (with the stand-in's tiling check): "numBlocks * blockSize should larger
    than numTokens"."""
    block, rows, dcp_size = 128, 128, 4
    generator = torch.Generator().manual_seed(3)
    loc = torch.cat([torch.arange(1, rows * dcp_size), torch.zeros(89, dtype=torch.int64)])  # + padded tokens
    loc = loc[torch.randperm(loc.shape[0], generator=generator)]
    latent, rope = (t.view(loc.shape[0], -1) for t in _tokens(loc.shape[0], seed=2))
    for rank in range(dcp_size):
        want = [torch.zeros(rows, dim, dtype=torch.bfloat16) for dim in (R, P)]
        reference.kv_write(want[0], latent.cpu(), rope.cpu(), loc, rank, dcp_size, 1, rope_cache=want[1])
        parts = [part.to(NPU) for part in _pool_parts(rows, block, kv_format)]
        slots = native_ops.SLOT_MAPPING(loc.to(NPU), rows, rank, dcp_size, 1)
        native_ops.SCATTER_KV_CACHE(parts[0], latent, rope, slots, block, parts[1])
        assert all(torch.equal(_rows_of(part.cpu())[:rows], w) for part, w in zip(parts, want))


# --- 4. npu_attention_update's second output ---------------------------------------------------------


def test_attention_update_type_0_leaves_its_second_output_undefined():
    """op-plugin AttentionUpdateKernelNpuOpApi.cpp makes lse_out for update_type 1 only. Before: the
    stand-in filled it with the merged lse."""
    lses = [torch.randn(6).to(NPU) for _ in range(2)]
    outs = [torch.randn(6, 16).to(NPU) for _ in range(2)]
    _, lse_out = attention_update_op()(lses, outs, 0)
    assert lse_out.shape == (6,) and torch.isnan(lse_out.cpu()).all()
    assert torch.isfinite(attention_update_op()(lses, outs, 1)[1].cpu()).all()


def test_the_lowered_merge_reads_only_the_merged_output():
    gm = lowered(dict(mode="decode"), FORMATS[0], 2)
    updates = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is attention_update_op()]
    assert updates
    for update in updates:
        assert update.args[2] == 0 and {user.args[1] for user in update.users} == {0}


# --- 5. torchair under the runtime's NPU graphs ---------------------------------------------------


def test_device_graphs_over_a_torchair_model_are_refused(monkeypatch):
    """Before: GraphRunner captured a model whose graphs torchair captures itself (nested captures)."""
    monkeypatch.setattr(inner_compile, "torchair_compiler", lambda mode: lambda gm, example_inputs: gm.forward)
    monkeypatch.setattr(inner_compile, "torchair_missing", lambda mode: None)
    model = npu_model(inner_compile="torchair")
    state = dcp_compile.state(model)
    from tests.npu.test_defects import new_table, prefill

    table = new_table()
    prefill(model, table)
    runner = GraphRunner(model.compiled("gather-q"), buckets=(4,), graphs=NPUGraphs(), host_slot=state.host_slot)
    with pytest.raises(RuntimeError, match="inner_compile='torchair' captures its own NPU graph"):
        runner(table.extend_batch([0, 1, 2], [[1], [2], [3]]))
    batch = table.extend_batch([0, 1, 2], [[4], [5], [6]])  # refused up front: the model still serves its steps
    assert torch.isfinite(model(*batch.to(NPU).args(), host_metadata=batch.host).cpu()).all()
