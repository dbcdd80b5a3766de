"""The decode step's matmuls of a few tokens against a large weight: cuBLAS (torch's F.linear and
einsum, and the transposed product W @ x^T) against the project's Triton skinny matmul
(dcp_compile/lowering/triton/skinny_matmul.py), its default config and the best of a sweep.

    python -m bench.skinny_matmul --out bench/results/skinny_matmul_h200.json

Shapes: one Kimi-K2 layer with 64 heads on one GPU, with q_a/kv_a and gate/up fused as
fuse_projections leaves them, and the absorbed W_UK / W_UV per-head products. Each product is
replayed from a CUDA graph over weights rotated past the L2, so every call reads its weight from
HBM; the fraction is weight bytes over time against the copy rate measured in the same run.
Every variant is checked against an fp32 product before it is timed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

from bench.lib import result as results
from bench.lib.timing import copy_bandwidth, require_cuda, time_graph

HIDDEN, Q_LORA, KV_A, HEADS, QK_NOPE, V_HEAD, R, MLP = 7168, 1536, 576, 64, 128, 128, 512, 2048
SHAPES = {  # name: (batch of weights, K, N); batch 1 is a linear of weight [N, K]
    "q_a+kv_a": (1, HIDDEN, Q_LORA + KV_A),
    "q_b": (1, Q_LORA, HEADS * (QK_NOPE + 64)),
    "o_proj": (1, HEADS * V_HEAD, HIDDEN),
    "gate+up": (1, HIDDEN, 2 * MLP),
    "down": (1, MLP, HIDDEN),
    "w_uk": (HEADS, QK_NOPE, R),  # einsum("thn,hnr->thr")
    "w_uv": (HEADS, R, V_HEAD),   # einsum("thr,hrv->thv")
}


MARGIN = 0.03
"""The table names a config only where it beat cuBLAS by this fraction; elsewhere torch's matmul."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/skinny_matmul.json")
    p.add_argument("--tokens", default="4,16,28,64")
    p.add_argument("--sweep-tokens", default="4,28", help="token counts whose configs are swept (one per row block)")
    p.add_argument("--table", default=None, help="write the best config per (shape, row block) here, in the format "
                   "of dcp_compile/lowering/triton/skinny_configs/")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--replays", type=int, default=15)
    p.add_argument("--budget-s", type=float, default=240.0, help="stop sweeping after this many seconds")
    args = p.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.sweep_tokens = [int(t) for t in args.sweep_tokens.split(",")]
    args.shapes = args.shapes.split(",")
    return args


class Problem:
    """Weights rotated past the L2 and one activation, laid out as the model's graph has them."""

    def __init__(self, name: str, tokens: int, l2_bytes: int):
        self.name, self.tokens = name, tokens
        self.batch, self.k, self.n = SHAPES[name]
        self.weight_bytes = self.batch * self.k * self.n * 2
        copies = max(2, -(-8 * l2_bytes // self.weight_bytes))
        if self.batch == 1:  # a linear's weight [N, K]
            self.weights = [torch.randn(self.n, self.k, device="cuda", dtype=torch.bfloat16) / self.k ** 0.5
                            for _ in range(copies)]
            self.x = torch.randn(tokens, self.k, device="cuda", dtype=torch.bfloat16)
        else:  # per-head [H, K, N]; the activation [T, H, K]
            self.weights = [torch.randn(self.batch, self.k, self.n, device="cuda", dtype=torch.bfloat16) / self.k ** 0.5
                            for _ in range(copies)]
            self.x = torch.randn(tokens, self.batch, self.k, device="cuda", dtype=torch.bfloat16)

    def as_bmm(self, w):
        """(x [B, M, K], w [B, K, N]) views for the skinny kernel, no copies."""
        if self.batch == 1:
            return self.x.unsqueeze(0), w.t().unsqueeze(0)
        return self.x.transpose(0, 1), w

    def out(self):
        shape = (self.tokens, self.n) if self.batch == 1 else (self.tokens, self.batch, self.n)
        return torch.empty(shape, device="cuda", dtype=torch.bfloat16)

    def out_as_bmm(self, out):
        return out.unsqueeze(0) if self.batch == 1 else out.transpose(0, 1)

    def cublas(self, w):
        if self.batch == 1:
            return torch.nn.functional.linear(self.x, w)
        return torch.einsum("thk,hkn->thn", self.x, w)

    def reference(self, w):
        if self.batch == 1:
            return self.x.float() @ w.float().t()
        return torch.einsum("thk,hkn->thn", self.x.float(), w.float())


def relative_error(out, ref) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def configs(problem: Problem, programs: int):
    from dcp_compile.lowering.triton.skinny_matmul import SkinnyConfig

    for block_n, block_k, splits, stages, warps in itertools.product(
            (32, 64, 128), (64, 128, 256), (1, 2, 4, 8, 16), (3, 4), (4, 8)):
        tiles = problem.batch * -(-problem.n // block_n)
        if block_n > max(32, problem.n) or splits * block_k > problem.k:
            continue
        if not programs // 2 <= tiles * splits <= 16 * programs:
            continue
        if stages * (block_k * block_n + 64 * block_k) * 2 > 200 * 1024:
            continue
        yield SkinnyConfig(block_n, block_k, splits, warps, stages)


def main(argv=None) -> int:
    args = parse_args(argv)
    require_cuda("bench.skinny_matmul")
    from dcp_compile.lowering.triton import skinny_matmul as skinny

    torch.manual_seed(0)
    result = results.start("skinny_matmul", argv, torch.device("cuda", 0))
    copy = copy_bandwidth(4.0, 10)
    started = time.time()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    programs = skinny.programs_wanted(torch.device("cuda"))
    rows, table = [], {}
    for name in args.shapes:
        for tokens in args.tokens:
            problem = Problem(name, tokens, l2)
            ref = problem.reference(problem.weights[0])
            row = {"shape": name, "tokens": tokens, "batch": problem.batch, "k": problem.k, "n": problem.n,
                   "weight_bytes": problem.weight_bytes}
            outs = [problem.out() for _ in problem.weights]

            def run_skinny(config):
                def launch(i):
                    x, w = problem.as_bmm(problem.weights[i])
                    skinny.skinny_matmul_into(problem.out_as_bmm(outs[i]), x, w, config)
                outs[0].fill_(float("nan"))
                launch(0)
                error = relative_error(outs[0], ref)
                if not error < 2e-2:
                    raise AssertionError(f"{name} T {tokens} {config}: relative error {error}")
                return time_graph(launch, len(problem.weights), args.replays), error

            row["cublas_seconds"] = time_graph(lambda i: problem.cublas(problem.weights[i]),
                                               len(problem.weights), args.replays)
            row["cublas_error"] = relative_error(problem.cublas(problem.weights[0]), ref)
            if problem.batch == 1:
                row["cublas_transposed_seconds"] = time_graph(
                    lambda i: torch.mm(problem.weights[i], problem.x.t()).t(), len(problem.weights), args.replays)
            default = skinny.choose(tokens, problem.n, problem.k, problem.batch, programs)  # the heuristic, no table
            row["default_config"] = list(default.__dict__.values())
            row["default_seconds"], row["default_error"] = run_skinny(default)
            if tokens in args.sweep_tokens and time.time() - started < args.budget_s:
                best = (row["default_seconds"], default)
                tried = 0
                for config in configs(problem, programs):
                    try:
                        seconds, _ = run_skinny(config)
                    except Exception as error:  # noqa: BLE001 - a config that does not compile (shared memory)
                        print(f"  {config}: {type(error).__name__}: {str(error)[:120]}")
                        continue
                    tried += 1
                    best = min(best, (seconds, config), key=lambda b: b[0])
                row["swept"] = tried
                row["best_seconds"], row["best_config"] = best[0], list(best[1].__dict__.values())
                faster = best[0] < row["cublas_seconds"] * (1 - MARGIN)
                table.setdefault(skinny.shape_key(problem.batch, problem.k, problem.n), {})[
                    str(skinny.block_rows(tokens))] = row["best_config"] if faster else skinny.TORCH_FASTER
            for key in ("cublas", "cublas_transposed", "default", "best"):
                if f"{key}_seconds" in row:
                    row[f"{key}_of_copy"] = problem.weight_bytes / row[f"{key}_seconds"] / copy["bytes_per_s"]
            rows.append(row)
            print(f"{name:>9} T {tokens:>3}: cublas {row['cublas_seconds'] * 1e6:6.1f} us ({row['cublas_of_copy']:.0%})"
                  + (f", W@x^T {row['cublas_transposed_seconds'] * 1e6:6.1f} us ({row['cublas_transposed_of_copy']:.0%})"
                     if "cublas_transposed_seconds" in row else "")
                  + f", skinny {row['default_seconds'] * 1e6:6.1f} us ({row['default_of_copy']:.0%}) {default}"
                  + (f", best {row['best_seconds'] * 1e6:6.1f} us ({row['best_of_copy']:.0%}) {row['best_config']}"
                     f" of {row['swept']}" if "best_seconds" in row else ""), flush=True)
            del problem, outs
            torch.cuda.empty_cache()
    result["run"].update(copy_bytes_per_s=copy["bytes_per_s"], seconds=time.time() - started,
                         config_fields=["block_n", "block_k", "splits", "num_warps", "num_stages"])
    results.add(result, results.MAIN, *rows)
    results.write(result, args.out)
    if args.table:  # dcp_compile/lowering/triton/skinny_configs/'s format
        Path(args.table).write_text(json.dumps({
            "gpu": result["machine"]["gpu"], "source": result["command"], "date": result["date"],
            "fields": result["run"]["config_fields"], "configs": table}, indent=1))
        print(f"wrote {args.table}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
