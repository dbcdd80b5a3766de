"""The whole decode / verify step on one GPU against its roofline floor, per (lowering, inner compiler).

    torchrun --nproc-per-node 1 -m bench.step --out bench/results/step_h200.json
    python -m bench.report bench/results/step_h200.json --plot bench/results/step_h200.png
    python -m bench.step --smoke --out /tmp/step.json      # CPU, 2 tiny layers: checks the script

The model is a 61-layer Kimi-K2-shaped stack at DCP = 1 on one GPU: 64 heads, R = 512, P = 64,
real-sized attention weights, a 2048-wide MLP, a 4k vocabulary, bf16. Its layers share one KV
buffer (every layer still reads the whole context from HBM: 40x the L2), so batch 64 at 128k fits.
Each step is replayed from a CUDA graph holding `repeats` steps.

For each (lowering, inner compiler) and case (decode at --decode-batches, verify k = --draft at
--verify-batches, at each context):
  - step_seconds: the median step time;
  - floor_seconds: the larger of (weights + KV bytes read) at the copy rate, and the step's FLOPs
    at the matmul rate, both measured in this run (bench.lib.timing: the copy's read + write bytes
    over time, an 8192^3 bf16 matmul);
  - attention_seconds: one attention layer alone (KV write + attention, the same lowering, in a
    graph) times the layer count; rest_seconds = step - attention;
  - compile_seconds: the first call of that batch shape (tracing, the DCP passes, the inner
    compiler). Per combination, cold (empty inductor cache, set for this run) and warm (a fresh
    model after torch._dynamo.reset(), the on-disk caches kept) compile times of the first shape.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist

import dcp_compile
from dcp_compile.lowering import registry
from bench.lib import result as results
from bench.lib import tables
from bench.lib.cases import (AttentionLayer, fill_random, host_metadata, page_size, shared_kv_allocate,
                             stack_batch)
from bench.lib.roofline import attention_flops, floor
from bench.lib.timing import Timer, copy_bandwidth, matmul_rate, require_cuda, timed_first_call
from dcp_compile.models.config import preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.runtime import parallel
from dcp_compile.runtime.kv_pool import MLAKVPool
from dcp_compile.runtime.launch import init_from_env

TARGETS = [  # (k, batch, context, fraction of the floor): issue 20
    (1, 4, 131072, 0.80), (1, 16, 131072, 0.85), (7, 4, 131072, 0.75)]
COMPILE_TARGETS = {"cold_seconds": 90.0, "warm_seconds": 15.0}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/step.json")
    p.add_argument("--combos", default="flashinfer:inductor,flashinfer:eager,triton:inductor,triton:eager",
                   help="lowering:inner_compile pairs, each optionally :on or :off for skinny_matmuls (default "
                        "--skinny-matmuls), e.g. flashinfer:inductor:on,flashinfer:inductor:off side by side; a "
                        "lowering may name its verify_attention, e.g. flashinfer+folded:inductor")
    p.add_argument("--contexts", default="32768,131072")
    p.add_argument("--decode-batches", default="4,16,64")
    p.add_argument("--verify-batches", default="4,16")
    p.add_argument("--fuse-projections", default="auto", choices=("auto", "on", "off"),
                   help="apply(..., fuse_projections=): fuse q_a with kv_a and gate with up (auto: on, on CUDA)")
    p.add_argument("--skinny-matmuls", default="auto", choices=("auto", "on", "off"),
                   help="apply(..., skinny_matmuls=): few-token projections through the Triton skinny matmul (auto: on, on CUDA)")
    p.add_argument("--symbolic", action="store_true",
                   help="steps through compiled('gather-q', symbolic=True): one compile for every batch shape (each "
                        "row's compile_seconds is then its shape's first call on the shared graph)")
    p.add_argument("--draft", type=int, default=7)
    p.add_argument("--regions", action="store_true",
                   help="each decoder layer a compile region (MLAModel(regions=True)): passes and inner compile once per kind of layer")
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--replays", type=int, default=6)
    p.add_argument("--repeats", type=int, default=2, help="steps per captured graph")
    p.add_argument("--no-warm", action="store_true", help="skip the warm-compile measurement")
    p.add_argument("--budget-s", type=float, default=1e9, help="no new combination starts after this many seconds")
    p.add_argument("--smoke", action="store_true", help="CPU, 2 tiny layers, torch kernels: checks the script")
    args = p.parse_args(argv)
    args.combos = [_combo(c, args.skinny_matmuls) for c in args.combos.split(",") if c]
    for name in ("contexts", "decode_batches", "verify_batches"):
        setattr(args, name, [int(v) for v in getattr(args, name).split(",") if v])
    if args.smoke:
        args.combos = [("torch", "eager", "auto")]
        args.contexts, args.decode_batches, args.verify_batches, args.layers = [256], [2], [2], 2
        args.replays, args.repeats = 2, 1
    return args


def _combo(text: str, skinny_default: str) -> tuple[str, str, str]:
    parts = text.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("auto", "on", "off")):
        raise SystemExit(f"--combos: {text!r} is not lowering:inner_compile[:auto|on|off]")
    return (parts[0], parts[1], parts[2] if len(parts) == 3 else skinny_default)


def cases(args) -> list[tuple[int, int, int]]:
    """(k, batch, context), the larger steps last."""
    shapes = [(1, b) for b in args.decode_batches] + [(args.draft, b) for b in args.verify_batches]
    return [(k, batch, context) for k, batch in shapes for context in args.contexts]


def model_config(args):
    base = preset("tiny-512") if args.smoke else preset("kimi-k2")
    mlp = {} if args.smoke else {"intermediate_size": 2048}
    return base.replace(vocab_size=4096, layer_types=("mla",) * args.layers, **mlp)  # stack_batch's ids are < 4096


def capacity(args) -> int:
    return max(args.decode_batches + args.verify_batches) * max(args.contexts) + 2 * page_size(1)


def weight_bytes_and_params(model) -> tuple[int, int]:
    """Bytes and parameters one step reads: every weight but the embedding table (it reads rows)."""
    embedding = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    params = [p for p in model.parameters() if id(p) not in embedding]
    return sum(p.numel() * p.element_size() for p in params), sum(p.numel() for p in params)


def step_work(cfg, weights: tuple[int, int], k: int, batch: int, context: int) -> dict:
    """What one step must read and compute: every weight (`weights`: bytes, parameters) and each
    layer's whole context; 2 FLOPs a parameter and token, and attention over the whole context for
    each token."""
    tokens, row_bytes = batch * k, (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    kv_bytes = cfg.num_layers * batch * context * row_bytes
    flops = 2 * weights[1] * tokens + attention_flops(cfg.num_heads, cfg.num_layers * tokens * context,
                                                      cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    return {"weight_bytes": weights[0], "kv_bytes": kv_bytes, "flops": flops}


def fresh_inductor_cache() -> bool:
    """An empty inductor cache for this run, so the first compile is cold, unless one was set
    (TORCHINDUCTOR_CACHE_DIR): whether the cache is this run's own empty one."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return False
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="dcp_step_inductor_")
    return True


def skinny_of(config) -> str:
    """What the compiled model resolved skinny_matmuls to ('off' where its back end has no such option)."""
    return getattr(config.options, "skinny_matmuls", "off")


def split_lowering(text: str) -> tuple[str, dict]:
    """A combo's lowering, 'name' or 'name+VERIFY' (VERIFY: its verify_attention, e.g.
    flashinfer+folded), as (name, option values)."""
    name, _, verify = text.partition("+")
    return name, ({"verify_attention": verify} if verify else {})


def verify_attention_of(config) -> str:
    """What the compiled model resolved verify_attention to ('default' where its back end has no such option)."""
    return getattr(config.options, "verify_attention", "default")


def build(args, cfg, lowering: str, inner: str, skinny: str, device, tp):
    model = MLAModel(cfg, kv_capacity=capacity(args), max_requests=max(args.decode_batches + args.verify_batches), par=tp,
                     dtype=torch.bfloat16, device=device, page_size=page_size(1), regions=args.regions)
    lowering, options = split_lowering(lowering)
    # skinny_matmuls is an option of the back ends that run the Triton kernels (TritonOptions)
    if lowering in registry.option_owners("skinny_matmuls"):
        options["skinny_matmuls"] = skinny
    compiled = dcp_compile.apply(model, 1, attention_strategy="gather-q", kv_keep="capacity", kernels=lowering,
                                 inner_compile=inner, fuse_projections=args.fuse_projections, **options)
    fill_random(model.kv_pool.cache(0))
    return model, compiled


def run_case(compiled, batch: int, context: int, k: int, width: int, device, fn, symbolic: bool = False):
    step, slot = compiled.compiled("gather-q", symbolic=symbolic), dcp_compile.state(compiled).host_slot
    inputs = stack_batch(batch, context, k, 1, device, width).args()
    slot.begin(host_metadata(batch, context, k, 1, width))
    try:
        return fn(lambda: step(*inputs))
    finally:
        slot.end()


def attention_layer(args, cfg, lowering: str, device, tp, inner: str = "auto"):
    """One attention layer (KV write + attention over the context) applied with `lowering`."""
    layer = AttentionLayer(cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, capacity(args), torch.bfloat16, device,
                           tp, page_size=page_size(1))
    lowering, options = split_lowering(lowering)
    model = dcp_compile.apply(layer, 1, attention_strategy="gather-q", kv_keep="capacity", kernels=lowering,
                              inner_compile=inner, **options)
    fill_random(layer.kv_pool.cache(0))
    return layer, model


def run_attention_case(args, cfg, model, k: int, batch: int, context: int, device, fn):
    """fn(step) for one case of the attention layer, with the case's host metadata set."""
    step, slot = model.compiled("gather-q"), dcp_compile.state(model).host_slot
    width = max(args.contexts)
    table = stack_batch(batch, context, k, 1, device, width)
    tokens = batch * k
    gen = torch.Generator(device=device).manual_seed(tokens + context)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(torch.bfloat16)
    inputs = (rand(tokens, cfg.num_heads, cfg.kv_lora_rank), rand(tokens, cfg.num_heads, cfg.qk_rope_head_dim),
              rand(tokens, cfg.kv_lora_rank), rand(tokens, cfg.qk_rope_head_dim), table.out_loc, table.req_to_token,
              table.seq_lens, table.q_seq_ids, table.positions)
    slot.begin(host_metadata(batch, context, k, 1, width))
    try:
        return fn(lambda: step(*inputs))
    finally:
        slot.end()


def attention_layer_seconds(args, cfg, lowering: str, device, tp, timer) -> dict:
    """One attention layer, per case, in a graph."""
    layer, model = attention_layer(args, cfg, lowering, device, tp)
    out = {(k, batch, context): run_attention_case(args, cfg, model, k, batch, context, device, timer)["seconds"]
           for k, batch, context in cases(args)}
    del model, layer
    return out


def bench_combo(args, cfg, lowering: str, inner: str, skinny: str, device, tp, result: dict, attention_cache: dict) -> None:
    """Time one (lowering, inner compiler, skinny_matmuls) into `result` (which holds the run's copy
    and matmul rates); the attention layer is timed once per lowering."""
    timer = Timer(device, args.replays, repeats=args.repeats)
    if lowering not in attention_cache:
        attention_cache[lowering] = attention_layer_seconds(args, cfg, lowering, device, tp, timer)
    attention = attention_cache[lowering]
    started = time.perf_counter()
    model, compiled = build(args, cfg, lowering, inner, skinny, device, tp)
    config = dcp_compile.state(compiled).config
    resolved, verify = skinny_of(config), verify_attention_of(config)
    build_seconds = time.perf_counter() - started
    weights = weight_bytes_and_params(model)
    width = max(args.contexts)
    name = split_lowering(lowering)[0]
    compile_row = {"lowering": name, "inner_compile": inner, "skinny_matmuls": resolved, "verify_attention": verify,
                   "model_build_seconds": build_seconds}
    for k, batch, context in cases(args):
        row = {"lowering": name, "inner_compile": inner, "context": context, "batch": batch, "k": k,
               "layers": cfg.num_layers, "fuse_projections": config.fuse_projections,
               "skinny_matmuls": resolved, "verify_attention": verify, "symbolic": args.symbolic,
               "regions": args.regions}
        try:
            row["compile_seconds"] = run_case(compiled, batch, context, k, width, device,
                                              lambda fn: timed_first_call(fn, device), args.symbolic)
            timing = run_case(compiled, batch, context, k, width, device, timer, args.symbolic)
            row.update(step_seconds=timing["seconds"], graph=timing["graph"])
            if "capture_error" in timing:
                row["capture_error"] = timing["capture_error"]
        except Exception as error:  # noqa: BLE001 - reported, the run goes on
            row.update(step_seconds=float("nan"), error=f"{type(error).__name__}: {error}"[:400])
        row.update(step_work(cfg, weights, k, batch, context))
        row["floor_seconds"], row["floor_bound"] = floor(row["weight_bytes"] + row["kv_bytes"], row["flops"],
                                                         result["run"]["copy_bytes_per_s"],
                                                         result["run"]["matmul_flops_per_s"])
        row["fraction_of_floor"] = row["floor_seconds"] / row["step_seconds"]
        row["attention_seconds"] = attention[(k, batch, context)] * cfg.num_mla_layers
        row["rest_seconds"] = row["step_seconds"] - row["attention_seconds"]
        results.add(result, results.MAIN, row)
        print(f"{lowering:>17} {inner:>8} skinny {resolved:>3} ctx {context:>6} b {batch:>3} k {k} step {row['step_seconds'] * 1e3:8.2f} ms "
              f"floor {row['floor_seconds'] * 1e3:7.2f} ms ({row['fraction_of_floor']:.0%}) attention "
              f"{row['attention_seconds'] * 1e3:7.2f} ms, first call {row.get('compile_seconds', float('nan')):6.1f} s "
              f"{row.get('error', '')}", flush=True)
    first = next(r for r in results.rows(result) if (r["lowering"], r["inner_compile"], r["skinny_matmuls"],
                                                     r.get("verify_attention")) == (name, inner, resolved, verify))
    compile_row["cold_seconds"] = first.get("compile_seconds")
    del compiled, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not args.no_warm:
        torch._dynamo.reset()
        model, compiled = build(args, cfg, lowering, inner, skinny, device, tp)
        k, batch, context = cases(args)[0]
        compile_row["warm_seconds"] = run_case(compiled, batch, context, k, width, device,
                                               lambda fn: timed_first_call(fn, device), args.symbolic)
        del compiled, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    torch._dynamo.reset()
    results.add(result, "compile", compile_row)
    print(f"{lowering:>17} {inner:>8} skinny {resolved:>3} compile: cold {compile_row['cold_seconds'] or float('nan'):.1f} s, warm "
          f"{compile_row.get('warm_seconds', float('nan')):.1f} s", flush=True)


def measure_rates(args, device) -> dict:
    if device.type != "cuda":
        return {"copy_bytes_per_s": 1e10, "matmul_flops_per_s": 1e11, "note": "--smoke: nominal rates, nothing measured"}
    copy = copy_bandwidth(4.0, args.replays)
    rates = {"copy_bytes_per_s": copy["bytes_per_s"], "copy": copy, "matmul_flops_per_s": matmul_rate(args.replays)}
    torch.cuda.empty_cache()
    return rates


def summary(result: dict) -> list[str]:
    lines = []
    for k, batch, context, target in TARGETS:
        for row in results.rows(result):
            if (row["k"], row["batch"], row["context"]) == (k, batch, context) and row["step_seconds"] == row["step_seconds"]:
                met = row["fraction_of_floor"] >= target
                lines.append(f"{row['lowering']}+{row['inner_compile']}+skinny-{row.get('skinny_matmuls')}"
                             f"+verify-{row.get('verify_attention', 'default')} k={k} b={batch} ctx={context}: "
                             f"{row['fraction_of_floor']:.1%} of the floor (target {target:.0%}, {'met' if met else 'missed'})")
    for row in results.rows(result, "compile"):
        for key, limit in COMPILE_TARGETS.items():
            if row.get(key) is not None:
                lines.append(f"{row['lowering']}+{row['inner_compile']} {key.replace('_', ' ')} {row[key]:.1f} s "
                             f"(target < {limit:.0f} s, {'met' if row[key] < limit else 'missed'})")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
    else:
        require_cuda("bench.step")
    fresh_cache = None if args.smoke else fresh_inductor_cache()
    rank, world = init_from_env("gloo" if args.smoke else "nccl")
    if world != 1:
        raise SystemExit(f"bench.step runs on one GPU (torchrun --nproc-per-node 1 -m bench.step), got {world} ranks")
    device = torch.device("cpu") if args.smoke else torch.device("cuda", torch.cuda.current_device())
    tp = parallel.build(1, 1)
    cfg = model_config(args)
    started = time.time()
    result = results.start("step", argv, device)
    run = result["run"]
    run.update(shapes={"model": "kimi-k2" if not args.smoke else "tiny-512", "layers": cfg.num_layers,
                       "heads": cfg.num_heads, "kv_lora_rank": cfg.kv_lora_rank, "rope_dim": cfg.qk_rope_head_dim,
                       "intermediate_size": 2048, "vocab_size": cfg.vocab_size, "dtype": "bfloat16",
                       "page_size": page_size(1), "draft": args.draft, "repeats_per_graph": args.repeats},
               inductor_cache_fresh=fresh_cache)
    run.update(measure_rates(args, device))

    def save() -> None:
        run["seconds"] = time.time() - started
        run["targets"] = summary(result)
        results.write(result, args.out)

    original = MLAKVPool._allocate
    MLAKVPool._allocate = shared_kv_allocate
    try:
        attention_cache = {}
        for lowering, inner, skinny in args.combos:
            if time.time() - started > args.budget_s:
                run.setdefault("skipped", []).append(f"{lowering}:{inner}:{skinny} (budget)")
                continue
            bench_combo(args, cfg, lowering, inner, skinny, device, tp, result, attention_cache)
            save()
    finally:
        MLAKVPool._allocate = original
    save()
    print("\n".join(tables.step(result)))
    print(f"wrote {args.out} in {run['seconds']:.0f} s")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
