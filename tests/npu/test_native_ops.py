"""The native NPU ops (lowering/npu/native_ops.py, npu_kernels='native') against the torch
reference, on the emulated npu device: the KV write through npu_scatter_pa_kv_cache (ND and NZ),
the slot mapping, window attention over the step's own tokens, key counts and the rank-local
causal mask, dense attention for long chunks, and the guard without the page table. Mixed
lengths, empty shards and padded rows throughout."""

from __future__ import annotations

import pytest
import torch

from dcp_compile.lowering.npu import ensure_ops, native_ops
from dcp_compile.lowering.npu import ops as npu_ops
from dcp_compile.ops import nz, reference
from dcp_compile.runtime import guards, layout

ensure_ops()
NPU = "npu"
R, P = 512, 64


def _batch(query_lens, prefix_lens, dcp_size, interleave, page, seed=0):
    """A page-aligned batch: row b has prefix_lens[b] cached tokens and query_lens[b] new ones
    (0 new: a padded row, seq_len 0). Returns (req_to_token, seq_lens, q_seq_ids, q_positions, out_loc)."""
    generator = torch.Generator().manual_seed(seed)
    rows = len(query_lens)
    width = max(p + q for p, q in zip(prefix_lens, query_lens)) + 1
    pages_per_row = -(-width // page)
    order = torch.randperm(rows * pages_per_row, generator=generator) + 1  # page 0 is reserved
    req_to_token = torch.zeros(rows, width, dtype=torch.int64)
    ids, positions, out_loc, seq_lens = [], [], [], []
    for b, (prefix, count) in enumerate(zip(prefix_lens, query_lens)):
        pages = order[b * pages_per_row:(b + 1) * pages_per_row]
        column = torch.arange(width)
        req_to_token[b] = pages[column // page] * page + column % page
        length = prefix + count if count else 0
        seq_lens.append(length)
        for position in range(prefix, prefix + max(count, 1)):
            ids.append(b)
            positions.append(position if count else 0)
            out_loc.append(int(req_to_token[b, position]) if count else 0)
    return (req_to_token, torch.tensor(seq_lens), torch.tensor(ids), torch.tensor(positions), torch.tensor(out_loc))


@pytest.mark.parametrize("dcp_size, interleave", [(1, 1), (2, 1), (4, 1), (2, 16)])
def test_slot_mapping_is_the_local_row_of_owned_locations(dcp_size, interleave):
    """int32 slots: the local row of an owned location, else the reserved row `rows` (never -1)."""
    loc = torch.tensor([0, 1, 2, 3, 17, 31, 32, 33, 64, 127])
    rows = 128 // dcp_size
    for rank in range(dcp_size):
        slots = native_ops.SLOT_MAPPING(loc.to(NPU), rows, rank, dcp_size, interleave).cpu()
        owned = (layout.owner(loc, dcp_size, interleave) == rank) & (loc != 0)
        expected = torch.where(owned, layout.local_row(loc, dcp_size, interleave), rows).int()
        assert slots.dtype == torch.int32 and torch.equal(slots, expected)
    assert sum(int((native_ops.SLOT_MAPPING(loc, rows, r, dcp_size, interleave) < rows).sum()) for r in range(dcp_size)) \
        == int((loc != 0).sum())  # every real location has exactly one owner


def test_slot_mapping_sends_a_location_outside_the_pool_to_the_reserved_row_and_flags_it():
    flags = guards.error_flags(torch.device(NPU, 0))
    flags.zero_()
    slots = native_ops.SLOT_MAPPING(torch.tensor([5, 400, -3], device=NPU), 64, 1, 2, 1).cpu()
    assert slots.tolist() == [2, 64, 64]
    assert int(flags[guards.INDEX["write_location"]].cpu()) == 1
    flags.zero_()
    with pytest.raises(IndexError, match="outside the pool"):
        native_ops.SLOT_MAPPING(torch.tensor([5, 400]), 64, 1, 2, 1)


def _parts(rows: int, block: int, kv_format: str, fill: float = 0.0):
    """A layer's parts as the native layout holds them: the locations' rows and the reserved block."""
    parts = [torch.full((rows + block, dim), fill, dtype=torch.bfloat16) for dim in (R, P)]
    return [nz.from_rows(part, block) for part in parts] if kv_format == "nz" else parts


def _location_rows(part: torch.Tensor, rows: int) -> torch.Tensor:
    return (nz.to_rows(part) if nz.is_nz(part) else part)[:rows]


@pytest.mark.parametrize("kv_format", ["nd", "nz"])
@pytest.mark.parametrize("dcp_size", [1, 2])
def test_native_kv_write_equals_the_reference_writer(kv_format, dcp_size):
    generator = torch.Generator().manual_seed(1)
    block, rows = 128, 512
    loc = torch.tensor([0, 3, 130, 131, 257, 0, 300, 501])
    latent = torch.randn(loc.shape[0], R, generator=generator).bfloat16()
    rope = torch.randn(loc.shape[0], P, generator=generator).bfloat16()
    for rank in range(dcp_size):
        expected_latent, expected_rope = torch.zeros(rows, R, dtype=torch.bfloat16), torch.zeros(rows, P, dtype=torch.bfloat16)
        reference.kv_write(expected_latent, latent, rope, loc, rank, dcp_size, 1, rope_cache=expected_rope)
        cache_latent, cache_rope = (part.to(NPU) for part in _parts(rows, block, kv_format))
        slots = native_ops.SLOT_MAPPING(loc.to(NPU), rows, rank, dcp_size, 1)
        native_ops.SCATTER_KV_CACHE(cache_latent, latent.to(NPU), rope.to(NPU), slots, block, cache_rope)
        assert torch.equal(_location_rows(cache_latent.cpu(), rows), expected_latent)
        assert torch.equal(_location_rows(cache_rope.cpu(), rows), expected_rope)
        assert int(expected_latent.count_nonzero()) > 0  # each rank owns some of the locations


@pytest.mark.parametrize("dcp_size", [1, 2, 4])
def test_step_window_equals_window_attention_over_the_page_table(dcp_size):
    """Verify rows of 7, 3, 1 and 0 (padded) queries over prefixes of 0 (every key in the window),
    5 and 40 keys; each rank completes its prefix result from the step's own tokens exactly as the
    page-table window kernel does from the cache."""
    generator = torch.Generator().manual_seed(2)
    page, heads, scale = 16 * dcp_size, 4, 0.07
    table, seq_lens, ids, positions, out_loc = _batch([7, 3, 1, 0, 7], [0, 5, 40, 0, 13], dcp_size, 1, page)
    tokens = ids.shape[0]
    latent = torch.randn(tokens, R, generator=generator).bfloat16()
    rope = torch.randn(tokens, P, generator=generator).bfloat16()
    q_latent = torch.randn(tokens, heads, R, generator=generator).bfloat16()
    q_rope = torch.randn(tokens, heads, P, generator=generator).bfloat16()
    out_prefix = torch.randn(tokens, heads, R, generator=generator).bfloat16()
    lse_prefix = torch.randn(tokens, heads, generator=generator)
    lse_prefix[ids == 3] = float("-inf")
    rows_per_rank = 4096
    for rank in range(dcp_size):
        cache = torch.zeros(rows_per_rank, R + P, dtype=torch.bfloat16)
        reference.kv_write(cache, latent, rope, out_loc, rank, dcp_size, 1)
        local_table, local_lens, key_positions = reference.local_metadata(table, seq_lens, rank, dcp_size, 1)
        expected = reference.window_attention(out_prefix, lse_prefix, q_latent, q_rope, cache, local_table, local_lens,
                                              key_positions, ids, positions, scale, 16)
        slots = native_ops.SLOT_MAPPING(out_loc.to(NPU), rows_per_rank, rank, dcp_size, 1)
        got = native_ops.STEP_WINDOW(*(t.to(NPU) for t in (out_prefix, lse_prefix, q_latent, q_rope, latent, rope)),
                                     slots, rows_per_rank, ids.to(NPU), positions.to(NPU), scale, 16)
        torch.testing.assert_close(got[0].cpu().float(), expected[0].float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got[1].cpu(), expected[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dcp_size", [1, 2, 4])
def test_key_counts_and_mask_equal_the_page_table_versions(dcp_size):
    page = 16 * dcp_size
    table, seq_lens, ids, positions, out_loc = _batch([4, 4, 4, 4], [0, 3, 29, 1], dcp_size, 1, page)
    rows = seq_lens.shape[0]
    width = 256
    for rank in range(dcp_size):
        _, local_lens, key_positions = reference.local_metadata(table, seq_lens, rank, dcp_size, 1)
        first = reference.first_query_positions(ids, positions, rows)
        valid = torch.arange(table.shape[1])[None, :] < local_lens[:, None]
        prefix = (valid & (key_positions < first[:, None])).sum(dim=1)
        slots = native_ops.SLOT_MAPPING(out_loc.to(NPU), 4096, rank, dcp_size, 1)
        counts = native_ops.STEP_KEY_COUNTS(prefix.to(NPU), slots, 4096, ids.to(NPU), positions.to(NPU), 16)
        expected_mask, expected_visible = npu_ops.rank_causal_mask(key_positions, local_lens, positions, width)
        assert torch.equal(counts.cpu(), expected_visible)
        assert torch.equal(native_ops.STEP_CAUSAL_MASK(counts, rows, width).cpu(), expected_mask)
        decode_counts = native_ops.STEP_KEY_COUNTS(prefix.to(NPU), slots, 4096, ids.to(NPU), positions.to(NPU), 1)
        prefix_of_token = prefix[ids]
        assert torch.equal(decode_counts.cpu(), prefix_of_token + (slots.cpu() < 4096).long())


def test_dense_partial_attention_equals_the_reference():
    generator = torch.Generator().manual_seed(3)
    table, seq_lens, ids, positions, out_loc = _batch([20, 1, 0, 33], [5, 0, 0, 60], 1, 1, 16)
    tokens, heads = ids.shape[0], 4
    cache = torch.randn(4096, R + P, generator=generator).bfloat16()
    q_latent = torch.randn(tokens, heads, R, generator=generator).bfloat16()
    q_rope = torch.randn(tokens, heads, P, generator=generator).bfloat16()
    key_positions = reference.global_positions(table)
    expected = reference.partial_attention(q_latent, q_rope, cache, table, seq_lens, key_positions, ids, positions, 0.05)
    got = native_ops.PARTIAL_ATTENTION(*(t.to(NPU) for t in (q_latent, q_rope, cache, table, seq_lens, key_positions, ids,
                                                             positions)), 0.05)
    torch.testing.assert_close(got[0].cpu().float(), expected[0].float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[1].cpu(), expected[1], atol=1e-4, rtol=1e-4)
    assert torch.isinf(got[1].cpu()[ids == 2]).all()  # the padded row sees no key


def test_guard_tokens_equals_guard_batch_and_flags_alike():
    table, seq_lens, ids, positions, out_loc = _batch([2, 0, 1], [3, 0, 4], 2, 1, 32)
    bad_loc = out_loc.clone()
    bad_loc[ids == 1] = 77  # a padded row's token writing KV
    flags = guards.error_flags(torch.device(NPU, 0))
    flags.zero_()
    _, lens, checked_ids, loc = torch.ops.dcp.guard_batch(table.to(NPU), seq_lens.to(NPU), ids.to(NPU), bad_loc.to(NPU),
                                                          4096)
    expected_flags = flags.cpu().clone()
    flags.zero_()
    got = native_ops.GUARD_TOKENS(seq_lens.to(NPU), ids.to(NPU), bad_loc.to(NPU), table.shape[1])
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got, (lens, checked_ids, loc)))
    assert torch.equal(flags.cpu(), expected_flags) and int(flags[guards.INDEX["padded_row_write"]].cpu()) == 1
    flags.zero_()
    with pytest.raises(ValueError, match="padded row"):
        native_ops.GUARD_TOKENS(seq_lens, ids, bad_loc, table.shape[1])


@pytest.mark.parametrize("kv_format", ["nd", "nz"])
def test_a_kv_write_of_tokens_this_rank_does_not_own_writes_no_location_row(kv_format):
    """Every slot the reserved row (a step whose tokens all live on other ranks, or padding only)."""
    block, rows = 128, 256
    latent_part, rope_part = _parts(rows, block, kv_format, fill=1.0)
    cache_latent, cache_rope = latent_part.to(NPU), rope_part.to(NPU)
    slots = native_ops.SLOT_MAPPING(torch.tensor([0, 1, 3], device=NPU), rows, 0, 2, 1)
    assert slots.cpu().tolist() == [rows] * 3
    native_ops.SCATTER_KV_CACHE(cache_latent, torch.zeros(3, R, dtype=torch.bfloat16, device=NPU),
                                torch.zeros(3, P, dtype=torch.bfloat16, device=NPU), slots, block, cache_rope)
    for got, part in ((cache_latent, latent_part), (cache_rope, rope_part)):
        assert torch.equal(_location_rows(got.cpu(), rows), _location_rows(part, rows))


def test_the_kv_write_ops_pass_opcheck():
    """The slot mapping's fake gives its int32 slots; the write declares what it mutates."""
    loc = torch.tensor([0, 1, 2, 3, 130], device=NPU)
    torch.library.opcheck(native_ops.SLOT_MAPPING, (loc, 256, 0, 2, 1))
    parts = [part.to(NPU) for part in _parts(256, 128, "nd")]
    latent, rope = torch.randn(5, R).bfloat16().to(NPU), torch.randn(5, P).bfloat16().to(NPU)
    torch.library.opcheck(native_ops.SCATTER_KV_CACHE,
                          (parts[0], latent, rope, native_ops.SLOT_MAPPING(loc, 256, 0, 2, 1), 128, parts[1]))
