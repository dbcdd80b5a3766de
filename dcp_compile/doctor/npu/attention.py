"""The checks of FIA and npu_attention_update: each call as the lowering makes it
(lowering/npu/lower_attention.py), against dcp_compile's torch reference computed in fp32 on the
CPU, never against the stand-in."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from dcp_compile.doctor.npu.checks import TOLERANCE, Context, Result, attention_matches, close, first_line
from dcp_compile.ops import reference

HEADS, LATENT, ROPE = 8, 512, 64
SCALE = 1.0 / math.sqrt(LATENT + ROPE)


@dataclass
class PagedCache:
    latent: torch.Tensor  # [blocks, block_size, 512] on the device
    rope: torch.Tensor    # [blocks, block_size, 64]
    table: torch.Tensor   # [B, W] int32
    block_size: int


def paged_cache(kv_lens, block_size, device, seed=0, packed=False) -> PagedCache:
    """Random bf16 latent and rope rows in shuffled blocks (block 0 unused), one table row per
    request; `packed`: strided column views of one [rows, 576] buffer."""
    gen = torch.Generator().manual_seed(seed)
    width = max(1, max(-(-n // block_size) for n in kv_lens))
    blocks = len(kv_lens) * width + 1
    rows = torch.randn(blocks * block_size, LATENT + ROPE, generator=gen).bfloat16()
    table = (torch.randperm(blocks - 1, generator=gen)[: len(kv_lens) * width] + 1).reshape(len(kv_lens), width).int()
    rows = rows.to(device)
    if packed:
        latent, rope = rows[:, :LATENT], rows[:, LATENT:]
    else:
        latent, rope = rows[:, :LATENT].contiguous(), rows[:, LATENT:].contiguous()
    return PagedCache(latent.view(blocks, block_size, LATENT), rope.view(blocks, block_size, ROPE), table.to(device),
                      block_size)


def queries(tokens, heads, device, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, heads, LATENT, generator=gen).bfloat16().to(device),
            torch.randn(tokens, heads, ROPE, generator=gen).bfloat16().to(device))


def cumulative(query_lens) -> list[int]:
    return [sum(query_lens[: i + 1]) for i in range(len(query_lens))]


def fia(q, q_rope, cache: PagedCache, kv_lens, layout="BSND", query_lens=None):
    """FIA v1's MLA path as the lowering calls it; out [T, H, R], lse [T, H]."""
    tokens, heads, _ = q.shape
    common = dict(num_heads=heads, scale=SCALE, num_key_value_heads=1, block_table=cache.table,
                  block_size=cache.block_size, sparse_mode=0, softmax_lse_flag=True)
    op = torch.ops.npu.npu_fused_infer_attention_score
    if layout == "BSND":
        out, lse = op(q.view(tokens, 1, heads, LATENT), cache.latent, cache.latent,
                      query_rope=q_rope.view(tokens, 1, heads, ROPE), key_rope=cache.rope, input_layout="BSND",
                      actual_seq_lengths_kv=list(kv_lens), **common)
    else:
        out, lse = op(q, cache.latent, cache.latent, query_rope=q_rope, key_rope=cache.rope, input_layout="TND",
                      actual_seq_lengths=cumulative(query_lens), actual_seq_lengths_kv=list(kv_lens), **common)
    return out.reshape(tokens, heads, LATENT), lse.reshape(tokens, heads)


def fia_reference(q, q_rope, cache: PagedCache, kv_lens, query_lens=None, base=math.e):
    """Every query of request b over its first kv_lens[b] keys, unmasked (sparse_mode 0, no mask),
    on the CPU in fp32. An empty request: out 0, lse +inf (docs/ascend.md §7.2)."""
    query_lens = query_lens or [1] * len(kv_lens)
    q, q_rope = q.cpu().float(), q_rope.cpu().float()
    latent = cache.latent.cpu().float().reshape(-1, LATENT)
    rope = cache.rope.cpu().float().reshape(-1, ROPE)
    table = cache.table.cpu().long()
    outs, lses = [], []
    first = 0
    for b, (count, kv_len) in enumerate(zip(query_lens, kv_lens)):
        idx = slice(first, first + count)
        first += count
        if kv_len == 0:
            outs.append(torch.zeros(count, q.shape[1], LATENT))
            lses.append(torch.full((count, q.shape[1]), math.inf))
            continue
        blocks = table[b, : -(-kv_len // cache.block_size)]
        rows = (blocks[:, None] * cache.block_size + torch.arange(cache.block_size)[None, :]).reshape(-1)[:kv_len]
        scores = torch.einsum("thr,kr->thk", q[idx], latent[rows]) + torch.einsum("thp,kp->thk", q_rope[idx], rope[rows])
        scores = scores * SCALE
        lse = torch.logsumexp(scores, dim=-1)
        outs.append(torch.einsum("thk,kr->thr", torch.softmax(scores, dim=-1), latent[rows]))
        lses.append(lse / math.log(base))
    return torch.cat(outs), torch.cat(lses)


def fia_a5(q, q_rope, cache: PagedCache, kv_lens, version=1, nz_cache=False, query_lens=None, mask=None):
    """FIA as the lowering calls it under its A5 options: v1 or v2, the ND or the NZ cache
    (docs/ascend.md §15); decode (BSND / BSND_NBSD), the split verify's prefix (TND / TND_NTD,
    query_lens) or the masked verify (BSND with `mask` [B, 1, S, W] and S queries a row).
    Returns out [T, H, R], lse [T, H]."""
    from dcp_compile.lowering.npu.lower_attention import V2_NAMES
    from dcp_compile.ops import nz

    tokens, heads, _ = q.shape
    latent, rope = cache.latent, cache.rope
    if nz_cache:
        latent = nz.from_rows(latent.reshape(-1, LATENT), cache.block_size)
        rope = nz.from_rows(rope.reshape(-1, ROPE), cache.block_size)
    arguments = dict(num_heads=heads, scale=SCALE, num_key_value_heads=1, block_table=cache.table,
                     block_size=cache.block_size, sparse_mode=0, softmax_lse_flag=True,
                     actual_seq_lengths_kv=list(kv_lens))
    rows = len(kv_lens)
    if query_lens is not None and mask is None:
        query, query_rope, layout = q, q_rope, "TND"
        arguments["actual_seq_lengths"] = cumulative(query_lens)
    else:
        per_row = tokens // rows
        query, query_rope, layout = q.view(rows, per_row, heads, LATENT), q_rope.view(rows, per_row, heads, ROPE), "BSND"
        if mask is not None:
            arguments.update(atten_mask=mask, actual_seq_lengths=[per_row] * rows)
    op = torch.ops.npu.npu_fused_infer_attention_score
    if version == 2:
        op = torch.ops.npu.npu_fused_infer_attention_score_v2
        arguments = {V2_NAMES.get(k, k): v for k, v in arguments.items()}
        layout += "_NBSD" if layout == "BSND" else "_NTD"
    out, lse = op(query, latent, latent, query_rope=query_rope, key_rope=rope, input_layout=layout, **arguments)
    if version == 2:
        out = out.reshape(heads, tokens, LATENT).transpose(0, 1)
    if lse.dim() == 4:  # [B, N, S, 1]
        lse = lse.permute(0, 2, 1, 3)
    return out.reshape(tokens, heads, LATENT), lse.reshape(tokens, heads)


def masked_reference(q, q_rope, cache: PagedCache, visible):
    """Each query t over the first visible[t] keys of its row (S = T / B queries a row), fp32 on the
    CPU; a query that sees none: out 0, lse -inf."""
    rows = cache.table.shape[0]
    per_row = q.shape[0] // rows
    outs, lses = [], []
    for t, count in enumerate(visible):
        if count == 0:
            outs.append(torch.zeros(1, q.shape[1], LATENT))
            lses.append(torch.full((1, q.shape[1]), -math.inf))
            continue
        out, lse = fia_reference(q[t : t + 1], q_rope[t : t + 1], PagedCache(cache.latent, cache.rope,
                                 cache.table[t // per_row : t // per_row + 1], cache.block_size), [count])
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def live_rows(pair, query_lens, kv_lens):
    """The rows of (out, lse) whose request has keys: what a check compares where the output of a
    request of length 0 is another check's fact (empty-shard-lse)."""
    keep = torch.tensor([kv > 0 for count, kv in zip(query_lens, kv_lens) for _ in range(count)])
    return pair[0].cpu()[keep], pair[1].cpu()[keep]


# --- the checks ---------------------------------------------------------------------------------


def check_empty_shard_lse(result: Result, context: Context) -> None:
    kv_lens = [0, 37, 0, 5]
    cache = paged_cache(kv_lens, 128, context.device)
    q, q_rope = queries(len(kv_lens), HEADS, context.device)
    out, lse = fia(q, q_rope, cache, kv_lens)
    empty = torch.tensor([n == 0 for n in kv_lens])
    result.measured = {"lse_kv_len_0": sorted({float(v) for v in lse.cpu()[empty].flatten().tolist()}),
                       "out_kv_len_0_max_abs": float(out.cpu()[empty].float().abs().max())}
    faithful = result.measured["lse_kv_len_0"] == [math.inf] and result.measured["out_kv_len_0_max_abs"] == 0
    result.verdict = "PASS" if faithful else "FAIL"
    if not faithful:
        result.detail = "the lowering masks rows of length 0 by their lengths, so no option depends on this"


def check_lse_base(result: Result, context: Context) -> None:
    kv_lens = [1, 37, 200, 130]
    cache = paged_cache(kv_lens, 128, context.device, seed=2)
    q, q_rope = queries(len(kv_lens), HEADS, context.device, seed=3)
    got = fia(q, q_rope, cache, kv_lens)
    natural, detail = attention_matches(got, fia_reference(q, q_rope, cache, kv_lens))
    base2, _ = attention_matches(got, fia_reference(q, q_rope, cache, kv_lens, base=2.0))
    result.measured = {**detail, "matches_base_e": natural, "matches_base_2": base2}
    result.verdict = "PASS" if natural else "FAIL"


def check_tnd_more_queries_than_keys(result: Result, context: Context) -> None:
    kv_lens, query_lens = [3, 0, 40, 1], [5, 2, 16, 7]
    cache = paged_cache(kv_lens, 128, context.device, seed=4)
    q, q_rope = queries(sum(query_lens), HEADS, context.device, seed=5)
    got = fia(q, q_rope, cache, kv_lens, layout="TND", query_lens=query_lens)
    ok, result.measured = attention_matches(live_rows(got, query_lens, kv_lens),
                                            live_rows(fia_reference(q, q_rope, cache, kv_lens, query_lens),
                                                      query_lens, kv_lens))
    result.verdict = "PASS" if ok else "FAIL"


def check_tnd_zero_query_pieces(result: Result, context: Context) -> None:
    """The native lowering's split FIA call over a batch with fewer pieces than its graph was
    lowered for (feed.FIAFeed.lists): the padding pieces have no query (the last cumulative count
    repeated), no key, and row 0's blocks; the real pieces must not see them."""
    query_lens, kv_lens = [3, 1, 2, 0, 0], [5, 1, 40, 0, 0]
    cache = paged_cache(kv_lens, 128, context.device, seed=6)
    cache.table[3:] = cache.table[0]
    q, q_rope = queries(sum(query_lens), HEADS, context.device, seed=7)
    got = fia(q, q_rope, cache, kv_lens, layout="TND", query_lens=query_lens)
    ok, result.measured = attention_matches(got, fia_reference(q, q_rope, cache, kv_lens, query_lens))
    result.measured["actual_seq_lengths"] = cumulative(query_lens)
    result.verdict = "PASS" if ok else "FAIL"


def check_few_heads(result: Result, context: Context) -> None:
    kv_lens = [5, 130, 0]
    cache = paged_cache(kv_lens, 128, context.device, seed=8)
    found = {}
    for heads in (1, 2, 4):
        q, q_rope = queries(len(kv_lens), heads, context.device, seed=9 + heads)
        try:
            ok, _ = attention_matches(live_rows(fia(q, q_rope, cache, kv_lens), [1] * 3, kv_lens),
                                      live_rows(fia_reference(q, q_rope, cache, kv_lens), [1] * 3, kv_lens))
            found[heads] = "ok" if ok else "wrong values"
        except Exception as exc:  # a rejection is the fact being measured
            found[heads] = f"rejected: {first_line(exc)}"
    result.measured = {f"heads_{h}": r for h, r in found.items()}
    result.verdict = "PASS" if all(r == "ok" for r in found.values()) else "FAIL"
    if result.verdict == "FAIL":
        result.detail = "a model whose FIA call sees fewer than 8 query heads (heads per rank x dcp_size) is unsafe"


def check_update_all_empty(result: Result, context: Context) -> None:
    from dcp_compile.lowering.npu import ops as npu_ops

    device = context.device
    shards, tokens, heads = 2, 5, 4
    gen = torch.Generator().manual_seed(14)
    out = torch.randn(tokens, shards * heads, LATENT, generator=gen).bfloat16()
    lse = torch.randn(tokens, shards * heads, generator=gen) * 3
    lse[1] = -math.inf  # token 1: every shard empty (a padded row)
    lse[3, :heads] = -math.inf  # token 3: shard 0 empty
    out[1] = 0
    packed = reference.pack_partials(out, lse, shards).to(device)
    outs, lses = npu_ops.SPLIT_PARTIALS(packed, LATENT)  # the lowering's guard for all-empty rows
    merged, _ = torch.ops.npu.npu_attention_update(list(lses.unbind(0)), list(outs.unbind(0)), 0)
    want = reference.merge_partials(packed.cpu(), LATENT).reshape(tokens * heads, LATENT)
    ok, diff = close(merged.reshape(tokens * heads, LATENT), want, **TOLERANCE)
    empty_lse = [torch.full((heads,), -math.inf, device=device)] * shards
    empty_out = [torch.zeros(heads, LATENT, dtype=torch.bfloat16, device=device)] * shards
    raw, _ = torch.ops.npu.npu_attention_update(empty_lse, empty_out, 0)
    padded_row = merged.reshape(tokens, heads, LATENT)[1]
    result.measured = {"guarded_max_abs_diff": diff,
                       "all_empty_row_merged_max_abs": float(padded_row.float().abs().max()),
                       "unguarded_all_empty_is_nan": bool(torch.isnan(raw.float()).all())}
    result.verdict = "PASS" if ok and result.measured["all_empty_row_merged_max_abs"] == 0 else "FAIL"


CANN_2026_BLOCK_SIZES = (32, 64, 256, 512, 1024)


def check_block_sizes(result: Result, context: Context) -> None:
    kv_lens = [1, 300, 0, 129]
    accepted, rejected = [], {}
    for block_size in (16, 128) + CANN_2026_BLOCK_SIZES:
        cache = paged_cache(kv_lens, block_size, context.device, seed=15)
        q, q_rope = queries(len(kv_lens), HEADS, context.device, seed=16)
        try:
            ok, _ = attention_matches(live_rows(fia(q, q_rope, cache, kv_lens), [1] * 4, kv_lens),
                                      live_rows(fia_reference(q, q_rope, cache, kv_lens), [1] * 4, kv_lens))
            if ok:
                accepted.append(block_size)
            else:
                rejected[block_size] = "wrong values"
        except Exception as exc:
            rejected[block_size] = first_line(exc)
    usable_2026 = all(b in accepted for b in CANN_2026_BLOCK_SIZES)
    result.measured = {"accepted": sorted(accepted), "rejected": {str(k): v for k, v in rejected.items()},
                       "fia_block_sizes_cann_2026_usable": usable_2026}
    result.verdict = "PASS" if 16 in accepted and 128 in accepted else "FAIL"
    if not usable_2026:
        result.unsafe = ["fia_block_sizes='cann-2026'"]
        result.detail = "this CANN refuses some of the 2026 block sizes: keep fia_block_sizes='cann-2025'"


def _timed(fn, repeats) -> float:
    fn()
    torch.npu.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.npu.synchronize()
    return (time.perf_counter() - start) / repeats * 1e6


def check_strided_keys(result: Result, context: Context) -> None:
    device = context.device
    kv_lens = [1024] * 2 if context.emulated else [4096] * 8
    timings = {}
    for layout, packed in (("split", False), ("strided", True)):
        cache = paged_cache(kv_lens, 128, device, seed=17, packed=packed)
        q, q_rope = queries(len(kv_lens), HEADS, device, seed=18)
        reset_peak = getattr(torch.npu, "reset_peak_memory_stats", None)  # the emulated device keeps no counts
        if reset_peak is not None:
            reset_peak()
        before = torch.npu.memory_allocated() if reset_peak is not None else 0
        got = fia(q, q_rope, cache, kv_lens)
        high = torch.npu.max_memory_allocated() if reset_peak is not None else 0
        call = _timed(lambda: fia(q, q_rope, cache, kv_lens), 2 if context.emulated else 20)
        timings[layout] = {"us_per_call": round(call, 1), "peak_extra_bytes": max(0, high - before), "out": got}
    same, _ = attention_matches(timings["split"].pop("out"), timings["strided"].pop("out"))
    shard_bytes = (len(kv_lens) * -(-max(kv_lens) // 128) + 1) * 128 * LATENT * 2
    result.measured = {**{f"{k}_{m}": v for k, r in timings.items() for m, v in r.items()}, "shard_bytes": shard_bytes,
                       "same_result": same}
    if context.emulated:
        from dcp_compile.testing import npu_standin as standin

        standin.contiguous_copies.clear()
        fia(q, q_rope, paged_cache(kv_lens, 128, device, seed=17, packed=True), kv_lens)
        result.measured["standin_copies_of_strided_views"] = [name for name, _ in standin.contiguous_copies]
    result.detail = ("the split layout (contiguous latent and rope) is what the NPU lowering hands FIA; the strided "
                     "views are what a packed [rows, 576] pool would")
    result.verdict = "PASS" if same else "FAIL"


def check_nz_cache(result: Result, context: Context) -> None:
    kv_lens = [5, 130, 0]
    cache = paged_cache(kv_lens, 128, context.device, seed=19)
    q, q_rope = queries(len(kv_lens), HEADS, context.device, seed=20)
    want = live_rows(fia_reference(q, q_rope, cache, kv_lens), [1] * 3, kv_lens)
    found = {}
    for version in (1, 2):
        found[f"v{version}"], result.measured[f"v{version}"] = attention_matches(
            live_rows(fia_a5(q, q_rope, cache, kv_lens, version, nz_cache=True), [1] * 3, kv_lens), want)
    result.verdict = "PASS" if all(found.values()) else "FAIL"


def check_fia_v2_layouts(result: Result, context: Context) -> None:
    device = context.device
    query_lens, kv_lens = [3, 1, 2], [5, 0, 40]
    cache = paged_cache(kv_lens, 128, device, seed=21)
    q, q_rope = queries(sum(query_lens), HEADS, device, seed=22)
    tnd_ok, tnd = attention_matches(
        live_rows(fia_a5(q, q_rope, cache, kv_lens, 2, query_lens=query_lens), query_lens, kv_lens),
        live_rows(fia_reference(q, q_rope, cache, kv_lens, query_lens), query_lens, kv_lens))
    dq, dq_rope = queries(len(kv_lens), HEADS, device, seed=23)
    bsnd_ok, bsnd = attention_matches(live_rows(fia_a5(dq, dq_rope, cache, kv_lens, 2), [1] * 3, kv_lens),
                                      live_rows(fia_reference(dq, dq_rope, cache, kv_lens), [1] * 3, kv_lens))
    result.measured = {"TND_NTD": tnd, "BSND_NBSD": bsnd}
    result.verdict = "PASS" if tnd_ok and bsnd_ok else "FAIL"


def check_masked_verify(result: Result, context: Context) -> None:
    from dcp_compile.lowering.npu.ops import rank_causal_mask

    device = context.device
    # rank 1 of 2, token-interleaved: local key i holds global position 2 i + 1; 3 queries a row
    per_row, kv_lens, prefix = 3, [3, 70, 1], [4, 137, 0]
    cache = paged_cache(kv_lens, 128, device, seed=24)
    width = cache.table.shape[1] * cache.block_size
    positions = torch.arange(width)[None, :].expand(len(kv_lens), width) * 2 + 1
    q_positions = torch.tensor([p + j for p in prefix for j in range(per_row)])
    mask, visible = rank_causal_mask(positions, torch.tensor(kv_lens), q_positions, width)
    q, q_rope = queries(per_row * len(kv_lens), HEADS, device, seed=25)
    want = masked_reference(q, q_rope, cache, visible.tolist())
    seen = visible > 0
    found = {}
    for version in (1, 2):
        out, lse = fia_a5(q, q_rope, cache, kv_lens, version, mask=mask.to(device))
        found[f"v{version}"], result.measured[f"v{version}"] = attention_matches(
            (out.cpu()[seen], lse.cpu()[seen]), (want[0][seen], want[1][seen]))
    result.measured["visible"] = visible.tolist()
    result.verdict = "PASS" if all(found.values()) else "FAIL"
