"""Triton kernel benchmark on one CUDA GPU, measured against the GPU's own copy bandwidth.

    python -m bench.kernels --out bench/results/kernels.json

Measures, in one run:
  (a) device-to-device copy bandwidth of a ~4 GiB buffer: (bytes read + bytes written) / time;
  (b) split-KV partial attention at Kimi-K2 shapes (R = 512, P = 64, bf16) over heads x context x
      batch: KV bytes read / time, and its fraction of (a). Each batch row has its own page table
      of distinct random rows of one large pool; small cases rotate through several page tables
      inside the timed graph, so no replay finds its KV in L2;
  (c) pack + merge at batch 64, 32 heads per rank, N = 2, next to the torch reference;
  (d) the local metadata build of one decode step at batch 64, context 128k, N = 2.
A short tiling sweep at the longest context follows, within --sweep-budget-s.

Times are medians over replays of a CUDA graph holding `repeats` launches each, divided by
`repeats`, so Python launch overhead is not counted. The table goes to stdout; JSON (GPU,
versions, exact command, every figure) goes to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

import torch

from bench.lib import result as results
from bench.lib import tables
from bench.lib.cases import RANK_DIM, ROPE_DIM, ROW_BYTES
from bench.lib.timing import copy_bandwidth, require_cuda, time_graph

# Launches of a small case rotate over page tables until the KV they touch spans this many L2s.
L2_SPANS = 4
MAX_REPEATS = 32
TARGET_FRACTION_OF_COPY = 0.75
TARGET_PACK_MERGE_US = 10.0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results/kernels.json", help="JSON output path")
    parser.add_argument("--heads", default="16,32,64", help="comma list of query heads per rank")
    parser.add_argument("--contexts", default="8192,32768,131072", help="comma list of context lengths")
    parser.add_argument("--batches", default="1,4,16,64", help="comma list of batch sizes")
    parser.add_argument("--copy-gib", type=float, default=4.0, help="size of the copied buffer, GiB")
    parser.add_argument("--replays", type=int, default=20, help="graph replays per measurement")
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="no new attention case starts after this many seconds")
    parser.add_argument("--sweep-budget-s", type=float, default=40.0, help="time for the tiling sweep")
    args = parser.parse_args(argv)
    for name in ("heads", "contexts", "batches"):
        setattr(args, name, [int(v) for v in getattr(args, name).split(",") if v])
    return args


class AttentionBench:
    """One KV pool for every case; each launch gets its own page tables of random rows."""

    def __init__(self, max_rows: int, l2_bytes: int, replays: int):
        from dcp_compile.lowering.triton import attention

        self.attention, self.replays = attention, replays
        self.l2_bytes = l2_bytes
        self.pool = torch.empty(max_rows, RANK_DIM + ROPE_DIM, dtype=torch.bfloat16, device="cuda").normal_()
        self.generator = torch.Generator(device="cuda").manual_seed(0)

    def repeats(self, kv_bytes: int) -> int:
        return max(1, min(MAX_REPEATS, math.ceil(L2_SPANS * self.l2_bytes / kv_bytes)))

    def inputs(self, heads: int, context: int, batch: int, repeats: int):
        page_tables = [torch.randperm(self.pool.shape[0], generator=self.generator, device="cuda")[:batch * context]
                       .view(batch, context).to(torch.int32) for _ in range(repeats)]
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        positions = torch.arange(context, dtype=torch.int32, device="cuda").repeat(batch, 1)
        gathered = torch.randn(batch, heads, RANK_DIM + ROPE_DIM, generator=self.generator, device="cuda").to(torch.bfloat16)
        q_ids = torch.arange(batch, device="cuda")
        q_positions = torch.full((batch,), context - 1, device="cuda")
        return page_tables, seq_lens, positions, gathered[..., :RANK_DIM], gathered[..., RANK_DIM:], q_ids, q_positions

    def measure(self, heads: int, context: int, batch: int, tiling=None) -> dict:
        attention = self.attention
        from dcp_compile.lowering.triton.attention_tiling import choose_tiling

        kv_bytes = batch * context * ROW_BYTES
        repeats = self.repeats(kv_bytes)
        page_tables, seq_lens, positions, q_latent, q_rope, q_ids, q_positions = self.inputs(heads, context, batch, repeats)
        tiling = tiling or choose_tiling(batch, heads, context, torch.device("cuda"), torch.bfloat16)
        out = torch.empty(q_latent.shape, dtype=q_latent.dtype, device="cuda")
        lse = torch.empty(q_latent.shape[:2], device="cuda")
        workspace = attention.split_workspace(batch, tiling.num_splits, heads, RANK_DIM, "cuda")
        scale = 1 / math.sqrt(RANK_DIM + ROPE_DIM)

        def launch(i):
            attention.partial_attention_into(q_latent, q_rope, self.pool, page_tables[i], seq_lens, positions, q_ids,
                                             q_positions, scale, out, lse, tiling=tiling, workspace=workspace)

        seconds = time_graph(launch, repeats, self.replays)
        return {"heads": heads, "context": context, "batch": batch, "seconds": seconds, "kv_bytes": kv_bytes,
                "kv_bytes_per_s": kv_bytes / seconds, "repeats_per_graph": repeats,
                "tiling": dataclasses.asdict(tiling)}


def sweep_tilings(bench: AttentionBench, heads_list, context: int, batches, default_for, deadline: float) -> list:
    """A few tilings around the default at the longest context, while time remains."""
    from dcp_compile.lowering.triton.attention_tiling import AttentionTiling

    measured = []
    for heads in [h for h in heads_list if h >= 32]:
        for batch in [b for b in batches if 4 <= b <= 16]:
            base = default_for(heads, context, batch)
            variants = [
                AttentionTiling(max(1, base.num_splits // 2), base.block_h, base.block_n, base.num_warps, base.num_stages),
                AttentionTiling(base.num_splits * 2, base.block_h, base.block_n, base.num_warps, base.num_stages),
                AttentionTiling(base.num_splits, base.block_h, 32 if base.block_n != 32 else 16, base.num_warps, base.num_stages),
                AttentionTiling(base.num_splits, base.block_h, base.block_n, base.num_warps, 3 if base.num_stages == 2 else 2),
            ]
            if base.block_h == 64:  # two 32-head tiles that share each KV block through L2
                variants.append(AttentionTiling(base.num_splits, 32, 64, 8, 3))
            for tiling in variants:
                if time.monotonic() > deadline:
                    return measured
                try:
                    measured.append(bench.measure(heads, context, batch, tiling))
                except Exception as error:  # a tiling past the shared-memory or register limit
                    measured.append({"heads": heads, "context": context, "batch": batch,
                                    "tiling": dataclasses.asdict(tiling), "error": f"{type(error).__name__}: {error}"[:300]})
    return measured


def pack_merge(replays: int, batch=64, heads=32, dcp_size=2) -> dict:
    from dcp_compile.ops import reference
    from dcp_compile.lowering.triton import merge, pack

    out = torch.randn(batch, dcp_size * heads, RANK_DIM, device="cuda").to(torch.bfloat16)
    lse = torch.randn(batch, dcp_size * heads, device="cuda")
    lse[:, ::7] = float("-inf")
    packed = torch.empty(dcp_size, batch, heads, RANK_DIM + 2, dtype=torch.bfloat16, device="cuda")
    merged = torch.empty(batch, heads, RANK_DIM, dtype=torch.bfloat16, device="cuda")
    repeats = MAX_REPEATS
    pack_s = time_graph(lambda i: pack.pack_partials_into(out, lse, dcp_size, packed), repeats, replays)
    merge_s = time_graph(lambda i: merge.merge_partials_into(packed, RANK_DIM, merged), repeats, replays)

    def both(i):
        pack.pack_partials_into(out, lse, dcp_size, packed)
        merge.merge_partials_into(packed, RANK_DIM, merged)

    both_s = time_graph(both, repeats, replays)
    reference_s = time_graph(lambda i: reference.merge_partials(reference.pack_partials(out, lse, dcp_size), RANK_DIM),
                             repeats, replays)
    return {"batch": batch, "heads_per_rank": heads, "dcp_size": dcp_size, "pack_us": pack_s * 1e6,
            "merge_us": merge_s * 1e6, "pack_merge_us": both_s * 1e6, "torch_reference_pack_merge_us": reference_s * 1e6,
            "target_us": TARGET_PACK_MERGE_US, "met": both_s * 1e6 <= TARGET_PACK_MERGE_US}


def metadata_build(replays: int, batch=64, context=131072, dcp_size=2) -> dict:
    """Local metadata for one decode step: built once per graph and shared by every layer."""
    from dcp_compile.lowering.triton import metadata_builder

    table = torch.randperm(batch * context * dcp_size, device="cuda")[:batch * context].view(batch, context).to(torch.int32) + 1
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    outputs = (torch.empty_like(table), torch.empty_like(seq_lens), torch.empty_like(table))
    seconds = time_graph(lambda i: metadata_builder.local_metadata_into(table, seq_lens, 0, dcp_size, 1, *outputs),
                         4, replays)
    return {"batch": batch, "context": context, "dcp_size": dcp_size, "us": seconds * 1e6}


def summarise_targets(result: dict) -> list[str]:
    lines = []
    attention = results.rows(result, "attention")
    longest = max((row["context"] for row in attention), default=0)
    for row in attention:
        if "seconds" in row and row["context"] == longest and row["batch"] >= 4 and row["heads"] in (32, 64):
            met = row["fraction_of_copy"] >= TARGET_FRACTION_OF_COPY
            lines.append(f"target KV >= {TARGET_FRACTION_OF_COPY:.0%} of copy, heads {row['heads']}, context {longest}, "
                         f"batch {row['batch']}: {row['fraction_of_copy']:.1%} ({'met' if met else 'not met'})")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    require_cuda("bench.kernels")
    started = time.monotonic()
    result = results.start("kernels", argv, torch.device("cuda", 0))
    result["run"]["method"] = "median over CUDA-graph replays; small cases rotate page tables across >= 4 L2 sizes of KV"
    run = result["run"]
    try:
        run["copy"] = copy_bandwidth(args.copy_gib, args.replays)
        torch.cuda.empty_cache()  # the copy buffers are gone; the KV pool needs the room
        copy = run["copy"]["bytes_per_s"]
        max_rows = max(args.batches) * max(args.contexts)
        bench = AttentionBench(max_rows, result["machine"]["l2_bytes"] or 50 << 20, args.replays)
        for heads in args.heads:
            for context in args.contexts:
                for batch in args.batches:
                    if time.monotonic() - started > args.budget_s:
                        results.add(result, "attention", {"heads": heads, "context": context, "batch": batch,
                                                          "skipped": "time budget"})
                        continue
                    try:
                        row = bench.measure(heads, context, batch)
                        row["fraction_of_copy"] = row["kv_bytes_per_s"] / copy
                    except Exception as error:
                        row = {"heads": heads, "context": context, "batch": batch,
                               "error": f"{type(error).__name__}: {error}"[:300]}
                    results.add(result, "attention", row)
        from dcp_compile.lowering.triton.attention_tiling import choose_tiling

        sweep = sweep_tilings(
            bench, args.heads, max(args.contexts), args.batches,
            lambda h, c, b: choose_tiling(b, h, c, torch.device("cuda"), torch.bfloat16),
            time.monotonic() + args.sweep_budget_s)
        for row in sweep:
            if "seconds" in row:
                row["fraction_of_copy"] = row["kv_bytes_per_s"] / copy
        results.add(result, "sweep", *sweep)
        del bench
        torch.cuda.empty_cache()
        run["pack_merge"] = pack_merge(args.replays)
        run["local_metadata"] = metadata_build(args.replays)
    except Exception as error:
        run["error"] = f"{type(error).__name__}: {error}"
        raise
    finally:
        run["targets"] = summarise_targets(result) if "copy" in run else []
        run["wall_s"] = time.monotonic() - started
        results.write(result, args.out)
    print("\n".join(tables.lines(result)))
    print(f"\nwrote {args.out} in {run['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
