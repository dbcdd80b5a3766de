"""An unmodified transformers DeepSeek-V3 through dcp_compile.apply against transformers' own
generate(), side by side in one run, on one CUDA GPU.

    python -m bench.hf_generate --out bench/results/hf_generate_h200.json

The model has DeepSeek-V3's attention widths (64 heads, q-LoRA 1536, R 512, P 64, n 128, v 128,
hidden 7168) with few layers and small experts, so that transformers' own per-head cache fits;
bf16, random weights (initializer_range 0.02). For each context and batch, a random prompt and
`--new-tokens` greedy tokens:
- transformers' best: a static cache (cache_implementation="static"), which generate() decodes
  under its own torch.compile (CUDA graphs, "reduce-overhead"), warmed up before timing;
- dcp_compile at dcp_size 1 on each `--kernels` back end (inductor inner compile), its decode
  steps replayed from CUDA graphs captured per batch size (capture_decode_graphs; --no-graphs
  runs them through the compiled step), warmed up.
Per-token decode latency: the median gap between consecutive generated tokens after the first,
on the GPU's timeline (a logits processor records an event per token), medians over `--repeats`
calls after a warm-up call. A back end's error (a kernel's limit) is recorded in its row.
Tokens are compared under the near-tie rule (tests/gpu/test_hf_front_end.py) with transformers'
default generate() (dynamic cache, eager), and also with its compiled static-cache run
(`*_vs_static`; that run parted from fp32 by 4.5 at one step on an H100). --fp32-check measures
each side against an fp32 copy (and, where a side's tokens part from the eager run's, which of
the two tokens fp32 prefers), --profile each side's device busy time per token (the latency
less it is host time the GPU waited for), --host-profile our host functions per token. The KV
bytes per token are each cache's allocated bytes over its token slots.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from bench.lib import result as results
from bench.lib.timing import require_cuda

SHAPE = dict(hidden_size=7168, num_attention_heads=64, num_key_value_heads=64, q_lora_rank=1536, kv_lora_rank=512,
             qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, intermediate_size=2048,
             moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
             first_k_dense_replace=1, n_group=1, topk_group=1, vocab_size=32000, initializer_range=0.02,
             eos_token_id=None, bos_token_id=None, pad_token_id=None)


def build(layers: int, max_positions: int, dense: bool = False):
    """The bf16 model on the GPU; dense: every layer's MLP dense (no MoE router)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    shape = dict(SHAPE, first_k_dense_replace=layers) if dense else SHAPE
    config = DeepseekV3Config(num_hidden_layers=layers, max_position_embeddings=max_positions, **shape)
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = DeepseekV3ForCausalLM(config).to(torch.bfloat16).eval()
    return model


class StepTimer:
    """A logits processor that records a CUDA event as each token's logits are processed (no sync of
    its own): the decode latency is the median gap between consecutive tokens after the first
    (whose gap holds the prefill), on the GPU's timeline, so no compile, capture or allocation of
    another call is in it. generate() syncs the host every token (its stopping check), so a gap is
    the host's work for the token plus the device's."""

    def __init__(self):
        self.events: list[torch.cuda.Event] = []

    def __call__(self, input_ids, scores):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append(event)
        return scores

    def decode_seconds(self) -> float:
        torch.cuda.synchronize()
        gaps = [a.elapsed_time(b) / 1e3 for a, b in zip(self.events[1:], self.events[2:])]
        return statistics.median(gaps)


def timed_generate(model, input_ids, new_tokens: int, **kwargs):
    """(median decode seconds a token, the output) of one generate() call."""
    from transformers import LogitsProcessorList

    timer = StepTimer()
    with torch.no_grad():
        out = model.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True,
                             logits_processor=LogitsProcessorList([timer]), **kwargs)
    cache = out.past_key_values
    if hasattr(cache, "release"):
        cache.release()  # a DCP cache's pool locations, held by the output until it is dropped
    return timer.decode_seconds(), out


def per_token(model, input_ids, new_tokens: int, repeats: int, **kwargs):
    """(median per-token decode seconds over `repeats` calls, the last call's output), after a
    warm-up call (every graph compiled and captured)."""
    timed_generate(model, input_ids, new_tokens, **kwargs)
    runs = [timed_generate(model, input_ids, new_tokens, **kwargs) for _ in range(repeats)]
    return statistics.median(seconds for seconds, _ in runs), runs[-1][1]


def kernel_seconds(model, input_ids, new_tokens: int, **kwargs) -> dict[str, float]:
    """Each CUDA kernel's total device seconds over one generate() call (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    timed_generate(model, input_ids, new_tokens, **kwargs)  # a static cache's new length compiles here, unprofiled
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed_generate(model, input_ids, new_tokens, **kwargs)
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total > 0:
            totals[event.name] = totals.get(event.name, 0.0) + event.device_time_total / 1e6
    return totals


def device_busy(model, input_ids, new_tokens: int, **kwargs) -> dict:
    """The device's busy time per decode token: the kernel time of a generate() of `new_tokens`
    less that of one of half as many (the prefill cancels), over the tokens between; and the
    kernels that take most of it. A token's latency less this is time the device waited."""
    fewer = max(2, new_tokens // 2)
    more_run, fewer_run = (kernel_seconds(model, input_ids, n, **kwargs) for n in (new_tokens, fewer))
    per_token = {name: (more_run.get(name, 0.0) - fewer_run.get(name, 0.0)) / (new_tokens - fewer)
                 for name in set(more_run) | set(fewer_run)}
    top = sorted(per_token.items(), key=lambda item: -item[1])[:8]
    return dict(busy_s=sum(per_token.values()), kernels=len([v for v in per_token.values() if v > 0]),
                top_kernels=[(name[:90], seconds) for name, seconds in top])


def host_seconds(model, input_ids, new_tokens: int, **kwargs) -> list:
    """The host's Python functions that take most of a decode token (cProfile's own time of a
    generate() of `new_tokens` less that of one of half as many, over the tokens between)."""
    import cProfile
    import pstats

    def own_times(n: int) -> dict:
        timed_generate(model, input_ids, n, **kwargs)
        profiler = cProfile.Profile()
        profiler.runcall(timed_generate, model, input_ids, n, **kwargs)
        return {f"{func[2]} ({func[0].rsplit('/', 2)[-1]}:{func[1]})": stat[2]
                for func, stat in pstats.Stats(profiler).stats.items()}

    fewer = max(2, new_tokens // 2)
    more_run, fewer_run = own_times(new_tokens), own_times(fewer)
    per_token = {name: (more_run.get(name, 0.0) - fewer_run.get(name, 0.0)) / (new_tokens - fewer)
                 for name in set(more_run) | set(fewer_run)}
    return [(name[:110], seconds) for name, seconds in sorted(per_token.items(), key=lambda item: -item[1])[:15]]


def decode_vs_fp32(exact_model, out, steps: int) -> list[float]:
    """The largest logit difference of a generate() output's decode steps 1..steps from an fp32
    forward (no cache) over the output's own tokens up to each step: which side parts from the
    exact result where two bf16 runs part."""
    prompt = out.sequences.shape[1] - len(out.logits)
    diffs = []
    with torch.no_grad():
        for step in range(1, min(steps, len(out.logits) - 1) + 1):
            exact = exact_model(out.sequences[:, : prompt + step], use_cache=False, logits_to_keep=1).logits[:, -1]
            diffs.append(float((out.logits[step].float() - exact.float()).abs().max()))
    return diffs


def flips_vs_fp32(exact_model, got, want) -> list[dict]:
    """Where two generate() outputs part, which of them an fp32 forward agrees with. For each row's
    first differing token: the fp32 logits over the tokens both share up to it, and how far each
    side's token falls short of fp32's best there (0.0: fp32's own choice); "ours" is `got`'s
    token (the side measured, transformers' static run included), "theirs" `want`'s."""
    prompt = got.sequences.shape[1] - len(got.logits)
    flips = []
    with torch.no_grad():
        for row in range(got.sequences.shape[0]):
            differ = (got.sequences[row, prompt:] != want.sequences[row, prompt:]).nonzero()
            if not len(differ):
                continue
            step = int(differ[0])
            shared = got.sequences[row : row + 1, : prompt + step]
            exact = exact_model(shared, use_cache=False, logits_to_keep=1).logits[0, -1].float()
            ours, theirs = int(got.sequences[row, prompt + step]), int(want.sequences[row, prompt + step])
            best = float(exact.max())
            flips.append(dict(row=row, step=step, ours_short_of_fp32_best=best - float(exact[ours]),
                              theirs_short_of_fp32_best=best - float(exact[theirs])))
    return flips


def near_tie(got, want, tolerance: float) -> dict:
    """Tokens under the near-tie rule: rows may part only where transformers' two candidates are
    within 2 x tolerance; the largest logit difference before each row's first flip."""
    got_logits, want_logits = torch.stack(got.logits, 1).float(), torch.stack(want.logits, 1).float()
    prompt = got.sequences.shape[1] - got_logits.shape[1]
    worst, flips, agree = 0.0, 0, True
    for row in range(got.sequences.shape[0]):
        for step in range(got_logits.shape[1]):
            worst = max(worst, float((got_logits[row, step] - want_logits[row, step]).abs().max()))
            ours, theirs = int(got.sequences[row, prompt + step]), int(want.sequences[row, prompt + step])
            if ours != theirs:
                flips += 1
                agree &= float(want_logits[row, step, theirs] - want_logits[row, step, ours]) <= 2 * tolerance
                break
    return dict(tokens_match=agree and worst < tolerance, near_tie_flips=flips, max_abs_logit_diff=worst,
                reference_max_abs_logit=float(want_logits.abs().max()),
                tokens_equal=bool(torch.equal(got.sequences, want.sequences)))


def fp32_copy(model):
    """An fp32 copy of the bf16 model (its bf16 weights, exactly): the reference both bf16 runs
    are measured against (--fp32-check)."""
    return copy.deepcopy(model).float()


def first_logits(model, input_ids) -> torch.Tensor:
    """The prefill's last-position logits, in fp32, of a transformers forward without a cache."""
    with torch.no_grad():
        return model(input_ids, use_cache=False, logits_to_keep=1).logits[:, -1].float()


def first_logits_of(out) -> torch.Tensor:
    """The first generated token's logits of a generate() output."""
    return out.logits[0].float()


def cache_bytes_per_token(cache, batch: int) -> float:
    """A transformers cache's allocated K and V bytes over its token slots (batch x max length)."""
    total = slots = 0
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):
            total += tensor.numel() * tensor.element_size()
        slots = batch * layer.keys.shape[-2]
    return total / slots


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kernels", nargs="+", default=["flashinfer", "triton"])
    parser.add_argument("--no-graphs", action="store_true", help="decode steps without CUDA graph replay")
    parser.add_argument("--regions", action="store_true",
                        help="each decoder layer a compile region (apply(..., regions=True)): one compile per kind of layer")
    parser.add_argument("--dense-mlp", action="store_true",
                        help="every layer's MLP dense: no MoE router, whose top-k choice a bf16 rounding can flip")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[0],
                        help="apply(..., block_size=) for each back end, side by side (0: the back end's default; "
                             "FlashInfer's plan lists each row's pages on the host every step)")
    parser.add_argument("--fp32-check", action="store_true",
                        help="against an fp32 copy of the model: at batch 1, the prefill's and first decode steps' "
                             "logits of transformers (bf16) and of each back end; at every batch, where a side's tokens "
                             "part from transformers' eager generate(), which token fp32 prefers")
    parser.add_argument("--profile", action="store_true",
                        help="the device's busy time per decode token (torch.profiler) of each side, and its top kernels")
    parser.add_argument("--host-profile", action="store_true",
                        help="the host's Python functions that take most of one of our decode tokens (cProfile)")
    parser.add_argument("--fp32-steps", type=int, default=3,
                        help="with --fp32-check, decode steps (after the first token) compared with an fp32 forward")
    parser.add_argument("--tolerance", type=float, default=0.25, help="bf16 logit tolerance of the near-tie rule")
    args = parser.parse_args(argv)
    require_cuda("bench.hf_generate")
    import dcp_compile

    result = results.start("hf_generate", argv, torch.device("cuda"))
    longest = max(args.contexts) + args.new_tokens
    reference = build(args.layers, longest + 1, args.dense_mlp)
    page = max(args.block_sizes + [1])  # at dcp_size 1 a page is one block; a cache takes whole pages
    rows_needed = max(args.batches) * -(-longest // page) * page + page
    ours = {}
    for kernels in args.kernels:  # a back end's rows are named kernels, or kernels_b<block size>
        for block in args.block_sizes:
            ours[f"{kernels}_b{block}" if block else kernels] = dcp_compile.apply(
                copy.deepcopy(reference), dcp_size=1, kernels=kernels, inner_compile="inductor", kv_capacity=rows_needed,
                regions=args.regions, **({"block_size": block} if block else {}))
    if not args.no_graphs:
        for model in ours.values():
            model.capture_decode_graphs(batch_sizes=args.batches, max_length=longest)
    pool = dcp_compile.state(next(iter(ours.values()))).kv_pool
    ours_bytes = pool.cache(0)[0].numel() * pool.cache(0).element_size() * pool.num_layers
    # transformers' attention expands the cached latent into per-head K (n + P) and V (v) at every
    # step and reads those: bytes per cached token per layer, from the config.
    expanded = SHAPE["num_attention_heads"] * (SHAPE["qk_nope_head_dim"] + SHAPE["qk_rope_head_dim"]
                                               + SHAPE["v_head_dim"]) * 2
    result["run"] = dict(shape=SHAPE, layers=args.layers, new_tokens=args.new_tokens, dtype="bfloat16",
                         kernels=args.kernels, tolerance=args.tolerance, decode_graphs=not args.no_graphs,
                         regions=args.regions, dense_mlp=args.dense_mlp,
                         attention_bytes_per_token_per_layer=dict(transformers_expanded_kv=expanded,
                                                                  dcp_compile_latent=ours_bytes / pool.num_layers,
                                                                  ratio=expanded * pool.num_layers / ours_bytes))
    theirs_bytes = None
    generator = torch.Generator().manual_seed(1)
    for context in args.contexts:
        for batch in args.batches:
            input_ids = torch.randint(0, SHAPE["vocab_size"], (batch, context), generator=generator).cuda()
            started = time.perf_counter()
            # transformers sizes a static cache at least as long as the model's last one (to spare a
            # recompile): without this a 4k row after a 16k one timed a 16k-long cache
            reference.__dict__.pop("_previous_max_cache_length", None)
            theirs, want = per_token(reference, input_ids, args.new_tokens, args.repeats,
                                     cache_implementation="static")
            # The tokens' reference: transformers' default generate() (dynamic cache, no compile). Its
            # compiled static-cache run, the speed baseline, parted from an fp32 forward by 4.5 at one
            # decode step on an H100 (bench/results/hf_front_end_2026-12-05).
            _, eager = timed_generate(reference, input_ids, args.new_tokens)
            profiled = args.profile and batch == min(args.batches)  # one batch: the profiles cost generate() calls
            if profiled:
                row_profile = {"transformers": device_busy(reference, input_ids, args.new_tokens,
                                                           cache_implementation="static")}
            if theirs_bytes is None:
                theirs_bytes = cache_bytes_per_token(want.past_key_values, batch)
                result["run"]["kv_bytes_per_token"] = dict(transformers=theirs_bytes, dcp_compile=ours_bytes,
                                                           ratio=theirs_bytes / ours_bytes)
                print(f"KV bytes per token: transformers {theirs_bytes:.0f}, dcp_compile {ours_bytes:.0f} "
                      f"({theirs_bytes / ours_bytes:.1f}x less)", flush=True)
            row = dict(context=context, batch=batch, transformers_static_compiled_s=theirs)
            row.update({f"{key}_static_vs_eager": value for key, value in near_tie(want, eager, args.tolerance).items()})
            if profiled:
                row["transformers_device_busy_s"] = row_profile["transformers"]["busy_s"]
            exact = exact_model = None
            if args.fp32_check:  # who is off where bf16 results part: each side against fp32
                exact_model = fp32_copy(reference)
                row["flips_vs_fp32_static"] = flips_vs_fp32(exact_model, want, eager)
            if args.fp32_check and batch == 1:
                exact = first_logits(exact_model, input_ids)
                row["transformers_bf16_vs_fp32"] = float((first_logits_of(want) - exact).abs().max())
                row["transformers_decode_vs_fp32"] = decode_vs_fp32(exact_model, want, args.fp32_steps)
            for kernels, model in ours.items():
                try:
                    seconds, got = per_token(model, input_ids, args.new_tokens, args.repeats)
                except Exception as exc:  # noqa: BLE001 - a back end's limit, recorded in the row
                    row[f"error_{kernels}"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                    continue
                row[f"dcp_{kernels}_s"] = seconds
                row[f"speedup_{kernels}"] = theirs / seconds
                row.update({f"{key}_{kernels}": value for key, value in near_tie(got, eager, args.tolerance).items()})
                row.update({f"{key}_{kernels}_vs_static": value
                            for key, value in near_tie(got, want, args.tolerance).items()})
                if exact_model is not None:
                    row[f"flips_vs_fp32_{kernels}"] = flips_vs_fp32(exact_model, got, eager)
                if exact is not None:
                    row[f"dcp_{kernels}_vs_fp32"] = float((first_logits_of(got) - exact).abs().max())
                    row[f"dcp_{kernels}_decode_vs_fp32"] = decode_vs_fp32(exact_model, got, args.fp32_steps)
                if profiled:
                    row_profile[kernels] = device_busy(model, input_ids, args.new_tokens)
                    row[f"dcp_{kernels}_device_busy_s"] = row_profile[kernels]["busy_s"]
                    if args.host_profile:
                        row_profile[kernels]["host_top"] = host_seconds(model, input_ids, args.new_tokens)
                row[f"graphs_{kernels}"] = len(dcp_compile.state(model).reports)
                row[f"replays_{kernels}"] = model.decode_graphs.replays if model.decode_graphs else 0
            if profiled:
                row["profile"] = row_profile
            del exact_model
            row["wall_s"] = time.perf_counter() - started
            results.add(result, results.MAIN, row)
            print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
            results.write(result, args.out)  # after every row: a run cut short keeps what it measured
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
