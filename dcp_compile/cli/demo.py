"""`dcp-compile demo`: DCP decode on CPU ranks, checked against dcp_size=1.

With --checkpoint DIR both models load a DeepSeek-V2/V3 or Kimi-K2 checkpoint folder; --prompt-ids
or (where the folder has tokenizer.json) --prompt set every request's prompt, and the JSON's
`generated` holds each request's greedy tokens of the DCP run (`generated_text` decoded).
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dcp_compile.cli import backend_flags
from dcp_compile.cli.arguments import int_in, number

from dcp_compile.lowering import registry
from dcp_compile.cost_model import STRATEGIES
from dcp_compile.debug import dump as text_dump
from dcp_compile.debug.fake_capture import MAX_LAYERS
from dcp_compile.ops.targets import WINDOW_QUERIES
from dcp_compile.runtime.launch import DEFAULT_TIMEOUT_S
from dcp_compile.harness.scenario import MODES, Scenario, compare, compare_torchrun


DEFAULT_CONTEXT = "1,3,17,64"
TOKENIZER_FILE = "tokenizer.json"
MAX_PAD_ROWS = 1024
"""Padded rows per batch: a graph bucket's worth, not a memory-sized allocation in every rank."""
MAX_SEED = 2**32 - 1
"""The demo derives the weights' and verify steps' seeds from --seed (seed x 1000003 + a name's
CRC-32, seed x 7919 + step); torch takes seeds of 64 bits, so the seed itself stays within 32."""


def _lengths(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--context takes one length or a comma list of lengths, got {text!r}") from None
    return values


def _prompt_ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--prompt-ids takes a comma list of token ids, got {text!r}") from None


def _tokenizer(checkpoint: str | None):
    """The checkpoint's tokenizer.json, through the optional `tokenizers` package."""
    if checkpoint is None or not (Path(checkpoint) / TOKENIZER_FILE).is_file():
        raise ValueError(f"--prompt needs --checkpoint DIR with a {TOKENIZER_FILE} (else give --prompt-ids)")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("--prompt needs the tokenizers package: pip install tokenizers (or give --prompt-ids)") from None
    return Tokenizer.from_file(str(Path(checkpoint) / TOKENIZER_FILE))


def _check_flags(args) -> None:
    if args.checkpoint is not None and args.model is not None:
        raise ValueError("--model and --checkpoint exclude each other: the checkpoint's config.json is the model")
    if args.prompt is not None and args.prompt_ids is not None:
        raise ValueError("--prompt and --prompt-ids exclude each other")
    if (args.prompt is not None or args.prompt_ids is not None) and args.context is not None:
        raise ValueError("--context sets random prompts' lengths; --prompt / --prompt-ids set the prompt itself")


def register(sub) -> None:
    p = sub.add_parser("demo", help="prefill + decode/verify/extend under DCP on CPU ranks, compared with dcp_size=1")
    p.add_argument("--mode", default="decode", choices=MODES,
                   help="decode: 1 token per step; verify: k tokens per step with scripted accept/reject; "
                        "extend: chunked prefill over a sharded prefix, then decode")
    p.add_argument("--dcp-size", type=int_in(1), default=2, help="ranks the KV cache is sharded over, >= 1 (default 2)")
    p.add_argument("--tp-size", type=int_in(1), default=None,
                   help="tensor-parallel ranks to spawn, >= 1, a multiple of the DCP size (default: the DCP size)")
    p.add_argument("--batch", type=int_in(1), default=4, help="requests, >= 1 (default 4)")
    p.add_argument("--context", default=None, help=f"prompt length, or comma list cycled over the batch (default {DEFAULT_CONTEXT})")
    p.add_argument("--steps", type=int_in(0), default=8, help="greedy decode steps, >= 0 (default 8)")
    p.add_argument("--seed", type=int_in(0, MAX_SEED), default=0,
                   help=f"seed of the weights, prompts and verify's accept/reject, 0..{MAX_SEED} (2^32 - 1; default 0)")
    p.add_argument("--model", default=None,
                   help="model preset (default tiny; with --kernels npu, tiny-512: FIA's MLA path needs R = 512, P = 64)")
    p.add_argument("--layers", type=int_in(1, MAX_LAYERS), default=None,
                   help=f"override the preset's layer count, 1..{MAX_LAYERS}")
    p.add_argument("--interleave", type=int_in(1), default=1, help="interleave size I, >= 1 (default 1)")
    p.add_argument("--page-size", type=int_in(1), default=None,
                   help="KV page size, >= 1 (default: the interleave size)")
    p.add_argument("--draft-len", type=int_in(1, WINDOW_QUERIES), default=7,
                   help=f"verify: tokens per request per step, 1..{WINDOW_QUERIES} (default 7)")
    p.add_argument("--chunk", type=int_in(1), default=None, help="extend: prompt tokens per request per step, >= 1")
    p.add_argument("--extend-strategy", default="auto", choices=("auto",) + STRATEGIES,
                   help="how attention reaches the sharded KV (auto: the cost model picks per batch)")
    p.add_argument("--shared-prefix", type=int_in(0), default=0,
                   help="request 1 shares this many prompt tokens of request 0, >= 0 (default 0)")
    p.add_argument("--pad-rows", type=int_in(0, MAX_PAD_ROWS), default=1,
                   help=f"padded rows per batch, written to location 0, 0..{MAX_PAD_ROWS} (default 1)")
    p.add_argument("--kernels", default="auto", choices=registry.names(),
                   help="kernels of the DCP model: torch reference, triton (on CPU in Triton's interpreter: "
                        "TRITON_INTERPRET=1), flashinfer (CUDA, Hopper; a torch stand-in of FlashInfer on CPU), npu "
                        "(Ascend FIA + npu_attention_update; CPU stand-ins without torch_npu; both models use it), auto")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="model dtype (default float32; bfloat16 with --kernels npu, since FIA takes bf16/fp16)")
    p.add_argument("--block-size", type=int_in(1), default=128,
                   help="--kernels npu: FIA block size, 16 or 128 (default 128, as the engines use; 16 makes short "
                        "contexts cross blocks); pages are block x dcp_size locations")
    backend_flags.add(p)
    p.add_argument("--inner-compile", default="auto", choices=registry.inner_compilers(),
                   help="the DCP model's compiler after the DCP passes: eager (run the FX graph), inductor, torchair "
                        "(Ascend; needs torch_npu), or auto (default: inductor with flashinfer or triton on CUDA, else "
                        "eager); the dcp_size=1 baseline runs eager")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "npu"),
                   help="ranks on CPU (gloo, default), one CUDA GPU each (NCCL) or one Ascend NPU each (HCCL, needs torch_npu, or DCP_COMPILE_NPU_EMULATOR=1 for the emulated device)")
    p.add_argument("--timeout", type=number, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds a collective waits for a stalled rank before the run fails (default "
                        f"{DEFAULT_TIMEOUT_S:g}; finite, at most a year)")
    p.add_argument("--launch", default="spawn", choices=("spawn", "torchrun"),
                   help="spawn the ranks here (default), or join the ranks of a torchrun launch, on one node or "
                        "several (every TP group of the world runs the check; rank 0 prints)")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="load this checkpoint folder (config.json + safetensors; DeepSeek-V2/V3, Kimi-K2) instead of a "
                        "random preset; --layers loads its first layers only")
    p.add_argument("--prompt-ids", default=None, metavar="IDS", help="every request's prompt, as comma-separated token ids")
    p.add_argument("--prompt", default=None, metavar="TEXT",
                   help="every request's prompt, encoded with the checkpoint's tokenizer.json (needs the tokenizers "
                        "package); the generated tokens are decoded too")
    p.add_argument("--graphs", action="store_true",
                   help="replay every decode and verify step from captured device graphs (CUDA graphs, NPU graphs; "
                        "needs --device cuda or npu)")
    p.add_argument("--regions", action="store_true",
                   help="each decoder layer of the DCP model a compile region: the passes and the inner compile run "
                        "once per kind of layer, not once per layer")
    p.add_argument("--json", action="store_true", help="end with one JSON summary line")
    p.set_defaults(handler=run)


def run(args) -> int:
    _check_flags(args)
    dump_folder = text_dump.env_folder()
    if dump_folder is not None:  # else each rank would find it out at apply(), after the spawn
        text_dump.writable_folder(dump_folder, f"{text_dump.ENV_FOLDER} folder")
    tokenizer = _tokenizer(args.checkpoint) if args.prompt is not None else None
    if tokenizer is not None:
        prompt_ids = tuple(tokenizer.encode(args.prompt).ids)
    else:
        prompt_ids = _prompt_ids(args.prompt_ids) if args.prompt_ids is not None else None
    tp_size = args.tp_size if args.tp_size is not None else args.dcp_size
    scenario = Scenario(
        mode=args.mode, draft_len=args.draft_len, chunk=args.chunk, attention_strategy=args.extend_strategy,
        page_size=args.page_size, shared_prefix=args.shared_prefix, dcp_size=args.dcp_size, tp_size=tp_size, batch=args.batch,
        contexts=_lengths(args.context or DEFAULT_CONTEXT), steps=args.steps, seed=args.seed, layers=args.layers,
        interleave=args.interleave, pad_rows=args.pad_rows, kernels=args.kernels, block_size=args.block_size,
        device=args.device, timeout=args.timeout, inner_compile=args.inner_compile,
        model=args.model, dtype=args.dtype,
        checkpoint=args.checkpoint, prompt_ids=prompt_ids, graphs=args.graphs, regions=args.regions,
        options=backend_flags.values(args),
    )
    if args.launch == "torchrun":
        result, rank = compare_torchrun(scenario)
        if rank != 0:
            return _exit_code(result)
    else:
        result = compare(scenario)
    if tokenizer is not None:
        result["generated_text"] = [tokenizer.decode(ids) for ids in result["generated"]]
    console = Console(stderr=args.json)
    table = Table(title=f"dcp-compile demo: {scenario.model_name}, {scenario.mode}, DCP {scenario.dcp_size} x TP "
                        f"{scenario.tp_size}, I={scenario.interleave}, kernels {scenario.kernels}, {scenario.dtype}, "
                        f"{result['device']}{' (emulated)' if result['emulated'] else ''}")
    table.add_column("check")
    table.add_column("value", justify="right")
    table.add_row("greedy tokens identical to dcp_size=1 (tokens_match)", "yes" if result["tokens_match"] else "NO")
    table.add_row("  of which near-ties within rounding, flipped", str(result["near_tie_flips"]))
    table.add_row("max |logits - logits(dcp=1)|", f"{result['max_abs_diff']:.3e}")
    table.add_row(f"all logits within {result['tolerance']:.2e} (outputs_match)", "yes" if result["outputs_match"] else "NO")
    table.add_row("all logits finite (padded rows too)", "yes" if result["finite"] else "NO")
    table.add_row("requests x context", f"{scenario.batch} x {result['contexts']}")
    table.add_row("KV tokens stored per DCP rank", " / ".join(map(str, result["tokens_stored_per_dcp_rank"])) + f" of {result['tokens_total']}")
    table.add_row("KV rows per rank (allocated)", str(result["kv_rows_per_rank"]))
    table.add_row("logical capacity ratio, same memory", f"{result['kv_capacity_ratio']:.4f}")
    table.add_row("rows lost to reserved loc 0 / rounding", str(result["kv_rows_lost"]))
    for name, sites in result["pass_summary"].items():
        if name != "verify":
            table.add_row(f"pass {name}: sites", str(sites))
    table.add_row("graphs compiled (torch.compile)", f"{result['graphs_captured']} (inner compiler {result['inner_compile']})")
    if scenario.graphs:
        table.add_row(f"steps replayed from {result['device']} graphs",
                      f"{result['graph_replays']} ({result['device_graphs_captured']} graphs captured)")
    counts = ", ".join(f"{k} x{v}" for k, v in sorted(result["strategy_counts"].items()))
    table.add_row("attention strategy per batch", counts)
    table.add_row("last choice and why", result["last_strategy_reason"] or "-")
    table.add_row("wall time (s)", f"{result['seconds']:.1f}")
    for request, ids in enumerate(result["generated"]):
        shown = repr(result["generated_text"][request]) if tokenizer is not None else " ".join(map(str, ids))
        table.add_row(f"request {request}: generated (DCP)", shown)
    console.print(table)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "tokens"}))
    return _exit_code(result)


def _exit_code(result: dict) -> int:
    return 0 if result["tokens_match"] and result["outputs_match"] and result["finite"] else 1
