"""The projections of one Kimi-K2-shaped decode layer, alone, at the token counts of a decode or
verify step: cuBLAS (torch's default) against inductor's autotuned GEMMs, and the horizontal
fusions a serving engine makes (q_a with kv_a, which read the same hidden state; gate with up).

    python -m bench.decode_gemms --out bench/results/decode_gemms_h200.json

Each GEMM is replayed from a CUDA graph over weights rotated past the L2, so every call reads
its weight from HBM; the fraction is the weight bytes over the time, against the copy rate
measured in the same run (bench.lib.timing).
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.lib import result as results
from bench.lib.timing import copy_bandwidth, require_cuda, time_graph

HIDDEN, Q_LORA, KV_A, HEADS, QK_HEAD, V_HEAD, MLP = 7168, 1536, 576, 64, 192, 128, 2048
GEMMS = {  # name: (out features, in features) of one layer's weights, Kimi-K2 with 64 heads on one GPU
    "q_a": (Q_LORA, HIDDEN), "kv_a": (KV_A, HIDDEN), "q_b": (HEADS * QK_HEAD, Q_LORA),
    "o_proj": (HIDDEN, HEADS * V_HEAD), "gate": (MLP, HIDDEN), "up": (MLP, HIDDEN), "down": (HIDDEN, MLP),
    "q_a+kv_a": (Q_LORA + KV_A, HIDDEN), "gate+up": (2 * MLP, HIDDEN),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/decode_gemms.json")
    p.add_argument("--tokens", default="4,16,28,64")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--no-autotune", action="store_true")
    args = p.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    return args


def time_rotated(fn, inputs: list, replays: int) -> float:
    """Median seconds of fn(*inputs[i]), the rotation replayed from one CUDA graph."""
    return time_graph(lambda i: fn(*inputs[i]), len(inputs), replays)


def main(argv=None) -> int:
    args = parse_args(argv)
    require_cuda("bench.decode_gemms")
    torch.manual_seed(0)
    result = results.start("decode_gemms", argv, torch.device("cuda", 0))
    copy = copy_bandwidth(4.0, 10)
    started = time.time()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    compiled = torch.compile(torch.mm, mode="max-autotune-no-cudagraphs", dynamic=False)
    for name, (n, k) in GEMMS.items():
        weight_bytes = n * k * 2
        copies = max(2, -(-8 * l2 // weight_bytes))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        for tokens in args.tokens:
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
            inputs = [(x, w.t()) for w in weights]
            row = {"gemm": name, "tokens": tokens, "n": n, "k": k, "weight_bytes": weight_bytes}
            row["cublas_seconds"] = time_rotated(torch.mm, inputs, args.replays)
            if not args.no_autotune:
                try:
                    row["autotuned_seconds"] = time_rotated(compiled, inputs, args.replays)
                    torch.testing.assert_close(compiled(x, weights[0].t()), torch.mm(x, weights[0].t()), rtol=2e-2, atol=2e-1)
                except Exception as error:  # noqa: BLE001 - reported
                    row["autotune_error"] = f"{type(error).__name__}: {error}"[:300]
            for key in ("cublas", "autotuned"):
                if f"{key}_seconds" in row:
                    row[f"{key}_of_copy"] = weight_bytes / row[f"{key}_seconds"] / copy["bytes_per_s"]
            rows.append(row)
            print(f"{name:>9} T {tokens:>3}: cublas {row['cublas_seconds'] * 1e6:7.1f} us ({row['cublas_of_copy']:.0%})"
                  + (f", autotuned {row['autotuned_seconds'] * 1e6:7.1f} us ({row['autotuned_of_copy']:.0%})"
                     if "autotuned_seconds" in row else f" {row.get('autotune_error', '')}"), flush=True)
        del weights
        torch.cuda.empty_cache()
    result["run"].update(copy_bytes_per_s=copy["bytes_per_s"], seconds=time.time() - started)
    results.add(result, results.MAIN, *rows)
    for tokens in args.tokens:
        by = {r["gemm"]: r for r in rows if r["tokens"] == tokens}
        for fused, parts in (("q_a+kv_a", ("q_a", "kv_a")), ("gate+up", ("gate", "up"))):
            for key in ("cublas", "autotuned"):
                if all(f"{key}_seconds" in by[g] for g in (fused, *parts)):
                    separate = sum(by[g][f"{key}_seconds"] for g in parts)
                    print(f"T {tokens:>3} {key:>9} {fused}: fused {by[fused][f'{key}_seconds'] * 1e6:6.1f} us, "
                          f"separate {separate * 1e6:6.1f} us")
    results.write(result, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
