"""Sweep partial-attention tilings at 128k context on one GPU, to pick the heuristic's choices.

    python -m bench.attention_sweep --out bench/results/attention_sweep.json

Measures each tiling (heads per program, keys per step, warps, stages) at the given head counts
and batches, with the split count the heuristic would pick for that head tile, as a fraction of
the copy bandwidth measured in the same run. Stops starting new tilings after --budget-s.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import time

import torch

from bench.kernels import AttentionBench
from bench.lib import result as results
from bench.lib.timing import copy_bandwidth, require_cuda


def candidates(heads: int):
    for block_h, block_n, warps, stages in itertools.product((32, 64), (32, 64), (4, 8, 16), (2, 3, 4)):
        if block_h <= heads and not (block_h == 64 and warps == 4):
            yield block_h, block_n, warps, stages


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/attention_sweep.json")
    p.add_argument("--heads", default="64,32")
    p.add_argument("--batches", default="4,64")
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--budget-s", type=float, default=200)
    args = p.parse_args(argv)
    require_cuda("bench.attention_sweep")
    import triton

    from dcp_compile.lowering.triton.attention_tiling import AttentionTiling, choose_num_splits, parallel_units

    started = time.monotonic()
    result = results.start("attention_sweep", argv, torch.device("cuda", 0))
    copy = copy_bandwidth(4.0, 10)["bytes_per_s"]
    result["run"].update(copy_bytes_per_s=copy, context=args.context)
    torch.cuda.empty_cache()
    batches = [int(b) for b in args.batches.split(",")]
    bench = AttentionBench(max(batches) * args.context, 60 << 20, 10)
    rows = []
    for heads in [int(h) for h in args.heads.split(",")]:
        for block_h, block_n, warps, stages in candidates(heads):
            if time.monotonic() - started > args.budget_s:
                break
            for batch in batches:
                tiles = triton.cdiv(heads, block_h)
                splits = choose_num_splits(batch * tiles, args.context, parallel_units(torch.device("cuda")))
                tiling = AttentionTiling(splits, block_h, block_n, warps, stages)
                try:
                    row = bench.measure(heads, args.context, batch, tiling)
                    row["fraction_of_copy"] = row["kv_bytes_per_s"] / copy
                except Exception as error:
                    row = {"heads": heads, "batch": batch, "tiling": dataclasses.asdict(tiling),
                           "error": f"{type(error).__name__}: {error}"[:200]}
                rows.append(row)
    best = {}
    for row in rows:
        if "fraction_of_copy" in row:
            key = (row["heads"], row["batch"])
            if key not in best or row["fraction_of_copy"] > best[key]["fraction_of_copy"]:
                best[key] = row
    for (heads, batch), row in sorted(best.items()):
        t = row["tiling"]
        print(f"best heads {heads:3d} batch {batch:3d}: {row['fraction_of_copy']:.1%} of copy with "
              f"block_h {t['block_h']} block_n {t['block_n']} warps {t['num_warps']} stages {t['num_stages']} splits {t['num_splits']}")
    top = sorted((r for r in rows if "fraction_of_copy" in r and r["heads"] == 64), key=lambda r: -r["fraction_of_copy"])[:12]
    for row in top:
        t = row["tiling"]
        print(f"  64 heads batch {row['batch']:3d}: {row['fraction_of_copy']:.1%}  h{t['block_h']} n{t['block_n']} w{t['num_warps']} s{t['num_stages']}")
    results.add(result, results.MAIN, *rows)
    result["run"]["seconds"] = time.monotonic() - started
    results.write(result, args.out)
    print(f"{len(rows)} measurements in {result['run']['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
