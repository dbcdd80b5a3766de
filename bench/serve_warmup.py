"""Serving warm-up on one GPU: compile once, capture a device graph for every batch size, replay
each and check it.

    torchrun --nproc-per-node 1 -m bench.serve_warmup --out bench/results/serve_warmup_h200.json
    python -m bench.serve_warmup --smoke --out /tmp/serve_warmup.json   # CPU, 2 tiny layers: checks the script

The model is bench.step's 61-layer Kimi-K2-shaped stack at DCP 1 (64 heads, R 512, P 64, real
attention weights, a 2048-wide MLP, bf16; its layers share one KV buffer), applied with
--kernels and --inner-compile. Its steps run through a GraphRunner over
`DCPModel.compiled("gather-q", symbolic=True)`: one compile for every batch size. For decode at
--decode-sizes and verify k = --draft at --verify-sizes, every request --context long,
largest size first (as vLLM captures): the compile's size hints are its first call's sizes, and
inductor's fusion at a hint of 1 row can treat a batch dimension as 1 (on an H100 with torch 2.11,
a size-1-first compile failed in inductor's codegen: "CantSplit: 7168 not divisible by 7168*s72"):
  - capture_seconds, per size: its first step (the capture, and for the first size of a kind
    the compile too);
  - compile_seconds: the first (largest) decode size's (cold: an empty inductor cache for this run);
    warm_compile_seconds: the same in a second process with the caches kept;
  - ready_seconds: from the first compile until every size is captured;
  - recompiles: graphs the captures compiled after the first size of each kind (decode,
    verify); a size of 1 first gets one of its own where dynamo specialises it;
  - max_abs_diff, per size: the replay's logits against the same step called outside the graph;
  - step_seconds, per size: the median replayed step (the runner's host work included).
Targets (issue 35): cold compile <= 60 s, warm <= 10 s, each capture <= 3 s, every size ready in
<= 120 s, no recompile. A kind of step that fails is kept in the result (`failures`, its error)
and the other kind still runs; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import dcp_compile
from bench.lib import result as results
from bench.lib.cases import fill_random, host_metadata, page_size, shared_kv_allocate, stack_batch
from bench.lib.timing import compile_phases, require_cuda
from bench.step import fresh_inductor_cache, model_config
from dcp_compile.models.mla import MLAModel
from dcp_compile.runtime import parallel
from dcp_compile.runtime.graph_runner import CudaGraphs, GraphRunner
from dcp_compile.runtime.kv_pool import MLAKVPool
from dcp_compile.runtime.launch import free_port, init_from_env

TARGETS = {"compile_seconds": 60.0, "warm_compile_seconds": 10.0, "capture_seconds": 3.0, "ready_seconds": 120.0}
TOLERANCE = 1e-2
"""bf16 logits of a replay against the same compiled step outside the graph: the same kernels on the
same inputs (differences come only from a graph that reads stale inputs)."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/serve_warmup.json")
    p.add_argument("--kernels", default="flashinfer")
    p.add_argument("--inner-compile", default="inductor")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--decode-sizes", default="1,2,4,8,16,32,64")
    p.add_argument("--verify-sizes", default="1,4,16,64")
    p.add_argument("--draft", type=int, default=7)
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--regions", action="store_true",
                   help="each decoder layer a compile region (MLAModel(regions=True)): passes and inner compile once")
    p.add_argument("--no-warm", action="store_true", help="skip the second process's warm compile")
    p.add_argument("--warm-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--smoke", action="store_true", help="CPU, 2 tiny layers, torch kernels: checks the script")
    args = p.parse_args(argv)
    args.decode_sizes = [int(v) for v in args.decode_sizes.split(",") if v]
    args.verify_sizes = [int(v) for v in args.verify_sizes.split(",") if v]
    if args.smoke:
        args.kernels, args.inner_compile, args.context, args.layers, args.replays = "torch", "eager", 64, 2, 2
        args.decode_sizes, args.verify_sizes, args.draft = [1, 2, 4], [1, 2], 3
    return args


def capture_order(sizes: list[int]) -> list[int]:
    return sorted(sizes, reverse=True)


def kinds(args) -> list[tuple[str, int, list[int]]]:
    return [("decode", 1, args.decode_sizes), ("verify", args.draft, args.verify_sizes)]


def build(args, device):
    cfg = model_config(args)
    largest = max(args.decode_sizes + args.verify_sizes)
    model = MLAModel(cfg, kv_capacity=largest * args.context + 2 * page_size(1), max_requests=largest,
                     par=parallel.build(1, 1), dtype=torch.bfloat16, device=device, page_size=page_size(1),
                     regions=args.regions)
    compiled = dcp_compile.apply(model, 1, attention_strategy="gather-q", kv_keep="capacity", kernels=args.kernels,
                                 inner_compile=args.inner_compile)
    fill_random(model.kv_pool.cache(0))
    return cfg, compiled


def graphs_of(device):
    if device.type == "cuda":
        return CudaGraphs()
    from dcp_compile.testing.graphs import RerunGraphs

    return RerunGraphs()


def batch_of(args, size: int, k: int, device):
    batch = stack_batch(size, args.context, k, 1, device, args.context)
    batch.host = host_metadata(size, args.context, k, 1, args.context).bind(*batch.args())
    return batch


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compiled_graphs(compiled) -> int:
    return len(dcp_compile.state(compiled).backends["gather-q"].reports)


def first_ready_seconds(args, device) -> float:
    """Seconds from a fresh model to its first decode size captured (the warm child's measure)."""
    _, compiled = build(args, device)
    runner = GraphRunner(compiled.compiled("gather-q", symbolic=True), buckets=args.decode_sizes,
                         graphs=graphs_of(device), host_slot=dcp_compile.state(compiled).host_slot)
    batch = batch_of(args, capture_order(args.decode_sizes)[0], 1, device)
    started = time.perf_counter()
    runner(batch, 1)
    sync(device)
    return time.perf_counter() - started


def replayed_seconds(runner, batch, k: int, replays: int, device) -> float:
    """Median seconds of one replayed step, host work included."""
    seconds = []
    for _ in range(replays):
        sync(device)
        started = time.perf_counter()
        runner(batch, k)
        sync(device)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def child_env() -> dict[str, str]:
    """The warm child's environment: a world of one of its own, on a free port. Not torchrun's: a
    child that inherits TORCHELASTIC_USE_AGENT_STORE joins as a client of a store that nobody
    serves on its port, and waits (it hung a GPU run past its limit)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("TORCHELASTIC_")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               LOCAL_WORLD_SIZE="1")
    return env


def warm_compile(args) -> dict:
    """The first-ready seconds of a second process, inductor's on-disk caches kept, and its
    compile's seconds by phase."""
    command = [sys.executable, "-m", "bench.serve_warmup", "--warm-child", "--out", os.devnull,
               "--kernels", args.kernels, "--inner-compile", args.inner_compile, "--context", str(args.context),
               "--layers", str(args.layers), "--decode-sizes", ",".join(map(str, args.decode_sizes)),
               "--verify-sizes", ",".join(map(str, args.verify_sizes)), "--draft", str(args.draft)]
    if args.regions:
        command.append("--regions")
    if args.smoke:
        command.append("--smoke")
    done = subprocess.run(command, check=True, capture_output=True, text=True, env=child_env(), timeout=900)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(args, device, result: dict) -> None:
    cfg, compiled = build(args, device)
    state = dcp_compile.state(compiled)
    result["run"].update(shapes={"model": "tiny-512" if args.smoke else "kimi-k2", "layers": cfg.num_layers,
                                 "heads": cfg.num_heads, "kv_lora_rank": cfg.kv_lora_rank,
                                 "rope_dim": cfg.qk_rope_head_dim, "dtype": "bfloat16", "context": args.context,
                                 "draft": args.draft},
                         kernels=args.kernels, inner_compile=args.inner_compile, regions=args.regions,
                         inductor_cache_dir_set=bool(os.environ.get("TORCHINDUCTOR_CACHE_DIR")))
    started = time.perf_counter()
    recompiles, failures = 0, []
    for kind, k, sizes in kinds(args):
        try:
            recompiles += run_kind(args, compiled, state, kind, k, sizes, device, result)
        except Exception as exc:  # noqa: BLE001 - kept in the result: a device call is too dear to lose the other kind
            failures.append({"kind": kind, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            print(f"{kind} failed: {type(exc).__name__}: {str(exc)[:500]}", flush=True)
    run_row = result["run"]
    measured = results.rows(result)
    run_row.update(compile_seconds=measured[0]["capture_seconds"] if measured else None,
                   ready_seconds=time.perf_counter() - started, recompiles=recompiles, failures=failures)


def run_kind(args, compiled, state, kind: str, k: int, sizes: list[int], device, result: dict) -> int:
    """Capture, check and time every size of one kind of step, largest first; returns its
    recompiles (graphs compiled after its first size)."""
    recompiles = 0
    runner = GraphRunner(compiled.compiled("gather-q", symbolic=True), buckets=sizes, graphs=graphs_of(device),
                         host_slot=state.host_slot)
    step = compiled.compiled("gather-q", symbolic=True)
    for i, size in enumerate(capture_order(sizes)):
        batch = batch_of(args, size, k, device)
        graphs_before = compiled_graphs(compiled)
        sync(device)
        captured_at = time.perf_counter()
        got = runner(batch, k)
        sync(device)
        row = {"kind": kind, "k": k, "batch": size, "context": args.context,
               "capture_seconds": time.perf_counter() - captured_at,
               "graphs_compiled": compiled_graphs(compiled) - graphs_before}
        if i:  # the first size of a kind compiles; a later one that does is a recompile
            recompiles += row["graphs_compiled"]
        # The reference: the same compiled step called outside the graph (on the batch's own
        # tensors, whose dtypes may differ from the runner's buffers: a graph of its own).
        state.host_slot.begin(batch.host)
        try:
            want = step(*batch.args())
        finally:
            state.host_slot.end()
        row["max_abs_diff"] = float((got.float() - want[: got.shape[0]].float()).abs().max())
        row["step_seconds"] = replayed_seconds(runner, batch, k, args.replays, device)
        results.add(result, results.MAIN, row)
        print(f"{kind:>6} k {k} batch {size:>3}: capture {row['capture_seconds']:7.2f} s, step "
              f"{row['step_seconds'] * 1e3:8.2f} ms, replay vs direct {row['max_abs_diff']:.2e}", flush=True)
    return recompiles


def summary(result: dict) -> list[str]:
    run_row, rows = result["run"], results.rows(result)
    lines = [f"{failure['kind']} FAILED: {failure['error'][:300]}" for failure in run_row.get("failures", [])]
    if not rows:
        return lines
    lines += [f"compile {run_row['compile_seconds']:.1f} s (target {TARGETS['compile_seconds']:.0f}), warm "
             f"{run_row.get('warm_compile_seconds', float('nan')):.1f} s (target {TARGETS['warm_compile_seconds']:.0f}), "
             f"all ready {run_row['ready_seconds']:.1f} s (target {TARGETS['ready_seconds']:.0f}), "
             f"recompiles {run_row['recompiles']}"]
    for kind in dict.fromkeys(r["kind"] for r in rows):
        first = next(r for r in rows if r["kind"] == kind)
        lines.append(f"{kind}: first size (compiles) {first['capture_seconds']:.1f} s")
    captures = [r["capture_seconds"] for r in rows if not r["graphs_compiled"]]
    if captures:
        lines.append(f"captures of a compiled kind: at most {max(captures):.2f} s (target {TARGETS['capture_seconds']:.0f})")
    worst = max(r["max_abs_diff"] for r in rows)
    lines.append(f"replays against direct calls: worst {worst:.2e} (tolerance {TOLERANCE})")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke or args.warm_child:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
    if not args.smoke:
        require_cuda("bench.serve_warmup")
        if not args.warm_child:
            fresh_inductor_cache()
    init_from_env("gloo" if args.smoke else "nccl")
    device = torch.device("cpu") if args.smoke else torch.device("cuda", torch.cuda.current_device())
    original = MLAKVPool._allocate
    MLAKVPool._allocate = shared_kv_allocate
    try:
        if args.warm_child:
            ready = first_ready_seconds(args, device)
            print(json.dumps({"first_ready_seconds": ready, "phases_seconds": compile_phases()}), flush=True)
            dist.destroy_process_group()
            return 0
        result = results.start("serve_warmup", argv, device)
        run(args, device, result)
        results.write(result, args.out)  # before the warm child: a failure there keeps the cold run
        if not args.no_warm and results.rows(result):
            warm = warm_compile(args)
            result["run"].update(warm_compile_seconds=warm["first_ready_seconds"],
                                 warm_compile_phases_seconds=warm["phases_seconds"])
        result["run"]["targets"] = TARGETS
        results.write(result, args.out)
    finally:
        MLAKVPool._allocate = original
    print("\n".join(summary(result)))
    print(f"wrote {args.out}")
    dist.destroy_process_group()
    return 1 if result["run"]["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
