"""DCP = 1 against DCP = 2 on 2 GPUs, per attention layer and for a 61-layer Kimi-K2-shaped stack,
per lowering, decode and verify, side by side in one run, in CUDA graphs.

    torchrun --nproc-per-node 2 -m bench.dcp_step --out bench/results/dcp_step_h200x2.json

Both settings run on the same 2 ranks at TP = 2 (Kimi-K2: 64 heads, 32 per rank, R = 512, P = 64,
bf16). At DCP = 1 each rank holds the whole latent cache; at DCP = 2 each holds half (pages of
128 locations, one local block of 64 rows per rank; DCP = 1 uses pages of 64), gathers the other
rank's queries and exchanges partials.

  layer: one MLA attention layer (KV write, attention, and under DCP the Q all-gather, the
         all-to-all and the merge), decode (k = 1) and verify (k = 7 queries a request), per
         lowering ('flashinfer', 'triton').
  stack: 61 Kimi-K2 decoder layers with real-sized attention weights and a small MLP (width
         2048), 4k vocabulary: the step a serving engine replays, decode and verify k = 7. The
         layers share one KV buffer (each layer still reads the whole context from HBM, 40x the
         L2), so batch 16 at 128k fits at DCP = 1 too.

Times are medians over replays of a captured graph holding `repeats` steps, maxima over ranks.
Host metadata is made once per case (RequestTable's layout: each request on whole pages) and
FlashInfer is planned before capture: the plan's host time is bench.lowerings' figure.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import dcp_compile
from bench.lib import result as results
from bench.lib import tables
from bench.lib.cases import (BLOCK, AttentionLayer, fill_random, host_metadata, page_size, request_table,
                             shared_kv_allocate, stack_batch, verify_inputs)
from bench.lib.timing import Timer, require_cuda, slowest
from dcp_compile.models.config import preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.runtime import parallel
from dcp_compile.runtime.kv_pool import MLAKVPool
from dcp_compile.runtime.launch import init_from_env

TARGETS = {"layer_decode_b64": 0.55, "layer_decode_b4": 0.70, "layer_verify": 1.05, "stack_decode": 0.75,
           "stack_verify": 1.05}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/dcp_step.json")
    p.add_argument("--contexts", default="32768,131072")
    p.add_argument("--batches", default="4,16,64")
    p.add_argument("--stack-contexts", default="32768,131072")
    p.add_argument("--stack-batches", default="4,16")
    p.add_argument("--stack-layers", type=int, default=61)
    p.add_argument("--lowerings", default="flashinfer,triton")
    p.add_argument("--draft", type=int, default=7)
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--parts", default="layer,stack")
    args = p.parse_args(argv)
    for name in ("contexts", "batches", "stack_contexts", "stack_batches"):
        setattr(args, name, [int(v) for v in getattr(args, name).split(",") if v])
    args.lowerings = [v for v in args.lowerings.split(",") if v]
    args.parts = [v for v in args.parts.split(",") if v]
    return args


def bench_layer(args, device, timer, tp) -> list[dict]:
    rows = []
    capacity = max(args.batches) * max(args.contexts) + 2 * page_size(2)
    for lowering in args.lowerings:
        for dcp_size in (1, 2):
            layer = AttentionLayer(32, 512, 64, capacity, torch.bfloat16, device, tp, page_size=page_size(dcp_size))
            model = dcp_compile.apply(layer, dcp_size, attention_strategy="gather-q", kv_keep="capacity", kernels=lowering)
            fill_random(layer.kv_pool.cache(0))
            step, slot = model.compiled("gather-q"), dcp_compile.state(model).host_slot
            for context in args.contexts:
                for batch in args.batches:
                    for k in (1, args.draft):
                        gen = torch.Generator(device=device).manual_seed(batch * 7 + context + k)
                        tokens = batch * k

                        def rand(*shape):
                            return torch.randn(*shape, generator=gen, device=device).to(torch.bfloat16)
                        table = request_table(batch, context, dcp_size, device, max(args.contexts))
                        positions, q_seq_ids, out_loc = verify_inputs(batch, context, k, table)
                        inputs = (rand(tokens, 32, 512), rand(tokens, 32, 64), rand(tokens, 512), rand(tokens, 64), out_loc,
                                  table, torch.full((batch,), context, device=device), q_seq_ids, positions)
                        slot.begin(host_metadata(batch, context, k, dcp_size, max(args.contexts)))
                        try:
                            timing = timer(lambda: step(*inputs))
                            seconds = slowest(timing["seconds"], device)
                            entry = {"graph": timing["graph"], **({"capture_error": timing["capture_error"]}
                                                                   if "capture_error" in timing else {})}
                        except Exception as error:  # noqa: BLE001 - reported, the run goes on
                            seconds, entry = float("nan"), {"error": f"{type(error).__name__}: {error}"[:300]}
                        finally:
                            slot.end()
                        rows.append({"lowering": lowering, "dcp_size": dcp_size, "context": context, "batch": batch,
                                     "k": k, "step_seconds": seconds, **entry})
            del model, layer
            torch.cuda.empty_cache()
    return rows


def bench_stack(args, device, tp, lowering: str = "flashinfer") -> list[dict]:
    cfg = preset("kimi-k2").replace(vocab_size=4096, intermediate_size=2048, layer_types=("mla",) * args.stack_layers)
    capacity = max(args.stack_batches) * max(args.stack_contexts) + 2 * page_size(2)
    timer = Timer(device, max(3, args.replays // 2), repeats=2)
    rows = []
    original = MLAKVPool._allocate
    MLAKVPool._allocate = shared_kv_allocate
    try:
        for dcp_size in (1, 2):
            model = MLAModel(cfg, kv_capacity=capacity, max_requests=max(args.stack_batches), par=tp, dtype=torch.bfloat16,
                             device=device, page_size=page_size(dcp_size))
            compiled = dcp_compile.apply(model, dcp_size, attention_strategy="gather-q", kv_keep="capacity",
                                         kernels=lowering)
            fill_random(model.kv_pool.cache(0))
            step, slot = compiled.compiled("gather-q"), dcp_compile.state(compiled).host_slot
            for context in args.stack_contexts:
                for batch in args.stack_batches:
                    for k in (1, args.draft):
                        width = max(args.stack_contexts)
                        inputs = stack_batch(batch, context, k, dcp_size, device, width).args()
                        slot.begin(host_metadata(batch, context, k, dcp_size, width))
                        try:
                            timing = timer(lambda: step(*inputs))
                            seconds = slowest(timing["seconds"], device)
                            entry = {"graph": timing["graph"]}
                        except Exception as error:  # noqa: BLE001
                            seconds, entry = float("nan"), {"error": f"{type(error).__name__}: {error}"[:300]}
                        finally:
                            slot.end()
                        rows.append({"lowering": lowering, "dcp_size": dcp_size, "context": context, "batch": batch, "k": k,
                                     "layers": cfg.num_layers, "step_seconds": seconds, **entry})
            del compiled, model
            torch.cuda.empty_cache()
    finally:
        MLAKVPool._allocate = original
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    by_key = {(r["lowering"], r["dcp_size"], r["context"], r["batch"], r["k"]): r["step_seconds"] for r in rows}
    out = []
    for (lowering, dcp, context, batch, k), seconds in by_key.items():
        if dcp != 2:
            continue
        same = by_key.get((lowering, 1, context, batch, k))
        flashinfer_dcp1 = by_key.get(("flashinfer", 1, context, batch, k))
        out.append({"lowering": lowering, "context": context, "batch": batch, "k": k,
                    "dcp2_seconds": seconds, "dcp1_same_lowering_seconds": same,
                    "dcp2_over_dcp1": seconds / same if same else None,
                    "dcp2_over_flashinfer_dcp1": seconds / flashinfer_dcp1 if flashinfer_dcp1 else None})
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    require_cuda("bench.dcp_step")
    rank, world = init_from_env("nccl")
    if world != 2:
        raise SystemExit(f"bench.dcp_step runs on 2 ranks (torchrun --nproc-per-node 2 -m bench.dcp_step), got {world}")
    device = torch.device("cuda", torch.cuda.current_device())
    tp = parallel.build(2, 1)
    started = time.time()
    result = results.start("dcp_step", argv, device)
    result["machine"]["ranks"] = world
    run = result["run"]
    run.update(shapes={"heads_total": 64, "tp_size": 2, "kv_lora_rank": 512, "rope_dim": 64, "dtype": "bfloat16",
                       "block_rows": BLOCK, "draft": args.draft},
               targets=TARGETS)
    timer = Timer(device, args.replays, repeats=4)

    def save() -> None:  # after each part: a run cut short keeps what it measured
        run["seconds"] = time.time() - started
        if rank == 0:
            results.write(result, args.out)

    for part, bench in (("layer", lambda: bench_layer(args, device, timer, tp)), ("stack", lambda: bench_stack(args, device, tp))):
        if part not in args.parts:
            continue
        measured = bench()
        results.add(result, part, *measured)
        results.add(result, f"{part}_ratios", *ratios(measured))
        save()
        if rank == 0:
            print("\n".join(tables.dcp_step(result)), flush=True)
    if rank == 0:
        print(f"\nwrote {args.out} in {run['seconds']:.0f} s")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
