"""Attention over the KV pool per lowering on one GPU: decode and verify, against the copy ceiling
and the roofline floor, side by side in one run.

    python bench/lowerings.py --out bench/results/lowerings_h200.json

Cases: heads x context x batch x k (queries per request; k = 1 is decode, k > 1 verify), Kimi-K2
latent shapes (R = 512, P = 64, bf16), causal over the whole context (DCP = 1 semantics), each
request on random pages of 64 rows of one pool. Lowerings:
  triton      dcp_compile's split-KV kernel (lowering/triton/attention.py)
  flashinfer  FlashInfer's fa3 MLA kernel through dcp_compile's FlashInferPlan, the path the
              FlashInfer lowering runs (page = one local block of 64 rows, causal)
  torch       the reference, at the smallest context only (eager, for scale)
Figures per case: median time over CUDA-graph replays; KV read as a share of the device-to-device
copy bandwidth; the roofline floor, max(FLOPs at the bf16 matmul rate, KV bytes at the copy
rate), both measured in this run, and the share of it reached (floor / time). FLOPs are
2 x (R + P + R) per visible (query head, key) pair. Also: FlashInfer's first run (JIT build or
load), its host plan() time at batch 64, and a check that both kernels agree at the largest case.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernels import copy_bandwidth, require_cuda, time_graph  # noqa: E402

R, P = 512, 64
ROW_BYTES = (R + P) * 2
PAGE = 64
L2_SPANS = 4
TARGETS = {"decode_fraction_of_copy": 0.75, "verify_flashinfer_fraction_of_floor": 0.70,
           "verify_triton_fraction_of_floor": 0.40}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/lowerings.json")
    p.add_argument("--heads", default="32,64")
    p.add_argument("--contexts", default="32768,131072")
    p.add_argument("--batches", default="4,16,64")
    p.add_argument("--ks", default="1,4,7,16")
    p.add_argument("--lowerings", default="triton,flashinfer")
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=300.0, help="no new case starts after this many seconds")
    args = p.parse_args(argv)
    for name in ("heads", "contexts", "batches", "ks"):
        setattr(args, name, [int(v) for v in getattr(args, name).split(",") if v])
    args.lowerings = [v for v in args.lowerings.split(",") if v]
    return args


def matmul_rate(torch, replays: int) -> float:
    """bf16 FLOP/s of an 8192^3 matmul on random data, replayed from a graph."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    seconds = time_graph(torch, lambda i: torch.matmul(a, b, out=c), 4, replays)
    return 2 * 8192**3 / seconds


class Case:
    def __init__(self, torch, pool_pages: int, heads: int, context: int, batch: int, k: int, seed: int):
        self.heads, self.context, self.batch, self.k = heads, context, batch, k
        gen = torch.Generator(device="cuda").manual_seed(seed)
        pages = context // PAGE
        self.block_table = torch.randperm(pool_pages - 1, generator=gen, device="cuda")[: batch * pages].view(batch, pages) + 1
        cols = torch.arange(context, device="cuda")
        self.page_table = (self.block_table[:, cols // PAGE] * PAGE + cols % PAGE).to(torch.int32)
        q = torch.randn(batch * k, heads, R + P, generator=gen, device="cuda").to(torch.bfloat16)
        self.q_latent, self.q_rope = q[..., :R].contiguous(), q[..., R:].contiguous()
        self.q_seq_ids = torch.arange(batch, device="cuda").repeat_interleave(k)
        self.q_positions = (context - k + torch.arange(k, device="cuda")).repeat(batch)
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        self.positions = torch.arange(context, dtype=torch.int32, device="cuda").expand(batch, context)

    @property
    def kv_bytes(self) -> int:
        return self.batch * self.context * ROW_BYTES

    @property
    def flops(self) -> float:
        visible = self.context * self.k - self.k * (self.k - 1) / 2  # per request, summed over its queries
        return 2 * (R + P + R) * self.heads * self.batch * visible

    def host(self):
        from dcp_compile.runtime.host_metadata import RankHostMetadata

        return RankHostMetadata((self.k,) * self.batch, (self.context,) * self.batch, (self.context - self.k,) * self.batch,
                                self.block_table.int().cpu())


def triton_launcher(torch, cases, scale):
    from dcp_compile.lowering.triton import attention

    outs = [(torch.empty_like(c.q_latent), torch.empty(c.q_latent.shape[:2], device="cuda")) for c in cases]

    def launch(i):
        c = cases[i]
        attention.partial_attention_into(c.q_latent, c.q_rope, POOL[0], c.page_table, c.seq_lens, c.positions, c.q_seq_ids,
                                         c.q_positions, scale, *outs[i])
    return launch, outs


def flashinfer_launcher(torch, cases, scale):
    from dcp_compile.lowering.flashinfer.plans import FlashInferPlan, PlanSpec

    plans = []
    for c in cases:
        spec = PlanSpec(keys="all", causal=c.k > 1, rows=c.batch, tokens=c.batch * c.k, heads=c.heads, rank_dim=R,
                        rope_dim=P, block_size=PAGE, blocks_per_row=c.context // PAGE, sm_scale=scale,
                        dtype=torch.bfloat16, device=torch.device("cuda"))
        plan = FlashInferPlan(spec)
        plan.plan(c.host())
        plans.append(plan)
    outs = [None] * len(cases)

    def launch(i):
        outs[i] = plans[i].run(cases[i].q_latent, cases[i].q_rope, POOL[0])
    return launch, outs, plans


POOL: list = []


def measure(torch, lowering: str, cases, replays: int, scale: float) -> float:
    if lowering == "triton":
        launch, _ = triton_launcher(torch, cases, scale)
    else:
        launch, _, _ = flashinfer_launcher(torch, cases, scale)
    return time_graph(torch, launch, len(cases), replays)


def agreement(torch, case, scale) -> dict:
    """Both kernels on one case: max |out| difference over max |out|, max |lse| difference."""
    launch_t, outs_t = triton_launcher(torch, [case], scale)
    launch_f, outs_f, _ = flashinfer_launcher(torch, [case], scale)
    launch_t(0)
    launch_f(0)
    torch.cuda.synchronize()
    (out_t, lse_t), (out_f, lse_f) = outs_t[0], outs_f[0]
    return {"heads": case.heads, "context": case.context, "batch": case.batch, "k": case.k,
            "out_rel_diff": float((out_t.float() - out_f.float()).abs().max() / out_t.float().abs().max()),
            "lse_abs_diff": float((lse_t - lse_f).abs().max())}


def flashinfer_setup(torch, scale) -> dict:
    """FlashInfer's first plan + run (the JIT build, or a load of the built module), and the
    host time of plan() at batch 64, 128k context."""
    from dcp_compile.lowering.flashinfer.plans import FlashInferPlan, PlanSpec

    started = time.perf_counter()
    small = Case(torch, POOL[0].shape[0] // PAGE, 32, 4096, 4, 1, seed=1)
    launch, _, _ = flashinfer_launcher(torch, [small], scale)
    launch(0)
    torch.cuda.synchronize()
    first = time.perf_counter() - started
    big_pages = 131072 // PAGE
    if POOL[0].shape[0] // PAGE < 64 * big_pages + 1:
        return {"first_run_seconds": first}
    big = Case(torch, POOL[0].shape[0] // PAGE, 32, 131072, 64, 1, seed=2)
    spec = PlanSpec(keys="all", causal=False, rows=64, tokens=64, heads=32, rank_dim=R, rope_dim=P, block_size=PAGE,
                    blocks_per_row=big_pages, sm_scale=scale, dtype=torch.bfloat16, device=torch.device("cuda"))
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
    torch = require_cuda()
    import triton

    from dcp_compile.lowering import flashinfer

    started = time.monotonic()
    reason = flashinfer.unsupported_reason(torch.device("cuda"), R, P, torch.bfloat16)
    lowerings = [name for name in args.lowerings if name != "flashinfer" or reason is None]
    properties = torch.cuda.get_device_properties(0)
    result = {
        "gpu": torch.cuda.get_device_name(0), "sm_count": properties.multi_processor_count,
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "flashinfer": None if reason else __import__("flashinfer").__version__, "flashinfer_unavailable": reason,
        "python": platform.python_version(), "command": shlex.join([os.path.basename(sys.executable)] + sys.argv),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "page_rows": PAGE,
        "method": "median over CUDA-graph replays; small cases rotate page tables over >= 4 L2 sizes of KV",
        "cases": [],
    }
    scale = 1 / math.sqrt(192)
    try:
        result["copy"] = copy_bandwidth(torch, 4.0, args.replays)
        result["matmul_flops_per_s"] = matmul_rate(torch, args.replays)
        torch.cuda.empty_cache()
        copy, peak = result["copy"]["bytes_per_s"], result["matmul_flops_per_s"]
        l2 = getattr(properties, "L2_cache_size", 50 << 20)
        pool_rows = max(args.batches) * max(args.contexts) + 8 * PAGE
        POOL.append(torch.empty(pool_rows, R + P, dtype=torch.bfloat16, device="cuda").normal_())
        if "flashinfer" in lowerings:
            result["flashinfer_setup"] = flashinfer_setup(torch, scale)
        for heads in args.heads:
            for context in args.contexts:
                for batch in args.batches:
                    for k in args.ks:
                        row = {"heads": heads, "context": context, "batch": batch, "k": k}
                        if time.monotonic() - started > args.budget_s:
                            result["cases"].append({**row, "skipped": "time budget"})
                            continue
                        kv_bytes = batch * context * ROW_BYTES
                        repeats = max(1, min(8, math.ceil(L2_SPANS * l2 / kv_bytes)))
                        cases = [Case(torch, pool_rows // PAGE, heads, context, batch, k, seed=s) for s in range(repeats)]
                        floor = max(cases[0].flops / peak, kv_bytes / copy)
                        row.update(kv_bytes=kv_bytes, flops=cases[0].flops, floor_seconds=floor,
                                   bound="compute" if cases[0].flops / peak > kv_bytes / copy else "memory")
                        for lowering in lowerings:
                            try:
                                seconds = measure(torch, lowering, cases, args.replays, scale)
                                row[lowering] = {"seconds": seconds, "fraction_of_copy": kv_bytes / seconds / copy,
                                                 "fraction_of_floor": floor / seconds}
                            except Exception as error:  # noqa: BLE001 - reported, the run goes on
                                row[lowering] = {"error": f"{type(error).__name__}: {error}"[:300]}
                        result["cases"].append(row)
                        del cases
        smallest = min(args.contexts)
        for k in (1, 7):
            case = Case(torch, pool_rows // PAGE, 32, min(smallest, 8192), 4, k, seed=9)
            from dcp_compile.ops import reference

            from decode import median_call_seconds

            seconds = median_call_seconds(lambda: reference.partial_attention(
                case.q_latent, case.q_rope, POOL[0], case.page_table, case.seq_lens, case.positions, case.q_seq_ids,
                case.q_positions, scale), 5)
            result.setdefault("torch_reference", []).append(
                {"heads": 32, "context": case.context, "batch": 4, "k": k, "seconds": seconds,
                 "fraction_of_copy": case.kv_bytes / seconds / copy})
        if "flashinfer" in lowerings:
            biggest = Case(torch, pool_rows // PAGE, max(args.heads), max(args.contexts), max(args.batches), 1, seed=11)
            result["agreement"] = agreement(torch, biggest, scale)
    finally:
        result["wall_s"] = time.monotonic() - started
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    print_table(result)
    print(f"\nwrote {args.out} in {result['wall_s']:.0f} s")
    return 0


def print_table(result: dict) -> None:
    copy = result.get("copy", {}).get("bytes_per_s", 0)
    print(f"\n{result['gpu']}: copy {copy / 1e12:.2f} TB/s, bf16 matmul {result.get('matmul_flops_per_s', 0) / 1e12:.0f} TFLOP/s; "
          f"flashinfer {result['flashinfer'] or result['flashinfer_unavailable']}")
    if "flashinfer_setup" in result:
        print("flashinfer setup:", {k: round(v, 1) for k, v in result["flashinfer_setup"].items()})
    print(f"{'heads':>5} {'ctx':>7} {'batch':>5} {'k':>3} {'bound':>7} {'floor us':>9} | "
          + " | ".join(f"{name + ' us':>14} {'%copy':>6} {'%floor':>6}" for name in ("triton", "flashinfer")))
    for row in result["cases"]:
        head = f"{row['heads']:>5} {row['context']:>7} {row['batch']:>5} {row['k']:>3}"
        if "skipped" in row:
            print(head, row["skipped"])
            continue
        cells = []
        for name in ("triton", "flashinfer"):
            cell = row.get(name)
            if cell is None or "error" in cell:
                cells.append(f"{(cell or {}).get('error', '-')[:28]:>28}")
            else:
                cells.append(f"{cell['seconds'] * 1e6:>14.1f} {cell['fraction_of_copy']:>6.1%} {cell['fraction_of_floor']:>6.1%}")
        print(f"{head} {row['bound']:>7} {row['floor_seconds'] * 1e6:>9.1f} | " + " | ".join(cells))
    for row in result.get("torch_reference", []):
        print(f"torch reference, 32 heads, ctx {row['context']}, batch 4, k {row['k']}: {row['seconds'] * 1e6:.0f} us "
              f"({row['fraction_of_copy']:.1%} of copy)")
    if "agreement" in result:
        print("triton vs flashinfer at the largest case:", result["agreement"])


if __name__ == "__main__":
    sys.exit(main())
