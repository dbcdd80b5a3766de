"""DCP = 1 against DCP = 2 on 2 GPUs, per attention layer and for a 61-layer Kimi-K2-shaped stack,
per lowering, decode and verify, side by side in one run, in CUDA graphs.

    torchrun --nproc-per-node 2 bench/dcp_step.py --out bench/results/dcp_step_h200x2.json

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
FlashInfer is planned before capture: the plan's host time is bench/lowerings.py's figure.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import dcp_compile  # noqa: E402
from decode import AttentionLayer, Timer, fill_random, slowest  # noqa: E402
from dcp_compile.models.config import preset  # noqa: E402
from dcp_compile.models.mla import MLAModel  # noqa: E402
from dcp_compile.runtime import parallel  # noqa: E402
from dcp_compile.runtime.batch import ForwardBatch  # noqa: E402
from dcp_compile.runtime.host_metadata import HostMetadata, block_table_width  # noqa: E402
from dcp_compile.runtime.kv_pool import MLAKVPool  # noqa: E402
from dcp_compile.runtime.launch import init_from_env  # noqa: E402

BLOCK = 64
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


def page_size(dcp_size: int) -> int:
    return BLOCK * dcp_size


def request_table(batch: int, context: int, dcp_size: int, device, width: int) -> torch.Tensor:
    """Request b on whole pages: locations page + b*width ... (page-aligned, past location 0);
    one table width for every context, so a context changes no graph shape."""
    page = page_size(dcp_size)
    columns = torch.arange(width, device=device)
    table = page + torch.arange(batch, device=device)[:, None] * width + columns
    return torch.where(columns < context, table, 0).to(torch.int32)


def host_metadata(batch: int, context: int, k: int, dcp_size: int, width: int) -> HostMetadata:
    """RequestTable's host metadata for request_table's layout (interleave 1), in closed form:
    location page + b*width + p lives on rank p % N; its local block is its page's id."""
    page = page_size(dcp_size)
    blocks = block_table_width(width, page)
    first_page = (page + torch.arange(batch)[:, None] * width) // page
    used = torch.arange(blocks)[None, :] < -(-context // page)
    tables = torch.where(used, first_page + torch.arange(blocks)[None, :], 0).to(torch.int32)
    tables = tables.expand(dcp_size, batch, blocks).contiguous()
    local = tuple((sum(1 for _ in range(rank, context, dcp_size)),) * batch for rank in range(dcp_size))
    prefix = tuple((len(range(rank, context - k, dcp_size)),) * batch for rank in range(dcp_size))
    return HostMetadata(dcp_size, 1, page, (k,) * batch, local, prefix, tables)


def verify_inputs(batch: int, context: int, k: int, table: torch.Tensor):
    device = table.device
    positions = (context - k + torch.arange(k, device=device)).repeat(batch)
    q_seq_ids = torch.arange(batch, device=device).repeat_interleave(k)
    return positions, q_seq_ids, table[q_seq_ids, positions].clone()


def shared_kv_allocate(pool: MLAKVPool, rows: int) -> None:
    """One KV buffer for every layer of the pool (bench only: see the module docstring)."""
    pool.rows_per_rank = rows
    shared = torch.zeros(rows, pool.row_dim, dtype=pool.dtype, device=pool.device)
    for i in range(pool.num_layers):
        pool.register_buffer(f"layer_{i}", shared, persistent=False)


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


def stack_batch(batch: int, context: int, k: int, dcp_size: int, device, width: int) -> ForwardBatch:
    table = request_table(batch, context, dcp_size, device, width)
    positions, q_seq_ids, out_loc = verify_inputs(batch, context, k, table)
    rows = torch.arange(batch, device=device)
    return ForwardBatch(input_ids=(q_seq_ids * 31 + positions) % 4096, positions=positions, q_seq_ids=q_seq_ids,
                        out_loc=out_loc, req_to_token=table, seq_lens=torch.full((batch,), context, device=device),
                        state_slots=torch.zeros(batch, dtype=torch.int64, device=device),
                        logits_index=torch.arange(batch * k, device=device) if k > 1 else rows)


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


def print_summary(result: dict) -> None:
    for part in ("layer", "stack"):
        if part not in result:
            continue
        print(f"\n{part}: DCP = 2 over DCP = 1 (step us)")
        print(f"{'lowering':>10} {'ctx':>7} {'batch':>5} {'k':>2} {'DCP1 us':>10} {'DCP2 us':>10} {'DCP2/DCP1':>9} {'/FI DCP1':>8}")
        for r in result[f"{part}_ratios"]:
            same = r["dcp1_same_lowering_seconds"]
            print(f"{r['lowering']:>10} {r['context']:>7} {r['batch']:>5} {r['k']:>2} "
                  f"{(same or float('nan')) * 1e6:>10.1f} {r['dcp2_seconds'] * 1e6:>10.1f} "
                  f"{r['dcp2_over_dcp1'] or float('nan'):>9.3f} {r['dcp2_over_flashinfer_dcp1'] or float('nan'):>8.3f}")
        errors = [r for r in result[part] if "error" in r or "capture_error" in r]
        for r in errors:
            print("  error:", {k: r[k] for k in ("lowering", "dcp_size", "context", "batch", "k")}, r.get("error") or r.get("capture_error"))


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, world = init_from_env("nccl")
    if world != 2:
        raise SystemExit(f"bench/dcp_step.py runs on 2 ranks (torchrun --nproc-per-node 2), got {world}")
    device = torch.device("cuda", torch.cuda.current_device())
    tp = parallel.build(2, 1)
    started = time.time()
    result = {
        "command": "torchrun --nproc-per-node 2 " + " ".join(shlex.quote(a) for a in sys.argv),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "gpu": torch.cuda.get_device_name(device), "gpus": world},
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": __import__("triton").__version__,
                     "flashinfer": getattr(__import__("flashinfer"), "__version__", None) if "flashinfer" in args.lowerings else None,
                     "nccl": ".".join(map(str, torch.cuda.nccl.version()))},
        "shapes": {"heads_total": 64, "tp_size": 2, "kv_lora_rank": 512, "rope_dim": 64, "dtype": "bfloat16",
                   "block_rows": BLOCK, "draft": args.draft},
        "targets": TARGETS,
    }
    timer = Timer(device, args.replays, repeats=4)

    def save() -> None:  # after each part: a run cut short keeps what it measured
        result["seconds"] = time.time() - started
        if rank == 0:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1))

    if "layer" in args.parts:
        result["layer"] = bench_layer(args, device, timer, tp)
        result["layer_ratios"] = ratios(result["layer"])
        save()
        if rank == 0:
            print_summary(result)
    if "stack" in args.parts:
        result["stack"] = bench_stack(args, device, tp)
        result["stack_ratios"] = ratios(result["stack"])
        save()
    if rank == 0:
        print_summary(result)
        print(f"\nwrote {args.out} in {result['seconds']:.0f} s")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
