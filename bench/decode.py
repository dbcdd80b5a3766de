"""Decode benchmark: DCP = 1 against DCP = 2, side by side in one run, with CUDA graphs.

    torchrun --nproc-per-node 2 -m bench.decode --out bench/results/decode_h200x2.json --plot bench/results/decode_h200x2.png

Both settings run on the same 2 ranks at TP = 2 (Kimi-K2: 64 heads in all, 32 per rank,
R = 512, P = 64, bf16): at DCP = 1 each rank holds the whole latent cache; at DCP = 2 each holds
half, gathers the other rank's queries (64 heads), attends its shard and exchanges partials.
Measures, over context x batch:
  - one MLA decode attention layer (KV write, Q all-gather, attention, all-to-all, merge): median
    step time from CUDA events over replays of a captured graph;
  - the attention kernel alone at each setting, as KV bytes read / time against the
    device-to-device copy bandwidth measured in the same run;
  - the Q all-gather and the all-to-all alone, per layer, inside graphs;
  - a stack of 4 full reference-model layers (Kimi-K2 shapes, 4k vocab) per decode step;
  - a 4-layer tiny-model decode step at batch 1, graph replay against eager;
  - KV capacity per rank at a memory fraction, for the 61-layer model.
`--smoke` runs the same code on CPU ranks (gloo, reference kernels, no graphs, tiny shapes) to
check the script itself. Times are maxima over ranks of per-rank medians.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import dcp_compile
from bench.lib import plots, tables
from bench.lib import result as results
from bench.lib.cases import AttentionLayer, decode_page_table, fill_random, page_size, stack_batch
from bench.lib.timing import Timer, copy_bandwidth, median_call_seconds, require_cuda, slowest
from dcp_compile.models.config import preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.runtime import layout, parallel
from dcp_compile.runtime.launch import init_from_env

C10D = torch.ops._c10d_functional


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/decode.json")
    p.add_argument("--plot", default=None, help="PNG path for the step-time plot")
    p.add_argument("--contexts", default="8192,32768,131072")
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--stack-contexts", default="8192,131072", help="contexts for the 4-layer stack")
    p.add_argument("--heads", type=int, default=64, help="query heads in all (Kimi-K2: 64)")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--memory-fraction", type=float, default=0.9)
    p.add_argument("--smoke", action="store_true", help="CPU ranks, tiny shapes, no graphs")
    args = p.parse_args(argv)
    for name in ("contexts", "batches", "stack_contexts"):
        setattr(args, name, [int(v) for v in getattr(args, name).split(",") if v])
    return args


def bench_attention_layer(args, shapes, dcp_size, device, timer, tp) -> list[dict]:
    heads_local = args.heads // 2
    capacity = max(args.batches) * max(args.contexts) + 2
    layer = AttentionLayer(heads_local, shapes["R"], shapes["P"], capacity, shapes["dtype"], device, tp)
    model = dcp_compile.apply(layer, dcp_size, attention_strategy="gather-q", kv_keep="capacity")
    fill_random(layer.kv_pool.cache(0))
    step = model.compiled("gather-q")
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            gen = torch.Generator(device=device).manual_seed(batch * 7 + context)
            def rand(*shape):
                return torch.randn(*shape, generator=gen, device=device).to(shapes["dtype"])
            table = decode_page_table(batch, context, context, device)
            inputs = (rand(batch, heads_local, shapes["R"]), rand(batch, heads_local, shapes["P"]),
                      rand(batch, shapes["R"]), rand(batch, shapes["P"]), table[:, context - 1].clone(), table,
                      torch.full((batch,), context, device=device), torch.arange(batch, device=device),
                      torch.full((batch,), context - 1, device=device))
            timing = timer(lambda: step(*inputs))
            rows.append({"dcp_size": dcp_size, "context": context, "batch": batch,
                         "step_seconds": slowest(timing["seconds"], device), "graph": timing["graph"],
                         **({"capture_error": timing["capture_error"]} if "capture_error" in timing else {})})
    del model, layer
    return rows


def bench_kernel_and_comms(args, shapes, device, timer, group_name) -> list[dict]:
    """The attention kernel alone at DCP 1 (32 heads, whole context) and DCP 2 (64 heads, half),
    and the two collectives of one DCP = 2 layer."""
    from dcp_compile.lowering import triton as kernels

    use_triton = device.type == "cuda"
    attend = kernels.partial_attention if use_triton else torch.ops.dcp.mla_partial_attention
    heads_local, R, P, dtype = args.heads // 2, shapes["R"], shapes["P"], shapes["dtype"]
    row_bytes = (R + P) * torch.empty((), dtype=dtype).element_size()
    rows = []
    max_tokens = max(args.batches) * max(args.contexts)
    cache = torch.empty(max_tokens + 1, R + P, dtype=dtype, device=device)
    fill_random(cache)
    for context in args.contexts:
        for batch in args.batches:
            entry = {"context": context, "batch": batch}
            for dcp_size, heads in ((1, heads_local), (2, args.heads)):
                keys = -(-context // dcp_size)
                table = decode_page_table(batch, keys, keys, device)
                q = torch.randn(batch, heads, R + P, device=device).to(dtype)
                args_ = (q[..., :R], q[..., R:], cache, table, torch.full((batch,), keys, device=device),
                         torch.arange(keys, device=device).expand(batch, keys).contiguous(),
                         torch.arange(batch, device=device), torch.full((batch,), keys, device=device), 0.07)
                t = slowest(timer(lambda: attend(*args_))["seconds"], device)
                entry[f"attention_dcp{dcp_size}_seconds"] = t
                entry[f"attention_dcp{dcp_size}_kv_bytes_per_s"] = batch * keys * row_bytes / t
            q_local = torch.randn(batch, heads_local, R + P, device=device).to(dtype)
            words = 4 // torch.empty((), dtype=dtype).element_size()
            packed = torch.randn(2, batch, heads_local, R + words, device=device).to(dtype)
            entry["q_all_gather_seconds"] = slowest(timer(
                lambda: C10D.wait_tensor(C10D.all_gather_into_tensor(q_local, 2, group_name)))["seconds"], device)
            entry["all_to_all_seconds"] = slowest(timer(
                lambda: C10D.wait_tensor(C10D.all_to_all_single(packed, [1, 1], [1, 1], group_name)))["seconds"], device)
            rows.append(entry)
    return rows


def bench_pack_merge(args, shapes, device, timer, batch=64) -> dict:
    from dcp_compile.lowering import triton as kernels

    heads_local, R, dtype = args.heads // 2, shapes["R"], shapes["dtype"]
    out = torch.randn(batch, args.heads, R, device=device).to(dtype)
    lse = torch.randn(batch, args.heads, device=device)
    if device.type == "cuda":
        pack, merge = kernels.pack_partials, kernels.merge_partials
    else:
        pack, merge = torch.ops.dcp.pack_partials, torch.ops.dcp.merge_partials
    t = timer(lambda: merge(pack(out, lse, 2), R))["seconds"]
    return {"batch": batch, "heads_per_rank": heads_local, "seconds": slowest(t, device)}


def bench_model_stack(args, shapes, device, timer, tp) -> list[dict]:
    cfg = (preset("tiny") if args.smoke else preset("kimi-k2").replace(vocab_size=4096)).replace(layer_types=("mla",) * 4)
    width = max(args.stack_contexts)
    capacity = max(args.batches) * width + 2 * page_size(1)
    rows = []
    for dcp_size in (1, 2):
        model = MLAModel(cfg, kv_capacity=capacity, max_requests=max(args.batches), par=tp, dtype=shapes["dtype"], device=device)
        compiled = dcp_compile.apply(model, dcp_size, attention_strategy="gather-q", kv_keep="capacity")
        for i in range(cfg.num_mla_layers):
            fill_random(model.kv_pool.cache(i))
        step = compiled.compiled("gather-q")
        for context in args.stack_contexts:
            for batch in args.batches:
                inputs = stack_batch(batch, context, 1, 1, device, width).args()
                timing = timer(lambda: step(*inputs))
                rows.append({"dcp_size": dcp_size, "context": context, "batch": batch, "layers": 4,
                             "step_seconds": slowest(timing["seconds"], device), "graph": timing["graph"]})
        del compiled, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def bench_graph_speedup(args, device, tp) -> list[dict]:
    """4-layer tiny model, batch 1: eager (the compiled step, launched op by op) vs graph replay."""
    from dcp_compile.runtime.graph_runner import GraphRunner

    if device.type != "cuda":
        return []
    cfg = preset("tiny").replace(layer_types=("mla",) * 4)
    rows = []
    for dcp_size in (1, 2):
        model = MLAModel(cfg, kv_capacity=4096, max_requests=4, par=tp, device=device)
        compiled = dcp_compile.apply(model, dcp_size, attention_strategy="gather-q")
        step = compiled.compiled("gather-q")
        batch = stack_batch(1, 100, 1, 1, torch.device("cpu"), 128)
        runner = GraphRunner(step, buckets=(1, 2, 4), debug=True, watched=[model.kv_pool.cache(i) for i in range(4)])
        gpu_batch = batch.to(device)
        for _ in range(3):
            step(*gpu_batch.args())
            runner(batch)
        torch.cuda.synchronize()
        dist.barrier()
        eager = slowest(median_call_seconds(lambda: step(*gpu_batch.args()), args.replays * 2), device)
        graph = slowest(median_call_seconds(lambda: runner(batch), args.replays * 2), device)
        same = torch.allclose(step(*gpu_batch.args()), runner(batch), atol=1e-4, rtol=1e-4)
        rows.append({"dcp_size": dcp_size, "eager_seconds": eager, "graph_seconds": graph,
                     "speedup": eager / graph, "graph_matches_eager": bool(same)})
    return rows


def capacity(args, device) -> dict:
    cfg = preset("kimi-k2")
    row_bytes = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2 * cfg.num_mla_layers
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 24 << 30
    rows = int(args.memory_fraction * total) // row_bytes
    usable = {n: layout.logical_capacity(rows, n) - 1 for n in (1, 2)}
    return {"model": "kimi-k2", "layers": cfg.num_mla_layers, "bytes_per_token_per_rank": row_bytes,
            "memory_fraction": args.memory_fraction, "device_bytes": total, "rows_per_rank": rows,
            "tokens_dcp1": usable[1], "tokens_dcp2": usable[2], "ratio": usable[2] / usable[1]}


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.smoke:
        require_cuda("bench.decode")
    rank, world = init_from_env("gloo" if args.smoke else "nccl")
    if world != 2:
        raise SystemExit(f"bench.decode runs on 2 ranks (torchrun --nproc-per-node 2 -m bench.decode), got {world}")
    device = torch.device("cuda", torch.cuda.current_device()) if not args.smoke else torch.device("cpu")
    shapes = {"R": 32, "P": 16, "dtype": torch.float32} if args.smoke else {"R": 512, "P": 64, "dtype": torch.bfloat16}
    if args.smoke:
        args.heads = 8
    timer = Timer(device, args.replays)
    tp = parallel.build(2, 1)
    dcp_group = parallel.build(2, 2).dcp_group_name
    started = time.time()
    result = results.start("decode", argv, device)
    result["machine"]["ranks"] = world
    run = result["run"]
    run["shapes"] = {"heads_total": args.heads, "tp_size": 2, "kv_lora_rank": shapes["R"], "rope_dim": shapes["P"],
                     "dtype": str(shapes["dtype"])}
    if device.type == "cuda":
        run["copy"] = copy_bandwidth(4.0, args.replays)
        torch.cuda.empty_cache()
    results.add(result, "attention_layer",
                *[row for n in (1, 2) for row in bench_attention_layer(args, shapes, n, device, timer, tp)])
    results.add(result, "kernel_and_comms", *bench_kernel_and_comms(args, shapes, device, timer, dcp_group))
    run["pack_merge"] = bench_pack_merge(args, shapes, device, timer)
    results.add(result, "model_stack", *bench_model_stack(args, shapes, device, timer, tp))
    results.add(result, "graph_speedup", *bench_graph_speedup(args, device, tp))
    run["capacity"] = capacity(args, device)
    run["seconds"] = time.time() - started
    if rank == 0:
        results.write(result, args.out)
        print("\n".join(tables.lines(result)))
        if args.plot:
            plots.decode(result, args.plot)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
