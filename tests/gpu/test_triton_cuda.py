"""The Triton kernels against the torch reference on CUDA, at Kimi-K2 / DeepSeek-V3 sizes.

R = 512, P = 64, bf16, 16 to 128 heads, contexts up to 32k, mixed with padded rows and empty
shards; a pool of more than 2^31 elements; and graph capture, which fails on any host sync.
Skipped where no CUDA device is present. Run on its own (`python -m pytest tests/gpu`): the
interpreter tests set TRITON_INTERPRET=1 for their process.
"""

from __future__ import annotations

import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from dcp_compile.lowering import triton as triton_kernels  # noqa: E402
from dcp_compile.ops import reference  # noqa: E402
from dcp_compile.lowering.triton import attention, merge, metadata_builder, pack  # noqa: E402
from dcp_compile.lowering.triton.attention_tiling import AttentionTiling, choose_tiling  # noqa: E402
from dcp_compile.lowering.triton.launching import is_interpreted  # noqa: E402
from dcp_compile.runtime import layout  # noqa: E402

if is_interpreted(attention._attend_splits_kernel):
    pytest.skip("TRITON_INTERPRET=1 is set in this process; run tests/gpu on its own", allow_module_level=True)

DEVICE = torch.device("cuda")
RANK_DIM, ROPE_DIM = 512, 64
SCALE = 1 / math.sqrt(RANK_DIM + ROPE_DIM)
# Padded rows, one-token requests (empty shards on other ranks), and long contexts.
LENGTHS = [32768, 0, 1, 4097, 12345, 777, 2, 16384]
# bf16 dots round the softmax weights to bf16; the LSE keeps fp32 scores on both sides.
BF16_OUT = dict(atol=1e-2, rtol=2e-2)
LSE = dict(atol=1e-3, rtol=1e-4)


def _generator(seed):
    return torch.Generator(device=DEVICE).manual_seed(seed)


def _assert_bitwise_equal(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    integer = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[actual.element_size()]
    assert torch.equal(actual.view(integer), expected.view(integer))


def _global_table(lengths, capacity, table_dtype, gen):
    """Distinct random locations per token, scattered over the whole pool; 0 past each length."""
    width = max(lengths)
    locations = torch.randperm(capacity - 1, generator=gen, device=DEVICE)[:sum(lengths)] + 1
    table = torch.zeros(len(lengths), width, dtype=torch.int64, device=DEVICE)
    offset = 0
    for b, n in enumerate(lengths):
        table[b, :n] = locations[offset:offset + n]
        offset += n
    return table.to(table_dtype), torch.tensor(lengths, dtype=torch.int64, device=DEVICE)


def _queries(lengths, per_request, heads, dtype, gen):
    ids, positions = [], []
    for b, n in enumerate(lengths):
        for p in (range(max(n - per_request, 0), n) if n else [0]):
            ids.append(b)
            positions.append(p)
    tokens = len(ids)
    # Slices of one gathered tensor, as the Q all-gather leaves them.
    gathered = torch.randn(tokens, heads, RANK_DIM + ROPE_DIM, generator=gen, device=DEVICE).to(dtype)
    return (gathered[..., :RANK_DIM], gathered[..., RANK_DIM:],
            torch.tensor(ids, device=DEVICE), torch.tensor(positions, device=DEVICE))


def _local_inputs(heads, dcp_size, rank, per_request, dtype=torch.bfloat16, table_dtype=torch.int32, seed=0,
                  interleave=1):
    gen = _generator(seed)
    capacity = 4 * sum(LENGTHS)
    table, seq_lens = _global_table(LENGTHS, capacity, table_dtype, gen)
    rows = layout.rows_per_rank(capacity, dcp_size, interleave)
    shard = torch.randn(rows, RANK_DIM + ROPE_DIM, generator=gen, device=DEVICE).to(dtype)
    local = reference.local_metadata(table, seq_lens, rank, dcp_size, interleave)
    q_latent, q_rope, q_ids, q_positions = _queries(LENGTHS, per_request, heads, dtype, gen)
    return (q_latent, q_rope, shard, *local, q_ids, q_positions)


def _check_attention(actual, expected, out_tolerance):
    (out, lse), (want_out, want_lse) = actual, expected
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.float(), want_out.float(), **out_tolerance)
    torch.testing.assert_close(lse, want_lse, **LSE)
    empty = torch.isneginf(want_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    assert not out[empty].any()


def _poisoned_attention(args, tiling=None):
    q_latent = args[0]
    out = torch.full(q_latent.shape, float("nan"), dtype=q_latent.dtype, device=DEVICE)
    lse = torch.full(q_latent.shape[:2], float("nan"), device=DEVICE)
    workspace = None
    if tiling is not None:
        tokens, heads, _ = q_latent.shape
        workspace = tuple(t.fill_(float("nan")) for t in attention.split_workspace(tokens, tiling.num_splits, heads, RANK_DIM, DEVICE))
    attention.partial_attention_into(*args, SCALE, out, lse, tiling=tiling, workspace=workspace)
    return out, lse


@pytest.mark.parametrize("heads", [16, 32, 64, 128])
@pytest.mark.parametrize("per_request", [1, 4], ids=["decode", "verify"])
def test_partial_attention_bf16_real_sizes(heads, per_request):
    args = _local_inputs(heads, dcp_size=2, rank=1, per_request=per_request, seed=heads + per_request)
    expected = reference.partial_attention(*args, SCALE)
    _check_attention(_poisoned_attention(args), expected, BF16_OUT)


@pytest.mark.parametrize("num_splits", [1, 7, 64])
def test_partial_attention_split_counts_agree(num_splits):
    args = _local_inputs(64, dcp_size=4, rank=2, per_request=1, table_dtype=torch.int64, seed=3, interleave=64)
    expected = reference.partial_attention(*args, SCALE)
    default = choose_tiling(args[0].shape[0], 64, args[3].shape[1], DEVICE, torch.bfloat16)
    tiling = AttentionTiling(num_splits, default.block_h, default.block_n, default.num_warps, default.num_stages)
    _check_attention(_poisoned_attention(args, tiling), expected, BF16_OUT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_partial_attention_other_dtypes(dtype):
    args = _local_inputs(16, dcp_size=2, rank=0, per_request=2, dtype=dtype, seed=5)
    expected = reference.partial_attention(*args, SCALE)
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else BF16_OUT
    _check_attention(_poisoned_attention(args), expected, tolerance)


@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dcp_size,interleave", [(1, 1), (2, 1), (4, 64)])
def test_local_metadata_real_sizes(table_dtype, dcp_size, interleave):
    table, seq_lens = _global_table(LENGTHS, 4 * sum(LENGTHS), table_dtype, _generator(11))
    for rank in range(dcp_size):
        expected = reference.local_metadata(table, seq_lens, rank, dcp_size, interleave)
        outputs = tuple(torch.full_like(t, -7777) for t in expected)
        metadata_builder.local_metadata_into(table, seq_lens, rank, dcp_size, interleave, *outputs)
        for actual, wanted in zip(outputs, expected):
            _assert_bitwise_equal(actual, wanted)


@pytest.mark.parametrize("source_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dcp_size,interleave", [(1, 1), (2, 1), (2, 64)])
def test_kv_write_real_sizes(source_dtype, dcp_size, interleave):
    gen = _generator(13)
    capacity, tokens = 1 << 20, 4096
    loc = torch.randperm(capacity - 1, generator=gen, device=DEVICE)[:tokens] + 1
    loc[::7] = layout.PADDING_LOC
    latent = torch.randn(tokens, RANK_DIM, generator=gen, device=DEVICE).to(source_dtype)
    rope = torch.randn(tokens, ROPE_DIM, generator=gen, device=DEVICE).to(source_dtype)
    for rank in range(dcp_size):
        cache = torch.randn(layout.rows_per_rank(capacity, dcp_size, interleave), RANK_DIM + ROPE_DIM,
                            generator=gen, device=DEVICE).to(torch.bfloat16)
        expected = cache.clone()
        reference.kv_write(expected, latent, rope, loc, rank, dcp_size, interleave)
        triton_kernels.kv_write(cache, latent, rope, loc, rank, dcp_size, interleave)
        _assert_bitwise_equal(cache, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pack_and_merge_real_sizes(dtype):
    gen = _generator(17)
    dcp_size, tokens, heads = 2, 64, 32
    outs, lses = [], []
    for _ in range(dcp_size):
        out = torch.randn(tokens, dcp_size * heads, RANK_DIM, generator=gen, device=DEVICE).to(dtype)
        lse = torch.randn(tokens, dcp_size * heads, generator=gen, device=DEVICE) * 4
        empty = torch.rand(tokens, dcp_size * heads, generator=gen, device=DEVICE) < 0.2
        lse[empty] = float("-inf")
        out[empty] = float("nan")
        outs.append(out)
        lses.append(lse)
    sent = []
    for out, lse in zip(outs, lses):
        expected = reference.pack_partials(out, lse, dcp_size)
        packed = torch.full_like(expected, float("nan"))
        pack.pack_partials_into(out, lse, dcp_size, packed)
        _assert_bitwise_equal(packed, expected)
        sent.append(packed)
    for rank in range(dcp_size):
        received = torch.stack([sent[peer][rank] for peer in range(dcp_size)])
        expected = reference.merge_partials(received, RANK_DIM)
        merged = torch.full_like(expected, float("nan"))
        merge.merge_partials_into(received, RANK_DIM, merged)
        torch.testing.assert_close(merged, expected, atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)


def test_pool_of_more_than_2_to_the_31_elements():
    """Rows past element 2^31 are written and read at their true address (no 32-bit wrap)."""
    rows = (1 << 31) // (RANK_DIM + ROPE_DIM) + 8192
    assert rows * (RANK_DIM + ROPE_DIM) > 1 << 31
    cache = torch.zeros(rows, RANK_DIM + ROPE_DIM, dtype=torch.bfloat16, device=DEVICE)
    gen = _generator(19)
    dcp_size, tokens, heads = 2, 6000, 64
    capacity = layout.logical_capacity(rows, dcp_size)
    # The last locations of the pool: on rank 1 they are its last rows.
    loc = torch.arange(capacity - 2 * tokens, capacity, device=DEVICE)
    latent = torch.randn(loc.numel(), RANK_DIM, generator=gen, device=DEVICE).to(torch.bfloat16)
    rope = torch.randn(loc.numel(), ROPE_DIM, generator=gen, device=DEVICE).to(torch.bfloat16)
    triton_kernels.kv_write(cache, latent, rope, loc, 1, dcp_size, 1)
    owned = layout.owner(loc, dcp_size) == 1
    written_rows = layout.local_row(loc[owned], dcp_size)
    assert int(written_rows.max()) == rows - 1
    assert torch.equal(cache[written_rows], torch.cat([latent[owned], rope[owned]], dim=-1))

    table = loc.flip(0).view(2, tokens)  # two requests over the last locations, in reverse
    seq_lens = torch.tensor([tokens, tokens - 5], device=DEVICE)
    local = triton_kernels.local_metadata(table, seq_lens, 1, dcp_size, 1)
    for actual, wanted in zip(local, reference.local_metadata(table, seq_lens, 1, dcp_size, 1)):
        _assert_bitwise_equal(actual, wanted)
    q_latent = torch.randn(2, heads, RANK_DIM, generator=gen, device=DEVICE).to(torch.bfloat16)
    q_rope = torch.randn(2, heads, ROPE_DIM, generator=gen, device=DEVICE).to(torch.bfloat16)
    args = (q_latent, q_rope, cache, *local, torch.tensor([0, 1], device=DEVICE),
            torch.tensor([tokens - 1, tokens - 6], device=DEVICE))
    actual = triton_kernels.partial_attention(*args, SCALE)
    torch.cuda.synchronize()
    _check_attention(actual, reference.partial_attention(*args, SCALE), BF16_OUT)


def test_metadata_and_attention_capture_in_a_cuda_graph():
    """Capture fails on a host sync; replay after refreshing inputs in place follows the new values."""
    heads, dcp_size, rank = 32, 2, 0
    args = _local_inputs(heads, dcp_size, rank, per_request=1, seed=23)
    q_latent, q_rope, shard, _, _, _, q_ids, q_positions = args
    table, seq_lens = _global_table(LENGTHS, 4 * sum(LENGTHS), torch.int32, _generator(29))
    static_local = tuple(torch.empty_like(t) for t in reference.local_metadata(table, seq_lens, rank, dcp_size, 1))
    out = torch.empty(q_latent.shape, dtype=q_latent.dtype, device=DEVICE)
    lse = torch.empty(q_latent.shape[:2], device=DEVICE)

    def step():
        metadata_builder.local_metadata_into(table, seq_lens, rank, dcp_size, 1, *static_local)
        attention.partial_attention_into(q_latent, q_rope, shard, *static_local, q_ids, q_positions, SCALE, out, lse)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    # Shorter requests and earlier query positions, written in place.
    seq_lens.copy_((seq_lens * 3) // 4)
    q_positions.copy_(torch.clamp(seq_lens[q_ids] - 1, min=0))
    graph.replay()
    torch.cuda.synchronize()
    local = reference.local_metadata(table, seq_lens, rank, dcp_size, 1)
    for actual, wanted in zip(static_local, local):
        _assert_bitwise_equal(actual, wanted)
    expected = reference.partial_attention(q_latent, q_rope, shard, *local, q_ids, q_positions, SCALE)
    _check_attention((out, lse), expected, BF16_OUT)
