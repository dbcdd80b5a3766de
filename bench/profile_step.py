"""Where the whole step's time goes: a per-kernel profile of bench.step's 61-layer stack on one GPU.

    torchrun --nproc-per-node 1 -m bench.profile_step --out bench/results/step_profile_h200.json
    python -m bench.profile_step --smoke --out /tmp/profile.json      # CPU, 2 tiny layers: checks the script

For each case (k, batch, context) the step is captured in a CUDA graph, as bench.step times it,
and a few replays run under torch.profiler. Kernels are summed by name over those replays and
divided by the replay count and the layer count: the time of each kernel a layer runs, and of the
step's own kernels (embedding, head), per step. The kernels fall in classes (attention, matmul,
the DCP kernels, inductor's fused kernels, aten's elementwise kernels); the gap between the
replay's wall time and the sum of its kernels is launch and dependency idle time on the device.
The same is done for bench.step's attention layer alone (KV write + attention), so its
per-layer time can be compared with the attention inside the step. The compile of the first
case is timed by phase (torch._dynamo.utils.compile_times).
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict

import torch
import torch.distributed as dist

import dcp_compile
from bench import step as step_bench
from bench.lib import result as results
from bench.lib import tables
from bench.lib.cases import shared_kv_allocate
from bench.lib.timing import compile_phases, require_cuda, timed_first_call
from dcp_compile.runtime import parallel
from dcp_compile.runtime.kv_pool import MLAKVPool
from dcp_compile.runtime.launch import init_from_env

# Kernel classes, first match wins: a name is matched lower-cased against each substring.
CLASSES = (
    ("attention", ("flashinfer", "batchmla", "mla_", "_partial_attention", "window", "merge_splits")),
    ("dcp kernels", ("_kv_write", "guard", "local_metadata", "pack_partials", "merge_partials")),
    ("collectives", ("nccl",)),
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "sm90_", "cublas", "splitk", "bmm", "skinny", "split_sum")),
    ("inductor fused", ("triton_",)),
    ("aten elementwise", ("elementwise", "vectorized", "reduce", "index", "copy", "fill", "cat", "scatter", "gather")),
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/step_profile.json")
    p.add_argument("--combo", default="flashinfer:inductor", help="lowering:inner_compile")
    p.add_argument("--cases", default="1:4:131072,1:16:131072,7:4:131072", help="k:batch:context,...")
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--regions", action="store_true", help="each decoder layer a compile region (MLAModel(regions=True))")
    p.add_argument("--fuse-projections", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--skinny-matmuls", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--replays", type=int, default=5)
    p.add_argument("--top", type=int, default=25, help="kernels listed per case")
    p.add_argument("--smoke", action="store_true", help="CPU, 2 tiny layers, torch kernels: checks the script")
    args = p.parse_args(argv)
    args.lowering, args.inner = args.combo.split(":")
    args.cases = [tuple(int(v) for v in c.split(":")) for c in args.cases.split(",") if c]
    if args.smoke:
        args.lowering, args.inner, args.cases, args.layers, args.replays = "torch", "eager", [(1, 2, 256), (3, 2, 256)], 2, 2
    # bench.step's helpers size the pool and the model from these
    args.decode_batches = [b for k, b, _ in args.cases if k == 1] or [1]
    args.verify_batches = [b for k, b, _ in args.cases if k != 1] or [1]
    args.contexts = sorted({c for _, _, c in args.cases})
    return args


def kernel_class(name: str) -> str:
    lower = name.lower()
    for label, needles in CLASSES:
        if any(n in lower for n in needles):
            return label
    return "other"


def profile(fn, device, replays: int) -> dict:
    """Kernels of `replays` runs of `fn`, captured once in a CUDA graph (CPU: run as it is)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    if device.type == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
        run()
        torch.cuda.synchronize()
        activities = [ProfilerActivity.CUDA]
    else:
        run, activities = fn, [ProfilerActivity.CPU]
        run()
    started = time.perf_counter()
    with torch_profile(activities=activities) as prof:
        for _ in range(replays):
            run()
        if device.type == "cuda":
            torch.cuda.synchronize()
    wall = (time.perf_counter() - started) / replays
    kernels: dict[str, list] = defaultdict(lambda: [0, 0.0])
    traced = "graph replays" if device.type == "cuda" else "eager calls (CPU: nested aten ops counted at each level)"
    for event in prof.events():
        if device.type == "cuda" and event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if device.type != "cuda" and not event.name.startswith("aten::"):
            continue
        seconds = (event.device_time if device.type == "cuda" else event.cpu_time) * 1e-6
        kernels[event.name][0] += 1
        kernels[event.name][1] += seconds
    if device.type == "cuda" and not kernels:  # a profiler that records no kernels inside graph replays
        with torch_profile(activities=activities) as prof:
            for _ in range(replays):
                fn()
            torch.cuda.synchronize()
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                kernels[event.name][0] += 1
                kernels[event.name][1] += event.device_time * 1e-6
        traced = "eager calls"
    if device.type == "cuda":
        timed = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        timed[0].record()
        for _ in range(replays):
            run()
        timed[1].record()
        timed[1].synchronize()
        wall = timed[0].elapsed_time(timed[1]) / 1e3 / replays
        del graph
    return {"wall_seconds": wall, "traced": traced, "kernels": {n: (c / replays, s / replays) for n, (c, s) in kernels.items()}}


def summarise(raw: dict, layers: int, top: int) -> dict:
    kernels = raw["kernels"]
    busy = sum(s for _, s in kernels.values())
    classes: dict[str, float] = defaultdict(float)
    for name, (_, seconds) in kernels.items():
        classes[kernel_class(name)] += seconds
    ranked = sorted(kernels.items(), key=lambda item: -item[1][1])[:top]
    return {
        "step_seconds": raw["wall_seconds"],
        "kernels_traced_from": raw["traced"],
        "kernel_seconds": busy,
        "idle_seconds": raw["wall_seconds"] - busy,
        "kernels_per_step": sum(c for c, _ in kernels.values()),
        "classes_seconds": dict(sorted(classes.items(), key=lambda item: -item[1])),
        "per_layer_us": {label: seconds / layers * 1e6 for label, seconds in classes.items()},
        "top_kernels": [{"name": name[:160], "class": kernel_class(name), "calls_per_step": calls,
                         "seconds_per_step": seconds} for name, (calls, seconds) in ranked],
    }


def attention_alone(args, cfg, device, tp, k: int, batch: int, context: int) -> dict:
    layer, model = step_bench.attention_layer(args, cfg, args.lowering, device, tp, args.inner)
    try:
        return step_bench.run_attention_case(args, cfg, model, k, batch, context, device,
                                             lambda fn: summarise(profile(fn, device, args.replays), 1, args.top))
    finally:
        del model, layer


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"), ("RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(key, value)
    else:
        require_cuda("bench.profile_step")
        step_bench.fresh_inductor_cache()
    _, world = init_from_env("gloo" if args.smoke else "nccl")
    if world != 1:
        raise SystemExit(f"bench.profile_step runs on one GPU, got {world} ranks")
    device = torch.device("cpu") if args.smoke else torch.device("cuda", torch.cuda.current_device())
    tp = parallel.build(1, 1)
    cfg = step_bench.model_config(args)
    started = time.time()
    result = results.start("profile_step", argv, device)
    run = result["run"]
    run.update(lowering=args.lowering, inner_compile=args.inner, layers=cfg.num_layers, heads=cfg.num_heads,
               classes={label: list(needles) for label, needles in CLASSES})
    original = MLAKVPool._allocate
    MLAKVPool._allocate = shared_kv_allocate
    try:
        model, compiled = step_bench.build(args, cfg, args.lowering, args.inner, args.skinny_matmuls, device, tp)
        run["fuse_projections"] = dcp_compile.state(compiled).config.fuse_projections
        run["skinny_matmuls"] = step_bench.skinny_of(dcp_compile.state(compiled).config)
        width = max(args.contexts)
        for index, (k, batch, context) in enumerate(args.cases):
            first = step_bench.run_case(compiled, batch, context, k, width, device,
                                        lambda fn: timed_first_call(fn, device))
            row = {"k": k, "batch": batch, "context": context, "compile_seconds": first}
            if index == 0:
                row["compile_phases_seconds"] = compile_phases()
            row["step"] = step_bench.run_case(compiled, batch, context, k, width, device,
                                              lambda fn: summarise(profile(fn, device, args.replays), cfg.num_layers,
                                                                   args.top))
            row["attention_layer_alone"] = attention_alone(args, cfg, device, tp, k, batch, context)
            results.add(result, results.MAIN, row)
            print("\n".join(tables.profile_case(row, cfg.num_layers)), flush=True)
            run["seconds"] = time.time() - started
            results.write(result, args.out)
    finally:
        MLAKVPool._allocate = original
    print(f"wrote {args.out} in {time.time() - started:.0f} s")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
