"""Pass-pipeline speed on the Kimi-K2 decode graph, captured with shapes only.

For each DCP size (TP = DCP) and layer count, the graph is captured once with meta weights and a
fake process group (dcp_compile.debug.fake_capture, as `dcp-compile dump` does), then the whole
default pass pipeline runs on fresh copies of it `--repeats` times. Reported per configuration:
the median wall time of PassManager.run (all passes, plus the manager's own op counting and
recompiles), the median of each pass, nodes before and after, and MLA sites rewritten.

Goal: under 1 s for all passes at 61 layers, and linear in the number of layers (a least-squares
line through the layer counts, with its R^2, and the cost per layer at each size).

    python -m bench.pass_pipeline                     # 8, 16, 32, 61 layers at DCP 2 and 8
    python -m bench.pass_pipeline --profile           # also: where the time goes at 61 layers
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import gc
import io
import os
import pstats
import statistics
import time
from pathlib import Path

from rich.console import Console

from bench.lib import result as results
from bench.lib import tables
from dcp_compile.debug.fake_capture import CapturedGraph, GraphSpec, capture
from dcp_compile.passes.manager import PassManager

GOAL_SECONDS = 1.0
RESULTS = Path(__file__).parent / "results" / "pass_pipeline.json"


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def time_pipeline(captured: CapturedGraph, repeats: int) -> dict:
    walls, per_pass, report = [], {}, None
    for _ in range(repeats):
        graph = copy.deepcopy(captured.gm)
        gc.collect()
        start = time.perf_counter()
        report = PassManager(captured.pass_config()).run(graph)
        walls.append(time.perf_counter() - start)
        for record in report.records:
            per_pass.setdefault(record.name, []).append(record.milliseconds)
    first, last = report.records[0], report.records[-1]
    return {
        "median_ms": statistics.median(walls) * 1e3,
        "min_ms": min(walls) * 1e3,
        "max_ms": max(walls) * 1e3,
        "runs_ms": [round(w * 1e3, 1) for w in walls],
        "pass_median_ms": {name: round(statistics.median(ms), 2) for name, ms in per_pass.items()},
        "nodes_before": first.nodes_before,
        "nodes_after": last.nodes_after,
        "mla_sites_rewritten": report.sites("gather_q_attention") + report.sites("gather_kv_attention"),
    }


def linear_fit(points: list[tuple[int, float]]) -> dict:
    """Least-squares ms = intercept + slope * layers, with R^2."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    intercept = mean_y - slope * mean_x
    total = sum((y - mean_y) ** 2 for y in ys)
    residual = sum((y - intercept - slope * x) ** 2 for x, y in points)
    return {"ms_per_layer": round(slope, 3), "intercept_ms": round(intercept, 2),
            "r_squared": round(1 - residual / total, 4) if total else 1.0}


def profile_top(captured: CapturedGraph, lines: int = 25) -> str:
    graph = copy.deepcopy(captured.gm)
    profiler = cProfile.Profile()
    profiler.enable()
    PassManager(captured.pass_config()).run(graph)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(lines)
    return out.getvalue()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="kimi-k2")
    parser.add_argument("--layers", type=_ints, default=[8, 16, 32, 61], help="comma list (default 8,16,32,61)")
    parser.add_argument("--dcp", type=_ints, default=[2, 8], help="comma list of DCP sizes, TP = DCP (default 2,8)")
    parser.add_argument("--repeats", type=int, default=5, help="pipeline runs per configuration (median)")
    parser.add_argument("--batch", type=int, default=4, help="decode requests (default 4)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--profile", action="store_true", help="print a cProfile of one run at the largest size")
    args = parser.parse_args(argv)

    console = Console(width=max(Console().width, 120))
    result = results.start("pass_pipeline", argv)
    result["machine"]["load_average_1_5_15_before"] = [round(v, 2) for v in os.getloadavg()]
    rows = []
    for dcp in args.dcp:
        for layers in args.layers:
            spec = GraphSpec(model=args.model, layers=layers, dcp_size=dcp, tp_size=dcp, mode="decode", batch=args.batch)
            captured = capture(spec)
            timing = time_pipeline(captured, args.repeats)
            rows.append({"dcp_size": dcp, "tp_size": dcp, "layers": layers,
                         "capture_seconds": round(captured.seconds, 2), **timing})
            console.print(f"DCP {dcp} x TP {dcp}, {layers} layers: {timing['median_ms']:.0f} ms "
                          f"(capture {captured.seconds:.1f} s)")
            if args.profile and dcp == args.dcp[-1] and layers == max(args.layers):
                console.print(profile_top(captured))
            del captured
    result["machine"]["load_average_1_5_15_after"] = [round(v, 2) for v in os.getloadavg()]
    fits = {str(dcp): linear_fit([(r["layers"], r["median_ms"]) for r in rows if r["dcp_size"] == dcp])
            for dcp in args.dcp}
    largest = max(args.layers)
    goal = {}
    for dcp in args.dcp:
        at_largest = next(r for r in rows if r["dcp_size"] == dcp and r["layers"] == largest)
        goal[str(dcp)] = {"layers": largest, "median_ms": round(at_largest["median_ms"], 1),
                          "under_1s": at_largest["median_ms"] < GOAL_SECONDS * 1e3}
    result["run"].update(model=args.model, mode="decode", batch=args.batch, repeats=args.repeats,
                         metric="wall time of PassManager.run over the default pipeline on a fresh copy of the graph",
                         goal={"seconds": GOAL_SECONDS, "per_dcp": goal}, linear_fit=fits)
    results.add(result, results.MAIN, *[{k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()}
                                        for r in rows])
    print("\n".join(tables.pass_pipeline(result)))
    results.write(result, args.out)
    console.print(f"wrote {args.out}")
    return 0 if all(g["under_1s"] for g in goal.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
