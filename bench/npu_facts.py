"""What only Ascend hardware can settle: each fact the NPU lowering relies on, checked on the real
ops against the torch reference, one by one, with the measured values.

    python -m bench.npu_facts --json --out npu_facts.json          # on an Ascend NPU (torch_npu, CANN)
    python -m bench.npu_facts --standin --json                     # the stand-ins, on the emulated npu device
    python -m bench.npu_facts --standin --plant empty-shard-lse    # a stand-in departs from one fact: FAIL, exit 1

It prints a table of PASS, FAIL or SKIP per fact and, with --json, ends with one JSON line (also
written to --out). The exit status is 1 when any fact FAILs. Every check compares the op with
dcp_compile's torch reference (or the documented value), never with the stand-in; `--standin`
runs the same checks on the stand-ins (DCP_COMPILE_NPU_EMULATOR=1 is set for you) to check the
probe itself, and `--plant NAME` makes a stand-in depart from one fact on purpose
(dcp_compile.testing.npu_standin.PLANTS), which the probe must report. The facts and their
sources: docs/ascend.md; what the lowering does with them: docs/paged-lowerings.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch

from bench.lib import result as results
from bench.lib import tables
from dcp_compile.ops import reference

HEADS, LATENT, ROPE = 8, 512, 64
SCALE = 1.0 / math.sqrt(LATENT + ROPE)
TOLERANCE = dict(atol=2e-2, rtol=2e-2)  # bf16 inputs, fp32 accumulation
LSE_TOLERANCE = dict(atol=2e-3, rtol=1e-4)
STANDIN = False
"""Set by --standin: smaller shapes where a shape only matters for timing."""


@dataclass
class Fact:
    name: str
    relies: str
    """What the lowering relies on, and where it is documented."""
    status: str = "SKIP"
    measured: dict = field(default_factory=dict)
    detail: str = ""


# --- FIA calls and their reference ------------------------------------------------------------


@dataclass
class PagedCache:
    latent: torch.Tensor  # [blocks, block_size, 512] on the device
    rope: torch.Tensor    # [blocks, block_size, 64]
    table: torch.Tensor   # [B, W] int32
    block_size: int


def paged_cache(kv_lens, block_size, device, seed=0, packed=False) -> PagedCache:
    gen = torch.Generator().manual_seed(seed)
    width = max(1, max(-(-n // block_size) for n in kv_lens))
    blocks = len(kv_lens) * width + 1
    rows = torch.randn(blocks * block_size, LATENT + ROPE, generator=gen).bfloat16()
    table = (torch.randperm(blocks - 1, generator=gen)[: len(kv_lens) * width] + 1).reshape(len(kv_lens), width).int()
    rows = rows.to(device)
    if packed:  # strided column views of one [rows, 576] buffer
        latent, rope = rows[:, :LATENT], rows[:, LATENT:]
    else:
        latent, rope = rows[:, :LATENT].contiguous(), rows[:, LATENT:].contiguous()
    return PagedCache(latent.view(blocks, block_size, LATENT), rope.view(blocks, block_size, ROPE), table.to(device),
                      block_size)


def queries(tokens, heads, device, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, heads, LATENT, generator=gen).bfloat16().to(device),
            torch.randn(tokens, heads, ROPE, generator=gen).bfloat16().to(device))


def fia(q, q_rope, cache: PagedCache, kv_lens, layout="BSND", query_lens=None):
    """FIA's MLA path as the lowering calls it (lowering/npu/lower_attention.py); out [T, H, R], lse [T, H]."""
    tokens, heads, _ = q.shape
    common = dict(num_heads=heads, scale=SCALE, num_key_value_heads=1, block_table=cache.table,
                  block_size=cache.block_size, sparse_mode=0, softmax_lse_flag=True)
    op = torch.ops.npu.npu_fused_infer_attention_score
    if layout == "BSND":
        out, lse = op(q.view(tokens, 1, heads, LATENT), cache.latent, cache.latent,
                      query_rope=q_rope.view(tokens, 1, heads, ROPE), key_rope=cache.rope, input_layout="BSND",
                      actual_seq_lengths_kv=list(kv_lens), **common)
    else:
        cumulative = [sum(query_lens[: i + 1]) for i in range(len(query_lens))]
        out, lse = op(q, cache.latent, cache.latent, query_rope=q_rope, key_rope=cache.rope, input_layout="TND",
                      actual_seq_lengths=cumulative, actual_seq_lengths_kv=list(kv_lens), **common)
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
    """FIA as the lowering calls it under its A5 options (lowering/npu/lower_attention.py): v1 or v2,
    the ND or the NZ cache (docs/ascend.md §15); decode (BSND / BSND_NBSD), the split verify's
    prefix (TND / TND_NTD, query_lens) or the masked verify (BSND with `mask` [B, 1, S, W] and S
    queries a row). Returns out [T, H, R], lse [T, H]."""
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
        arguments["actual_seq_lengths"] = [sum(query_lens[: i + 1]) for i in range(rows)]
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


def check_nz_cache(fact: Fact, device) -> None:
    kv_lens = [5, 130, 0]
    cache = paged_cache(kv_lens, 128, device, seed=21)
    q, q_rope = queries(len(kv_lens), HEADS, device, seed=22)
    want = fia_reference(q, q_rope, cache, kv_lens)
    results = {}
    for version in (1, 2):
        ok, detail = _attention_matches(fia_a5(q, q_rope, cache, kv_lens, version, nz_cache=True), want)
        results[f"v{version}"] = ok
        fact.measured[f"v{version}"] = detail
    fact.status = "PASS" if all(results.values()) else "FAIL"


def check_fia_v2_layouts(fact: Fact, device) -> None:
    query_lens, kv_lens = [3, 1, 2], [5, 0, 40]
    cache = paged_cache(kv_lens, 128, device, seed=23)
    q, q_rope = queries(sum(query_lens), HEADS, device, seed=24)
    tnd_ok, tnd = _attention_matches(fia_a5(q, q_rope, cache, kv_lens, 2, query_lens=query_lens),
                                     fia_reference(q, q_rope, cache, kv_lens, query_lens))
    dq, dq_rope = queries(len(kv_lens), HEADS, device, seed=25)
    bsnd_ok, bsnd = _attention_matches(fia_a5(dq, dq_rope, cache, kv_lens, 2), fia_reference(dq, dq_rope, cache, kv_lens))
    fact.measured = {"TND_NTD": tnd, "BSND_NBSD": bsnd}
    fact.status = "PASS" if tnd_ok and bsnd_ok else "FAIL"


def check_masked_verify(fact: Fact, device) -> None:
    from dcp_compile.lowering.npu.ops import rank_causal_mask

    # rank 1 of 2, token-interleaved: local key i holds global position 2 i + 1; 3 queries a row
    per_row, kv_lens, prefix = 3, [3, 70, 1], [4, 137, 0]
    cache = paged_cache(kv_lens, 128, device, seed=26)
    width = cache.table.shape[1] * cache.block_size
    positions = torch.arange(width)[None, :].expand(len(kv_lens), width) * 2 + 1
    q_positions = torch.tensor([p + j for p in prefix for j in range(per_row)])
    mask, visible = rank_causal_mask(positions, torch.tensor(kv_lens), q_positions, width)
    q, q_rope = queries(per_row * len(kv_lens), HEADS, device, seed=27)
    want = masked_reference(q, q_rope, cache, visible.tolist())
    seen = visible > 0
    results = {}
    for version in (1, 2):
        out, lse = fia_a5(q, q_rope, cache, kv_lens, version, mask=mask.to(device))
        ok, detail = _attention_matches((out[seen.to(out.device)], lse[seen.to(lse.device)]), (want[0][seen], want[1][seen]))
        results[f"v{version}"] = ok
        fact.measured[f"v{version}"] = detail
    fact.measured["visible"] = visible.tolist()
    fact.status = "PASS" if all(results.values()) else "FAIL"


GRAPH_KV_LENS, GRAPH_NEW_KV_LENS = [5, 130, 0], [7, 1, 64]
"""The decode lengths a captured FIA call is recorded with, and those the update pushes."""


def _captured_decode(device, run, seed: int, capture_lens=None, cache_lens=None):
    """(graph, (out, lse), q, q_rope, cache): `run(q, q_rope, cache, kv_lens)` captured in an NPU
    graph after two warm-up calls, with capture_lens (GRAPH_KV_LENS), over a cache for cache_lens
    (the longer of GRAPH_KV_LENS and GRAPH_NEW_KV_LENS)."""
    capture_lens = capture_lens or [max(1, length) for length in GRAPH_KV_LENS]  # capture with >= 1 (§17)
    cache_lens = cache_lens or [max(a, b) for a, b in zip(GRAPH_KV_LENS, GRAPH_NEW_KV_LENS)]
    cache = paged_cache([max(a, b) for a, b in zip(capture_lens, cache_lens)], 128, device, seed=seed)
    q, q_rope = queries(len(capture_lens), HEADS, device, seed=seed + 1)
    for _ in range(2):  # warm up
        run(q, q_rope, cache, capture_lens)
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph, auto_dispatch_capture=True):
        outputs = run(q, q_rope, cache, capture_lens)
    return graph, outputs, q, q_rope, cache


def check_v2_graph_update_names(fact: Fact, device) -> None:
    backend = torch.npu
    kv_lens, new_lens = GRAPH_KV_LENS, GRAPH_NEW_KV_LENS
    graph, (out, lse), q, q_rope, cache = _captured_decode(
        device, lambda *a: fia_a5(*a, 2, nz_cache=True), seed=28)
    graph.update(cpu_update_input=[{"actual_seq_kvlen": new_lens}])
    graph.replay()
    backend.synchronize()
    ok, detail = _attention_matches((out, lse), fia_reference(q, q_rope, cache, new_lens))
    try:
        graph.update(cpu_update_input=[{"actual_seq_lengths_kv": kv_lens}])
        refused = "accepted"
    except Exception as exc:
        refused = f"refused: {str(exc).splitlines()[0][:120]}"
    fact.measured = {**detail, "actual_seq_lengths_kv (v1's name, must be refused)": refused}
    fact.status = "PASS" if ok else "FAIL"


def _close(got, want, **tolerance) -> tuple[bool, float]:
    got, want = got.cpu().float(), want.cpu().float()
    finite = torch.isfinite(want)
    if not torch.equal(torch.isfinite(got), finite) or not torch.equal(got[~finite], want[~finite]):
        return False, math.inf
    diff = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
    return bool(torch.allclose(got[finite], want[finite], **tolerance)), diff


def _attention_matches(got, want) -> tuple[bool, dict]:
    out_ok, out_diff = _close(got[0], want[0], **TOLERANCE)
    lse_ok, lse_diff = _close(got[1], want[1], **LSE_TOLERANCE)
    return out_ok and lse_ok, {"max_abs_diff_out": out_diff, "max_abs_diff_lse": lse_diff}


# --- The facts ----------------------------------------------------------------------------------


def check_empty_shard_lse(fact: Fact, device) -> None:
    kv_lens = [0, 37, 0, 5]
    cache = paged_cache(kv_lens, 128, device)
    q, q_rope = queries(len(kv_lens), HEADS, device)
    out, lse = fia(q, q_rope, cache, kv_lens)
    empty = torch.tensor([n == 0 for n in kv_lens])
    fact.measured = {"lse_kv_len_0": sorted({float(v) for v in lse.cpu()[empty].flatten().tolist()}),
                     "out_kv_len_0_max_abs": float(out.cpu()[empty].float().abs().max())}
    faithful = fact.measured["lse_kv_len_0"] == [math.inf] and fact.measured["out_kv_len_0_max_abs"] == 0
    fact.status = "PASS" if faithful else "FAIL"


def check_lse_base(fact: Fact, device) -> None:
    kv_lens = [1, 37, 200, 130]
    cache = paged_cache(kv_lens, 128, device, seed=2)
    q, q_rope = queries(len(kv_lens), HEADS, device, seed=3)
    got = fia(q, q_rope, cache, kv_lens)
    natural, detail = _attention_matches(got, fia_reference(q, q_rope, cache, kv_lens))
    base2, _ = _attention_matches(got, fia_reference(q, q_rope, cache, kv_lens, base=2.0))
    fact.measured = {**detail, "matches_base_e": natural, "matches_base_2": base2}
    fact.status = "PASS" if natural else "FAIL"


def check_tnd_more_queries_than_keys(fact: Fact, device) -> None:
    kv_lens, query_lens = [3, 0, 40, 1], [5, 2, 16, 7]
    cache = paged_cache(kv_lens, 128, device, seed=4)
    q, q_rope = queries(sum(query_lens), HEADS, device, seed=5)
    got = fia(q, q_rope, cache, kv_lens, layout="TND", query_lens=query_lens)
    ok, fact.measured = _attention_matches(got, fia_reference(q, q_rope, cache, kv_lens, query_lens))
    fact.status = "PASS" if ok else "FAIL"


def check_few_heads(fact: Fact, device) -> None:
    kv_lens = [5, 130, 0]
    cache = paged_cache(kv_lens, 128, device, seed=6)
    results = {}
    for heads in (1, 2, 4):
        q, q_rope = queries(len(kv_lens), heads, device, seed=7 + heads)
        try:
            ok, _ = _attention_matches(fia(q, q_rope, cache, kv_lens), fia_reference(q, q_rope, cache, kv_lens))
            results[heads] = "ok" if ok else "wrong values"
        except Exception as exc:  # a rejection is the fact being measured
            results[heads] = f"rejected: {str(exc).splitlines()[0][:160]}"
    fact.measured = {f"heads_{h}": r for h, r in results.items()}
    fact.status = "PASS" if all(r == "ok" for r in results.values()) else "FAIL"


def check_update_all_empty(fact: Fact, device) -> None:
    from dcp_compile.lowering.npu import ops as npu_ops

    shards, tokens, heads = 2, 5, 4
    gen = torch.Generator().manual_seed(8)
    out = torch.randn(tokens, shards * heads, LATENT, generator=gen).bfloat16()
    lse = torch.randn(tokens, shards * heads, generator=gen) * 3
    lse[1] = -math.inf  # token 1: every shard empty (a padded row)
    lse[3, :heads] = -math.inf  # token 3: shard 0 empty
    out[1] = 0
    packed = reference.pack_partials(out, lse, shards).to(device)
    outs, lses = npu_ops.SPLIT_PARTIALS(packed, LATENT)  # the lowering's guard for all-empty rows
    merged, _ = torch.ops.npu.npu_attention_update(list(lses.unbind(0)), list(outs.unbind(0)), 0)
    want = reference.merge_partials(packed.cpu(), LATENT).reshape(tokens * heads, LATENT)
    ok, diff = _close(merged.reshape(tokens * heads, LATENT), want, **TOLERANCE)
    empty_lse = [torch.full((heads,), -math.inf, device=device)] * shards
    empty_out = [torch.zeros(heads, LATENT, dtype=torch.bfloat16, device=device)] * shards
    raw, _ = torch.ops.npu.npu_attention_update(empty_lse, empty_out, 0)
    padded_row = merged.reshape(tokens, heads, LATENT)[1]
    fact.measured = {"guarded_max_abs_diff": diff, "all_empty_row_merged_max_abs": float(padded_row.float().abs().max()),
                     "unguarded_all_empty_is_nan": bool(torch.isnan(raw.float()).all())}
    fact.status = "PASS" if ok and fact.measured["all_empty_row_merged_max_abs"] == 0 else "FAIL"


def check_block_sizes(fact: Fact, device) -> None:
    kv_lens = [1, 300, 0, 129]
    accepted, rejected = [], {}
    for block_size in (16, 32, 64, 128, 256, 512, 1024):
        cache = paged_cache(kv_lens, block_size, device, seed=9)
        q, q_rope = queries(len(kv_lens), HEADS, device, seed=10)
        try:
            ok, _ = _attention_matches(fia(q, q_rope, cache, kv_lens), fia_reference(q, q_rope, cache, kv_lens))
            (accepted.append(block_size) if ok else rejected.__setitem__(block_size, "wrong values"))
        except Exception as exc:
            rejected[block_size] = str(exc).splitlines()[0][:160]
    fact.measured = {"accepted": accepted, "rejected": {str(k): v for k, v in rejected.items()},
                     "fia_block_sizes_cann_2026_usable": all(b in accepted for b in (32, 64, 256, 512, 1024))}
    fact.status = "PASS" if 16 in accepted and 128 in accepted else "FAIL"


def _timed(fn, device, repeats=20) -> float:
    backend = getattr(torch, device.type)
    fn()
    backend.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    backend.synchronize()
    return (time.perf_counter() - start) / repeats * 1e6


def check_strided_keys(fact: Fact, device) -> None:
    kv_lens = [1024] * 2 if STANDIN else [4096] * 8
    backend = getattr(torch, device.type)
    results = {}
    for layout, packed in (("split", False), ("strided", True)):
        cache = paged_cache(kv_lens, 128, device, seed=11, packed=packed)
        q, q_rope = queries(len(kv_lens), HEADS, device, seed=12)
        peak = getattr(backend, "reset_peak_memory_stats", None)
        if peak is not None:
            peak()
        before = backend.memory_allocated() if hasattr(backend, "memory_allocated") else 0
        got = fia(q, q_rope, cache, kv_lens)
        high = backend.max_memory_allocated() if hasattr(backend, "max_memory_allocated") else 0
        call = _timed(lambda: fia(q, q_rope, cache, kv_lens), device, 2 if STANDIN else 20)
        results[layout] = {"us_per_call": round(call, 1),
                           "peak_extra_bytes": max(0, high - before), "out": got}
    same, _ = _attention_matches(results["split"].pop("out"), results["strided"].pop("out"))
    shard_bytes = (len(kv_lens) * -(-max(kv_lens) // 128) + 1) * 128 * LATENT * 2
    fact.measured = {**{f"{k}_{m}": v for k, r in results.items() for m, v in r.items()}, "shard_bytes": shard_bytes,
                     "same_result": same}
    if STANDIN:
        from dcp_compile.testing import npu_standin as standin

        standin.contiguous_copies.clear()
        fia(q, q_rope, paged_cache(kv_lens, 128, device, seed=11, packed=True), kv_lens)
        fact.measured["standin_copies_of_strided_views"] = [name for name, _ in standin.contiguous_copies]
    fact.detail = ("the split layout (contiguous latent and rope) is what the NPU lowering hands FIA; the strided "
                   "views are what a packed [rows, 576] pool would")
    fact.status = "PASS" if same else "FAIL"


def check_graph_update_names(fact: Fact, device) -> None:
    backend = torch.npu
    new_lens = GRAPH_NEW_KV_LENS
    graph, (out, lse), q, q_rope, cache = _captured_decode(device, fia, seed=13)
    graph.update(cpu_update_input=[{"actual_seq_lengths_kv": new_lens}])
    graph.replay()
    backend.synchronize()
    ok, detail = _attention_matches((out, lse), fia_reference(q, q_rope, cache, new_lens))
    accepted = {"actual_seq_lengths_kv": ok}
    query_lens, tnd_lens, tnd_new = [3, 1, 2], [5, 1, 40], [6, 0, 41]  # captured with lengths >= 1 (§17)
    tq, tq_rope = queries(sum(query_lens), HEADS, device, seed=15)
    graph = backend.NPUGraph()
    fia(tq, tq_rope, cache, tnd_lens, "TND", query_lens)
    with backend.graph(graph, auto_dispatch_capture=True):
        tout, tlse = fia(tq, tq_rope, cache, tnd_lens, "TND", query_lens)
    graph.update(cpu_update_input=[{"actual_seq_lengths": [3, 4, 6], "actual_seq_lengths_kv": tnd_new}])
    graph.replay()
    backend.synchronize()
    want = fia_reference(tq, tq_rope, cache, tnd_new, query_lens)
    accepted["actual_seq_lengths"], _ = _attention_matches((tout, tlse), want)
    try:
        graph.update(cpu_update_input=[{"block_table": cache.table}])
        accepted["block_table (must be refused)"] = "accepted"
    except Exception as exc:
        accepted["block_table (must be refused)"] = f"refused: {str(exc).splitlines()[0][:120]}"
    fact.measured = {**detail, **{k: v for k, v in accepted.items()}}
    refreshed = accepted["actual_seq_lengths_kv"] is True and accepted["actual_seq_lengths"] is True
    fact.status = "PASS" if refreshed else "FAIL"


def _collectives_in_a_graph(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    device = torch.device("npu", rank)
    group = dist.group.WORLD.group_name
    ops = torch.ops._c10d_functional
    x = torch.full((4, 3), float(rank), device=device)
    y = torch.arange(world_size * 2, dtype=torch.float32, device=device) + 100 * rank

    def step():
        gathered = ops.wait_tensor(ops.all_gather_into_tensor(x, world_size, group))
        exchanged = ops.wait_tensor(ops.all_to_all_single(y, [2] * world_size, [2] * world_size, group))
        return gathered, exchanged

    step()
    torch.npu.synchronize()
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        gathered, exchanged = step()
    x.fill_(rank + 10.0)  # new values: the replay must read them
    y.add_(1000.0)
    graph.replay()
    torch.npu.synchronize()
    want_gathered = torch.cat([torch.full((4, 3), r + 10.0) for r in range(world_size)])
    sent = torch.arange(world_size * 2, dtype=torch.float32)[2 * rank: 2 * rank + 2]
    want_exchanged = torch.cat([sent + 100 * r + 1000 for r in range(world_size)])
    return {"all_gather": bool(torch.equal(gathered.cpu(), want_gathered)),
            "all_to_all": bool(torch.equal(exchanged.cpu(), want_exchanged))}


def _on_two_ranks(fact: Fact, check) -> None:
    """`check(rank, world_size) -> {name: bool}` on 2 HCCL ranks: PASS where every value holds."""
    if torch.npu.device_count() < 2:
        fact.detail = "needs 2 NPUs"
        return
    from dcp_compile.runtime.launch import spawn

    results = spawn(check, 2, backend="hccl", timeout=120)
    fact.measured = {f"rank{r}_{k}": v for r, result in enumerate(results) for k, v in result.items()}
    fact.status = "PASS" if all(fact.measured.values()) else "FAIL"


def check_hccl_in_graphs(fact: Fact, device) -> None:
    _on_two_ranks(fact, _collectives_in_a_graph)


def check_torchair_symint_lengths(fact: Fact, device) -> None:
    import importlib.util

    if importlib.util.find_spec("torchair") is None:
        fact.detail = "needs torchair (torch_npu's dynamo back end)"
        return
    import dcp_compile
    from dcp_compile.models.config import preset
    from dcp_compile.models.mla import MLAModel
    from dcp_compile.runtime.batch import RequestTable

    compiles = []
    outs = {}
    for inner in ("torchair", "eager"):
        torch._dynamo.reset()
        model = MLAModel(preset("tiny-512"), 4096, max_requests=4, dtype=torch.bfloat16, page_size=128, device=device)
        dcp = dcp_compile.apply(model, 1, kernels="npu", inner_compile=inner)
        table = RequestTable(4, 512, 4096, 128)
        logits = []
        for step in range(12):  # a prefill, then decode steps whose lengths all change
            tokens = [[1] * 5, [2] * 9, [3]] if step == 0 else [[step % 7 + 1]] * 3
            batch = table.extend_batch([0, 1, 2], tokens, pad_rows=1)
            logits.append(dcp(*batch.to(device).args(), host_metadata=batch.host).cpu())
        outs[inner] = logits
        compiles.append(len(dcp_compile.state(dcp).reports))
    diffs = [float((a.float() - b.float()).abs().max()) for a, b in zip(outs["torchair"], outs["eager"])]
    fact.measured = {"torchair_graphs_compiled": compiles[0], "eager_graphs_compiled": compiles[1],
                     "max_abs_diff_logits": max(diffs)}
    fact.status = "PASS" if compiles[0] <= 2 and max(diffs) <= 5e-2 else "FAIL"


def check_scatter_pa_kv_cache(fact: Fact, device) -> None:
    """npu_scatter_pa_kv_cache, the native KV write, against reference.kv_write: ND ('Norm') and NZ
    ('PA_NZ') caches of 128-row blocks, a slot of -1 (another rank's token, or padding) skipped."""
    from dcp_compile.lowering.npu import native_ops
    from dcp_compile.ops import nz

    generator = torch.Generator().manual_seed(31)
    rows, block = 512, 128
    loc = torch.tensor([0, 3, 130, 131, 257, 0, 300, 501])
    latent = torch.randn(loc.shape[0], LATENT, generator=generator).bfloat16()
    rope = torch.randn(loc.shape[0], ROPE, generator=generator).bfloat16()
    matches = {}
    for kv_format in ("nd", "nz"):
        for rank in range(2):
            want = [torch.randn(rows, dim, generator=generator).bfloat16() for dim in (LATENT, ROPE)]
            if kv_format == "nz":
                want = [nz.from_rows(part, block) for part in want]
            got = [part.to(device) for part in want]
            reference.kv_write(want[0], latent, rope, loc, rank, 2, 1, rope_cache=want[1])
            slots = native_ops.SLOT_MAPPING(loc.to(device), rows, rank, 2, 1)
            native_ops.SCATTER_KV_CACHE(got[0], latent.to(device), rope.to(device), slots, block, got[1])
            matches[f"{kv_format}_rank{rank}"] = all(torch.equal(g.cpu(), w) for g, w in zip(got, want))
    fact.measured = matches
    fact.status = "PASS" if all(matches.values()) else "FAIL"


def _native_step_replays(device, off_device_warnings: list) -> dict:
    """A tiny-512 decode and split-verify step under npu_kernels='native' (dcp_size 1), captured by
    a GraphRunner and replayed: the capture succeeds (every op is device work) and the replays
    give the eager logits."""
    import warnings

    import dcp_compile
    from dcp_compile.models.config import preset
    from dcp_compile.models.mla import MLAModel
    from dcp_compile.runtime.batch import RequestTable
    from dcp_compile.runtime.graph_runner import GraphRunner, NPUGraphs

    config = preset("tiny-512").with_layers(2)
    model = dcp_compile.apply(MLAModel(config, 2048, max_requests=4, dtype=torch.bfloat16, page_size=128,
                                       device=device), 1, kernels="npu")
    eager = dcp_compile.apply(MLAModel(config, 2048, max_requests=4, dtype=torch.bfloat16, page_size=128,
                                       device=device), 1, kernels="npu")
    tables = [RequestTable(4, 512, 2048, 128) for _ in range(2)]
    state = dcp_compile.state(model)
    runner = GraphRunner(model.compiled("gather-q"), buckets=(4,), graphs=NPUGraphs(), host_slot=state.host_slot,
                         watched=state.kv_pool.storage())
    diffs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for table, target in zip(tables, (model, eager)):
            prefill = table.extend_batch([0, 1, 2], [[3] * 15, [4] * 131, [5]], pad_rows=1)
            target(*prefill.to(device).args(), host_metadata=prefill.host)
        for step in range(3):
            for tokens, per_row in (([[1 + step], [2], [3]], 1), ([[1] * 7, [2] * 7, [3] * 7], 7)):
                batches = [table.extend_batch([0, 1, 2], tokens, all_logits=per_row > 1) for table in tables]
                replayed = runner(batches[0], per_row)
                want = eager(*batches[1].to(device).args(), host_metadata=batches[1].host)
                diffs.append(float((replayed.float() - want.float()).abs().max()))
    off_device_warnings.extend(str(w.message)[:160] for w in caught if "fall back" in str(w.message))
    return {"max_abs_diff_logits": max(diffs), "graphs_captured": len(runner.captured)}


def check_native_step_on_device(fact: Fact, device) -> None:
    warned: list[str] = []
    measured = _native_step_replays(device, warned)
    if STANDIN:
        from dcp_compile.testing import npu_emulator

        warned.extend(sorted(npu_emulator.ops_off_device()))
    fact.measured = {**measured, "ops_falling_back_to_the_cpu": warned}
    fact.status = "PASS" if not warned and measured["max_abs_diff_logits"] <= 5e-2 else "FAIL"


def _equal_all_to_all_in_a_graph(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from dcp_compile.lowering.npu import ops as npu_ops

    device = torch.device("npu", rank)
    y = torch.arange(world_size * 2, dtype=torch.float32, device=device).view(world_size, 2) + 100 * rank
    npu_ops.ALL_TO_ALL(y, dist.group.WORLD.group_name)
    torch.npu.synchronize()
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        exchanged = npu_ops.ALL_TO_ALL(y, dist.group.WORLD.group_name)
    y.add_(1000.0)
    graph.replay()
    torch.npu.synchronize()
    want = torch.stack([torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) + 100 * r + 1000
                        for r in range(world_size)])
    return {"all_to_all_no_splits": bool(torch.equal(exchanged.cpu(), want))}


def check_equal_all_to_all_in_graphs(fact: Fact, device) -> None:
    _on_two_ranks(fact, _equal_all_to_all_in_a_graph)


def check_capture_lengths_one(fact: Fact, device) -> None:
    """FIA captured with every KV length 1, then updated to lengths with 0 and long ones: the replay
    gives the updated lengths' attention (out 0 where a length is 0)."""
    lengths = [0, 37, 5, 300]
    graph, (out, lse), q, q_rope, cache = _captured_decode(device, fia, seed=41, capture_lens=[1, 1, 1, 1],
                                                           cache_lens=lengths)
    graph.update(cpu_update_input=[{"actual_seq_lengths_kv": lengths}])
    graph.replay()
    torch.npu.synchronize()
    want_out, want_lse = fia_reference(q, q_rope, cache, lengths)
    live = torch.tensor(lengths) > 0
    ok, detail = _attention_matches((out.cpu()[live], lse.cpu()[live]), (want_out.cpu()[live], want_lse.cpu()[live]))
    empty_out_zero = bool((out.cpu()[~live] == 0).all())
    fact.measured = {**detail, "empty_row_out_zero": empty_out_zero}
    fact.status = "PASS" if ok and empty_out_zero else "FAIL"


FACTS = [
    ("empty-shard-lse", "FIA gives out 0 and lse +inf for a request with kv_len 0 (docs/ascend.md §7.2, inferred; the "
                        "lowering masks such rows by their lengths anyway)", check_empty_shard_lse),
    ("lse-base", "FIA's softmax_lse is the natural-log logsumexp of the scaled scores (§2.3)", check_lse_base),
    ("tnd-more-queries-than-keys", "TND, sparse_mode 0, no mask: every query of a row sees all of its kv_len keys, "
                                   "also with more queries than keys (§6.1, §6.4; the verify prefix split)",
     check_tnd_more_queries_than_keys),
    ("fia-few-heads", "FIA's MLA path serves 1, 2 and 4 query heads (§4.2; SGLang avoids fewer than 8)",
     check_few_heads),
    ("update-all-empty", "npu_attention_update after dcp_npu.split_partials' guard merges a row whose every shard is "
                         "empty to 0 (§7.4, §8)", check_update_all_empty),
    ("block-sizes", "FIA takes block sizes 16 and 128 (§4.5; more under CANN's 2026 tiling check)", check_block_sizes),
    ("strided-keys", "contiguous latent and rope caches give what strided views of packed rows give, without the "
                     "auto-contiguous copy (§11.1)", check_strided_keys),
    ("graph-update-names", "NPUGraph.update(cpu_update_input=...) takes actual_seq_lengths_kv and actual_seq_lengths "
                           "and the replay uses them (§9.3)", check_graph_update_names),
    ("hccl-in-graphs", "HCCL all-gather and all-to-all replay inside a captured NPU graph (§10.3)",
     check_hccl_in_graphs),
    ("torchair-symint-lengths", "torchair with the FIA lengths as SymInt inputs: no recompile per step and the "
                                "values refreshed (§9.4)", check_torchair_symint_lengths),
    ("nz-cache", "FIA v1 and v2 read an NZ latent and rope cache [blocks, 1, D/16, 128, 16], LSE included "
                 "(npu_kv_format='nz'; §11.4, §15.1)", check_nz_cache),
    ("fia-v2-layouts", "FIA v2 in BSND_NBSD and TND_NTD (cumulative actual_seq_qlen) gives out [N, B, S, D] / "
                       "[N, T, D] and the LSE in the input layout (fia_version=2; §15.2)", check_fia_v2_layouts),
    ("masked-verify", "FIA v1 and v2 in BSND with a rank-local causal mask [B, 1, S, W], sparse_mode 0 "
                      "(npu_verify='mask'; §15.3)", check_masked_verify),
    ("v2-graph-update-names", "NPUGraph.update refreshes a captured FIA v2 call's actual_seq_kvlen, by v2's name "
                              "(§9.3, §15.2)", check_v2_graph_update_names),
    ("scatter-pa-kv-cache", "npu_scatter_pa_kv_cache writes ND ('Norm') and NZ ('PA_NZ') 4-D caches at the slots "
                            "and skips a slot of -1 (npu_kernels='native''s KV write; §17)", check_scatter_pa_kv_cache),
    ("native-step-on-device", "every op of a native decode and split-verify step runs on the NPU: no CPU fallback, "
                              "the NPU-graph capture succeeds, the replays equal eager (§16, §17)",
     check_native_step_on_device),
    ("all-to-all-no-splits-in-graphs", "dist.all_to_all_single without split lists (HCCL's AlltoAll) replays inside "
                                       "a captured NPU graph (dcp_npu.all_to_all; §17, §19)",
     check_equal_all_to_all_in_graphs),
    ("capture-lengths-one", "FIA captured with every KV length 1, updated to lengths with 0, gives the updated "
                            "attention and out 0 for the empty rows (§17)", check_capture_lengths_one),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--standin", action="store_true", help="check the stand-ins on the emulated npu device")
    p.add_argument("--plant", default=None, metavar="NAME",
                   help="with --standin: make a stand-in depart from one fact (standin.PLANTS)")
    p.add_argument("--only", default=None, metavar="NAMES", help="comma-separated facts to check (default: all)")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    names = [name for name, _, _ in FACTS]
    args.only = args.only.split(",") if args.only else names
    unknown = sorted(set(args.only) - set(names))
    if unknown:
        p.error(f"unknown facts {unknown}; choose from {names}")
    if args.plant and not args.standin:
        p.error("--plant makes a stand-in deviate: it needs --standin")
    return args


def setup(args) -> torch.device:
    from dcp_compile.testing import npu_standin as standin
    from dcp_compile.runtime import devices

    global STANDIN
    STANDIN = args.standin
    if args.standin:
        if devices.torch_npu_installed():
            raise SystemExit("--standin checks the stand-ins, which are not used where torch_npu is installed")
        os.environ[devices.EMULATOR_ENV] = "1"
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if args.plant:
            if args.plant not in standin.PLANTS:
                raise SystemExit(f"--plant {args.plant}: choose one of {sorted(standin.PLANTS)}")
            os.environ[standin.PLANT_ENV] = args.plant
    elif not devices.torch_npu_installed():
        raise SystemExit("this probe checks real Ascend ops: install torch_npu on an NPU machine, or run --standin")
    devices.require_torch_npu("bench.npu_facts")
    import dcp_compile.lowering.npu as npu_lowering

    npu_lowering.ensure_ops()
    torch.npu.set_device(0)
    return torch.device("npu", 0)


def run(args, argv=None) -> dict:
    result = results.start("npu_facts", argv)
    device = setup(args)
    for name, relies, check in FACTS:
        if name not in args.only:
            continue
        fact = Fact(name, relies)
        try:
            check(fact, device)
        except Exception as exc:  # a fact that errors is not established
            first_line = str(exc).splitlines()[0][:300] if str(exc) else ""
            fact.status, fact.detail = "FAIL", f"{type(exc).__name__}: {first_line}"
            fact.measured["traceback"] = traceback.format_exc(limit=4)[-1200:]
        results.add(result, "facts", asdict(fact))
    result["machine"]["npus"] = torch.npu.device_count()
    statuses = [fact["status"] for fact in results.rows(result, "facts")]
    result["run"].update(mode="standin" if args.standin else "hardware", plant=args.plant,
                         passed=statuses.count("PASS"), failed=statuses.count("FAIL"), skipped=statuses.count("SKIP"))
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args, argv)
    print("\n".join(tables.npu_facts(result)), file=sys.stderr if args.json else sys.stdout)
    if args.out:
        results.write(result, args.out)
    if args.json:
        print(json.dumps(result, default=str))
    return 1 if result["run"]["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
