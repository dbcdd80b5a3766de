"""What the verify window costs FlashInfer under DCP, measured on one GPU at DCP = 1 semantics.

    python -m bench.verify_window --out bench/results/verify_window_h200.json

Under DCP a verify row's keys at or after its first query lie on several ranks, interleaved, so
FlashInfer's causal mask (queries aligned to the end of the rank's keys) is wrong there, and its
MLA wrapper takes no other mask. The FlashInfer lowering therefore plans the keys before each
row's first query without a mask and adds the <= 16 keys after it with the Triton window kernel,
merged by LSE (docs/paged-lowerings.md). This bench prices that split on one GPU, every key on
the one rank, so that the variants compute the same attention:

  causal   FlashInfer over every key, its causal mask (what DCP = 1 runs)
  prefix   FlashInfer over the keys before each row's first query, no mask (alone, for scale)
  split    prefix, then dcp.window_attention's kernel, which merges its keys into prefix's result
           (what DCP > 1 runs today, per rank)
  overlap  prefix on the main stream while the window kernel runs alone on a side stream, then
           one fused two-way LSE merge (inductor): the window off the critical path
  window   the window kernel alone (a zero prefix), for scale

Cases: heads x context x batch, k queries a request (Kimi-K2 latent shapes, bf16, pages of 64
rows, random pages), CUDA-graph replays, medians. Each variant's output is checked against
`causal` (max |diff| over max |out|) before it is timed.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from bench.lib import result as results
from bench.lib.cases import BLOCK, RANK_DIM, ROPE_DIM, PagedCase
from bench.lib.timing import require_cuda, time_graph

WINDOW = 16
VARIANTS = ("causal", "prefix", "split", "overlap", "window")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/verify_window.json")
    p.add_argument("--heads", default="64")
    p.add_argument("--contexts", default="32768,131072")
    p.add_argument("--batches", default="4,16")
    p.add_argument("--k", type=int, default=7, help="queries a request")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--repeats", type=int, default=4, help="steps per captured graph, each on its own page tables")
    args = p.parse_args(argv)
    for name in ("heads", "contexts", "batches"):
        setattr(args, name, [int(v) for v in getattr(args, name).split(",") if v])
    return args


def merge_two(out_a, lse_a, out_b, lse_b):
    """Two partial attentions of the same queries over disjoint keys, merged by LSE: the
    reference merge (what dcp.merge_partials computes), compiled by inductor into one kernel."""
    from dcp_compile.ops.reference import merge_lse

    return merge_lse(torch.stack([out_a, out_b]), torch.stack([lse_a, lse_b]))[0]


class Variants:
    """The launches of every variant for a list of cases (one graph step each)."""

    def __init__(self, cases, scale):
        from dcp_compile.lowering.flashinfer.plans import FlashInferPlan, PlanSpec
        from dcp_compile.lowering.triton import window

        self.cases, self.scale, self.window = cases, scale, window
        self.plans = {}
        for keys, causal in (("all", True), ("prefix", False)):
            for i, c in enumerate(cases):
                spec = PlanSpec(keys=keys, causal=causal, rows=c.batch, tokens=c.batch * c.k, heads=c.heads, rank_dim=RANK_DIM,
                                rope_dim=ROPE_DIM, block_size=BLOCK, blocks_per_row=c.context // BLOCK, sm_scale=scale,
                                dtype=torch.bfloat16, device=torch.device("cuda"))
                plan = FlashInferPlan(spec)
                plan.plan(c.host())
                self.plans[keys, i] = plan
        first = cases[0]
        self.zero_out = torch.zeros_like(first.q_latent)
        self.zero_lse = torch.full(first.q_latent.shape[:2], float("-inf"), device="cuda")
        self.side = torch.cuda.Stream()
        self.merge = torch.compile(merge_two, dynamic=False)
        self.results = {}

    def _window(self, c, out, lse):
        return self.window.window_attention(out, lse, c.q_latent, c.q_rope, c.pool, c.page_table, c.seq_lens, c.positions,
                                            c.q_seq_ids, c.q_positions, self.scale, WINDOW)

    def launch(self, variant: str, i: int):
        c = self.cases[i]
        if variant == "causal":
            result = self.plans["all", i].run(c.q_latent, c.q_rope, c.pool)
        elif variant == "prefix":
            result = self.plans["prefix", i].run(c.q_latent, c.q_rope, c.pool)
        elif variant == "split":
            result = self._window(c, *self.plans["prefix", i].run(c.q_latent, c.q_rope, c.pool))
        elif variant == "window":
            result = self._window(c, self.zero_out, self.zero_lse)
        elif variant == "overlap":
            main = torch.cuda.current_stream()
            self.side.wait_stream(main)
            with torch.cuda.stream(self.side):
                window_out, window_lse = self._window(c, self.zero_out, self.zero_lse)
            prefix_out, prefix_lse = self.plans["prefix", i].run(c.q_latent, c.q_rope, c.pool)
            main.wait_stream(self.side)
            result = (self.merge(prefix_out, prefix_lse, window_out, window_lse), None)
        else:
            raise ValueError(variant)
        self.results[variant, i] = result


def main(argv=None) -> int:
    args = parse_args(argv)
    require_cuda("bench.verify_window")
    from dcp_compile.lowering import flashinfer

    reason = flashinfer.unsupported_reason(torch.device("cuda"), RANK_DIM, ROPE_DIM, torch.bfloat16)
    if reason:
        raise SystemExit(f"FlashInfer is needed: {reason}")
    started = time.monotonic()
    scale = 1 / math.sqrt(192)
    result = results.start("verify_window", argv, torch.device("cuda", 0))
    result["run"].update(page_rows=BLOCK, window=WINDOW, k=args.k,
                         method="median over CUDA-graph replays of --repeats steps on their own page tables")
    pool_rows = args.repeats * max(args.batches) * max(args.contexts) + 8 * BLOCK
    pool = torch.empty(pool_rows, RANK_DIM + ROPE_DIM, dtype=torch.bfloat16, device="cuda").normal_()
    for heads in args.heads:
        for context in args.contexts:
            for batch in args.batches:
                cases = [PagedCase(pool, heads, context, batch, args.k, seed=s) for s in range(args.repeats)]
                variants = Variants(cases, scale)
                row = {"heads": heads, "context": context, "batch": batch, "k": args.k}
                for variant in VARIANTS:
                    variants.launch(variant, 0)
                torch.cuda.synchronize()
                reference = variants.results["causal", 0][0].float()
                for variant in ("split", "overlap"):
                    diff = (variants.results[variant, 0][0].float() - reference).abs().max() / reference.abs().max()
                    row[f"{variant}_rel_diff"] = float(diff)
                for variant in VARIANTS:
                    row[f"{variant}_us"] = time_graph(lambda i, v=variant: variants.launch(v, i), len(cases),
                                                      args.replays) * 1e6
                row["window_cost_us"] = row["split_us"] - row["prefix_us"]
                row["split_over_causal"] = row["split_us"] / row["causal_us"]
                row["overlap_over_causal"] = row["overlap_us"] / row["causal_us"]
                results.add(result, results.MAIN, row)
                print(f"heads {heads} ctx {context:>6} batch {batch:>2} k {args.k}: " + "  ".join(
                    f"{v} {row[f'{v}_us']:.1f}" for v in VARIANTS)
                    + f"  us; split/causal {row['split_over_causal']:.3f} overlap/causal {row['overlap_over_causal']:.3f}"
                    + f"  diffs {row['split_rel_diff']:.1e} {row['overlap_rel_diff']:.1e}", flush=True)
                del variants, cases
    result["run"]["wall_s"] = time.monotonic() - started
    results.write(result, args.out)
    print(f"wrote {args.out} in {result['run']['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
