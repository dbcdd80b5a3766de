"""Compile time against the layer count, with and without compile regions, side by side.

    torchrun --nproc-per-node 2 -m bench.compile_regions --out bench/results/compile_regions_cpu.json   # DCP 2, gloo
    python -m bench.compile_regions --smoke --out /tmp/compile_regions.json                              # checks the script

For each --inner compiler and layer count, the same model (the reference MLA model at --model's
widths, every layer MLA) is applied at DCP = the world size twice: once as it is, once with each
decoder layer a compile region (MLAModel(regions=True), dcp_compile/regions.py). Per case:
  - first_call_seconds: the prefill's first call (dynamo, the DCP passes, the inner compile, the
    step), inductor's caches off so that every case compiles cold;
  - pass_milliseconds: the DCP passes' and the lowering's own time in that compile;
  - step_seconds: the median of --steps decode steps after it (symbolic shapes: no recompile);
  - max_abs_diff: the last decode step's logits against the same model without regions;
  - with --warm, warm_first_call_seconds: the same first call of a fresh model after
    torch._dynamo.reset(), inductor's on-disk caches kept from the cold one and its in-memory ones
    cleared (as a second process finds them, but for Python's warm imports); warm_phases_seconds:
    that call's compile by phase (dynamo's accounting: bytecode_tracing is dynamo's own trace).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import dcp_compile
from bench.lib import result as results
from bench.lib.timing import compile_phases
from dcp_compile.models.config import preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.runtime import parallel
from dcp_compile.runtime.batch import RequestTable
from dcp_compile.runtime.launch import init_from_env

PAGE = 4
PROMPTS = [[1], [2] * 9, [3] * 30, [4] * 2]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/compile_regions_cpu.json")
    p.add_argument("--model", default="tiny")
    p.add_argument("--layers", default="4,16,61")
    p.add_argument("--inner", default="eager,inductor")
    p.add_argument("--kernels", default="torch")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warm", action="store_true", help="also time a warm first call (inductor's caches kept)")
    p.add_argument("--smoke", action="store_true", help="layers 2 and 4, eager: checks the script")
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.inner, args.steps = "2,4", "eager", 2
    args.layers = [int(v) for v in args.layers.split(",") if v]
    args.inner = [v for v in args.inner.split(",") if v]
    return args


def first_call(args, layers: int, inner: str, regions: bool, dcp: int):
    """(the applied model, its request table, the seconds of its first call: a prefill)."""
    torch._dynamo.reset()
    torch._inductor.utils.clear_inductor_caches()  # in-memory: only the on-disk caches carry over
    cfg = preset(args.model).replace(layer_types=("mla",) * layers)
    model = MLAModel(cfg, 4096, max_requests=len(PROMPTS), par=parallel.build(1, 1), page_size=PAGE, regions=regions)
    applied = dcp_compile.apply(model, dcp, kernels=args.kernels, inner_compile=inner)
    table = RequestTable(len(PROMPTS), 256, 4096 * dcp, PAGE)
    batch = table.extend_batch(list(range(len(PROMPTS))), PROMPTS)
    started = time.perf_counter()
    applied(*batch.args(), host_metadata=batch.host)
    return applied, table, time.perf_counter() - started


def run_case(args, layers: int, inner: str, regions: bool, dcp: int) -> tuple[dict, torch.Tensor]:
    warm = None
    if args.warm:  # cold over an empty inductor cache of the case's own, then a fresh model over it
        with tempfile.TemporaryDirectory(prefix="dcp_regions_inductor_") as cache:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
            _, _, cold = first_call(args, layers, inner, regions, dcp)
            compile_phases(clear=True)  # the warm call's own phases only
            applied, table, warm = first_call(args, layers, inner, regions, dcp)
            phases = compile_phases()
    else:  # caches off (main)
        applied, table, cold = first_call(args, layers, inner, regions, dcp)
    reports = [r for backend in dcp_compile.state(applied).backends.values() for r in backend.reports]
    pass_ms = sum(r.milliseconds for report in reports for r in report.records)
    seconds, logits = [], None
    for step in range(args.steps):
        rows = list(range(len(PROMPTS))) if step % 2 == 0 else [0, 2]
        batch = table.extend_batch(rows, [[7 + step]] * len(rows))
        started = time.perf_counter()
        logits = applied(*batch.args(), host_metadata=batch.host)
        seconds.append(time.perf_counter() - started)
    row = {"layers": layers, "inner_compile": inner, "regions": regions, "first_call_seconds": cold,
           "pass_milliseconds": pass_ms, "graphs_compiled": len(reports), "step_seconds": statistics.median(seconds)}
    if warm is not None:
        row["warm_first_call_seconds"] = warm
        row["warm_phases_seconds"] = phases
    return row, logits


def tracing(row: dict) -> float:
    return row["warm_phases_seconds"].get("bytecode_tracing", float("nan"))


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    init_from_env("gloo")
    dcp, rank = dist.get_world_size(), dist.get_rank()
    if not args.warm:
        torch._inductor.config.force_disable_caches = True  # every case compiles cold
    result = results.start("compile_regions", argv, torch.device("cpu"))
    result["run"].update(model=args.model, dcp_size=dcp, kernels=args.kernels, steps=args.steps)
    for inner in args.inner:
        for layers in args.layers:
            plain, want = run_case(args, layers, inner, False, dcp)
            regional, got = run_case(args, layers, inner, True, dcp)
            regional["max_abs_diff"] = float((got - want).abs().max())
            for row in (plain, regional):
                results.add(result, results.MAIN, row)
            if rank == 0:
                print(f"{inner:>8} {layers:>3} layers: first call {plain['first_call_seconds']:6.1f} s -> "
                      f"{regional['first_call_seconds']:6.1f} s with regions (passes {plain['pass_milliseconds']:7.0f} -> "
                      f"{regional['pass_milliseconds']:5.0f} ms), step {plain['step_seconds'] * 1e3:6.1f} -> "
                      f"{regional['step_seconds'] * 1e3:6.1f} ms, logits diff {regional['max_abs_diff']:.1e}", flush=True)
                if args.warm:
                    print(f"{'':>8} {'':>3}         warm first call {plain['warm_first_call_seconds']:6.1f} s -> "
                          f"{regional['warm_first_call_seconds']:6.1f} s with regions (dynamo's bytecode tracing "
                          f"{tracing(plain):.1f} -> {tracing(regional):.1f} s)", flush=True)
    if rank == 0:
        results.write(result, args.out)
        print(f"wrote {args.out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
