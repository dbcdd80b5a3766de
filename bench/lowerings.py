"""Attention over the KV pool per lowering on one GPU: decode and verify, against the copy ceiling
and the roofline floor, side by side in one run.

    python -m bench.lowerings --out bench/results/lowerings_h200.json

Cases: heads x context x batch x k (queries per request; k = 1 is decode, k > 1 verify), Kimi-K2
latent shapes (R = 512, P = 64, bf16), causal over the whole context (DCP = 1 semantics), each
request on random pages of 64 rows of one pool. Lowerings:
  triton      dcp_compile's split-KV kernel (lowering/triton/attention.py), per query
  folded      dcp_compile's folded kernel (lowering/triton/folded_attention.py): a request's k
              queries x heads as the rows of one tile, the Triton back end's verify kernel below
              64 heads (at any head count here)
  flashinfer  FlashInfer's fa3 MLA kernel through dcp_compile's FlashInferPlan, the path the
              FlashInfer lowering runs (page = one local block of 64 rows, causal)
  torch       the reference, at the smallest context only (eager, for scale)
Figures per case: median time over CUDA-graph replays; KV read as a share of the device-to-device
copy bandwidth; the roofline floor, max(FLOPs at the bf16 matmul rate, KV bytes at the copy
rate), both measured in this run, and the share of it reached (floor / time). FLOPs are
2 x (R + P + R) per visible (query head, key) pair. Also: FlashInfer's first run (JIT build or
load), its host plan() time at batch 64, a check that the kernels agree (decode at the largest
case, verify k = 7 at 32k), and with --folded-sweep, the folded kernel's launch choices at one
verify case.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from bench.lib import result as results
from bench.lib import tables
from bench.lib.cases import BLOCK, RANK_DIM, ROPE_DIM, ROW_BYTES, PagedCase
from bench.lib.roofline import attention_flops, floor
from bench.lib.timing import copy_bandwidth, matmul_rate, median_call_seconds, require_cuda, time_graph

L2_SPANS = 4
SWEEP = [(64, 8, 2), (64, 8, 1), (64, 8, 3), (32, 8, 2), (32, 8, 3), (32, 4, 2), (64, 4, 2)]
"""The folded kernel's (keys a step, warps, stages) that --folded-sweep times; the first is its default."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/lowerings.json")
    p.add_argument("--heads", default="32,64")
    p.add_argument("--contexts", default="32768,131072")
    p.add_argument("--batches", default="4,16,64")
    p.add_argument("--ks", default="1,4,7,16")
    p.add_argument("--lowerings", default="triton,folded,flashinfer")
    p.add_argument("--folded-sweep", action="store_true",
                   help="time the folded kernel's tilings at heads x the longest context, batch 4, k = 7")
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=300.0, help="no new case starts after this many seconds")
    args = p.parse_args(argv)
    for name in ("heads", "contexts", "batches", "ks"):
        setattr(args, name, [int(v) for v in getattr(args, name).split(",") if v])
    args.lowerings = [v for v in args.lowerings.split(",") if v]
    return args


def triton_launcher(cases, scale):
    from dcp_compile.lowering.triton import attention

    outs = [(torch.empty_like(c.q_latent), torch.empty(c.q_latent.shape[:2], device="cuda")) for c in cases]

    def launch(i):
        c = cases[i]
        attention.partial_attention_into(c.q_latent, c.q_rope, c.pool, c.page_table, c.seq_lens, c.positions, c.q_seq_ids,
                                         c.q_positions, scale, *outs[i])
    return launch, outs


def folded_launcher(cases, scale, tiling=None):
    from dcp_compile.lowering.triton import attention, folded_attention

    outs = [(torch.empty_like(c.q_latent), torch.empty(c.q_latent.shape[:2], device="cuda")) for c in cases]
    workspaces = [None] * len(cases)
    if tiling is not None:
        workspaces = [attention.split_workspace(c.q_latent.shape[0], tiling.num_splits, c.heads, RANK_DIM, "cuda")
                      for c in cases]

    def launch(i):
        c = cases[i]
        folded_attention.folded_partial_attention_into(c.q_latent, c.q_rope, c.pool, c.page_table, c.seq_lens,
                                                       c.positions, c.q_seq_ids, c.q_positions, scale, *outs[i],
                                                       tiling=tiling, workspace=workspaces[i], fold=True)
    return launch, outs


def flashinfer_launcher(cases, scale):
    from dcp_compile.lowering.flashinfer.plans import FlashInferPlan, PlanSpec

    plans = []
    for c in cases:
        spec = PlanSpec(keys="all", causal=c.k > 1, rows=c.batch, tokens=c.batch * c.k, heads=c.heads, rank_dim=RANK_DIM,
                        rope_dim=ROPE_DIM, block_size=BLOCK, blocks_per_row=c.context // BLOCK, sm_scale=scale,
                        dtype=torch.bfloat16, device=torch.device("cuda"))
        plan = FlashInferPlan(spec)
        plan.plan(c.host())
        plans.append(plan)
    outs = [None] * len(cases)

    def launch(i):
        outs[i] = plans[i].run(cases[i].q_latent, cases[i].q_rope, cases[i].pool)
    return launch, outs, plans


def measure(lowering: str, cases, replays: int, scale: float) -> float:
    if lowering == "triton":
        launch, _ = triton_launcher(cases, scale)
    elif lowering == "folded":
        launch, _ = folded_launcher(cases, scale)
    else:
        launch, _, _ = flashinfer_launcher(cases, scale)
    return time_graph(launch, len(cases), replays)


def agreement(case, scale, lowerings) -> dict:
    """Each kernel against FlashInfer's on one case: max |out| difference over max |out|, max |lse|
    difference."""
    launch_f, outs_f, _ = flashinfer_launcher([case], scale)
    launch_f(0)
    row = {"heads": case.heads, "context": case.context, "batch": case.batch, "k": case.k}
    for name, launcher in (("triton", triton_launcher), ("folded", folded_launcher)):
        if name not in lowerings:
            continue
        launch, outs = launcher([case], scale)
        launch(0)
        torch.cuda.synchronize()
        (out, lse), (out_f, lse_f) = outs[0], outs_f[0]
        row[name] = {"out_rel_diff": float((out.float() - out_f.float()).abs().max() / out_f.float().abs().max()),
                     "lse_abs_diff": float((lse - lse_f).abs().max())}
    return row


def folded_sweep(pool, heads, context, replays, scale) -> list[dict]:
    """The folded kernel's tilings at batch 4, k = 7: keys a step, warps and stages (its row tile
    and split count as chosen)."""
    from dcp_compile.lowering.triton.attention_tiling import AttentionTiling
    from dcp_compile.lowering.triton.folded_attention import choose_folded_tiling

    rows = []
    case = PagedCase(pool, heads, context, 4, 7, seed=13)
    chosen, _ = choose_folded_tiling(4 * 7, 4, heads, context, torch.device("cuda"))
    for block_n, num_warps, num_stages in SWEEP:
        tiling = AttentionTiling(chosen.num_splits, chosen.block_h, block_n, num_warps, num_stages)
        row = {"heads": heads, "context": context, "batch": 4, "k": 7, "tiling": vars(tiling).copy()}
        try:
            launch, _ = folded_launcher([case], scale, tiling)
            row["seconds"] = time_graph(launch, 1, replays)
        except Exception as error:  # noqa: BLE001 - reported (out of shared memory), the sweep goes on
            row["error"] = f"{type(error).__name__}: {error}"[:200]
        rows.append(row)
    return rows


def flashinfer_setup(pool, scale) -> dict:
    """FlashInfer's first plan + run (the JIT build, or a load of the built module), and the
    host time of plan() at batch 64, 128k context."""
    from dcp_compile.lowering.flashinfer.plans import FlashInferPlan, PlanSpec

    started = time.perf_counter()
    small = PagedCase(pool, 32, 4096, 4, 1, seed=1)
    launch, _, _ = flashinfer_launcher([small], scale)
    launch(0)
    torch.cuda.synchronize()
    first = time.perf_counter() - started
    big_pages = 131072 // BLOCK
    if pool.shape[0] // BLOCK < 64 * big_pages + 1:
        return {"first_run_seconds": first}
    big = PagedCase(pool, 32, 131072, 64, 1, seed=2)
    spec = PlanSpec(keys="all", causal=False, rows=64, tokens=64, heads=32, rank_dim=RANK_DIM, rope_dim=ROPE_DIM,
                    block_size=BLOCK, blocks_per_row=big_pages, sm_scale=scale, dtype=torch.bfloat16,
                    device=torch.device("cuda"))
    plan = FlashInferPlan(spec)
    host = big.host()
    seconds = []
    for _ in range(20):
        start = time.perf_counter()
        plan.plan(host)
        seconds.append(time.perf_counter() - start)
    return {"first_run_seconds": first, "plan_host_us_batch64_128k": statistics.median(seconds) * 1e6}


def main(argv=None) -> int:
    args = parse_args(argv)
    require_cuda("bench.lowerings")
    from dcp_compile.lowering import flashinfer

    started = time.monotonic()
    reason = flashinfer.unsupported_reason(torch.device("cuda"), RANK_DIM, ROPE_DIM, torch.bfloat16)
    lowerings = [name for name in args.lowerings if name != "flashinfer" or reason is None]
    result = results.start("lowerings", argv, torch.device("cuda", 0))
    run = result["run"]
    run.update(flashinfer_unavailable=reason, page_rows=BLOCK,
               method="median over CUDA-graph replays; small cases rotate page tables over >= 4 L2 sizes of KV")
    scale = 1 / math.sqrt(192)
    try:
        run["copy"] = copy_bandwidth(4.0, args.replays)
        run["matmul_flops_per_s"] = matmul_rate(args.replays)
        torch.cuda.empty_cache()
        copy, peak = run["copy"]["bytes_per_s"], run["matmul_flops_per_s"]
        l2 = result["machine"]["l2_bytes"] or 50 << 20
        pool_rows = max(args.batches) * max(args.contexts) + 8 * BLOCK
        pool = torch.empty(pool_rows, RANK_DIM + ROPE_DIM, dtype=torch.bfloat16, device="cuda").normal_()
        if "flashinfer" in lowerings:
            run["flashinfer_setup"] = flashinfer_setup(pool, scale)
        for heads in args.heads:
            for context in args.contexts:
                for batch in args.batches:
                    for k in args.ks:
                        row = {"heads": heads, "context": context, "batch": batch, "k": k}
                        if time.monotonic() - started > args.budget_s:
                            results.add(result, results.MAIN, {**row, "skipped": "time budget"})
                            continue
                        kv_bytes = batch * context * ROW_BYTES
                        repeats = max(1, min(8, math.ceil(L2_SPANS * l2 / kv_bytes)))
                        cases = [PagedCase(pool, heads, context, batch, k, seed=s) for s in range(repeats)]
                        flops = attention_flops(heads, cases[0].visible_keys, RANK_DIM, ROPE_DIM)
                        floor_seconds, bound = floor(kv_bytes, flops, copy, peak)
                        row.update(kv_bytes=kv_bytes, flops=flops, floor_seconds=floor_seconds, bound=bound)
                        for lowering in lowerings:
                            try:
                                seconds = measure(lowering, cases, args.replays, scale)
                                row[lowering] = {"seconds": seconds, "fraction_of_copy": kv_bytes / seconds / copy,
                                                 "fraction_of_floor": floor_seconds / seconds}
                            except Exception as error:  # noqa: BLE001 - reported, the run goes on
                                row[lowering] = {"error": f"{type(error).__name__}: {error}"[:300]}
                        results.add(result, results.MAIN, row)
                        del cases
        smallest = min(args.contexts)
        from dcp_compile.ops import reference

        for k in (1, 7):
            case = PagedCase(pool, 32, min(smallest, 8192), 4, k, seed=9)
            seconds = median_call_seconds(lambda: reference.partial_attention(
                case.q_latent, case.q_rope, pool, case.page_table, case.seq_lens, case.positions, case.q_seq_ids,
                case.q_positions, scale), 5)
            results.add(result, "torch_reference", {"heads": 32, "context": case.context, "batch": 4, "k": k,
                                                    "seconds": seconds, "fraction_of_copy": case.kv_bytes / seconds / copy})
        if "flashinfer" in lowerings:
            biggest = PagedCase(pool, max(args.heads), max(args.contexts), max(args.batches), 1, seed=11)
            run["agreement"] = agreement(biggest, scale, lowerings)
            verify = PagedCase(pool, max(args.heads), min(args.contexts), 4, 7, seed=12)
            run["agreement_verify"] = agreement(verify, scale, lowerings)
        if args.folded_sweep:
            for heads in args.heads:
                for row in folded_sweep(pool, heads, max(args.contexts), args.replays, scale):
                    results.add(result, "folded_sweep", row)
    finally:
        run["wall_s"] = time.monotonic() - started
        results.write(result, args.out)
    print("\n".join(tables.lines(result)))
    print(f"\nwrote {args.out} in {run['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
