"""`dcp-compile dump`: every pass's graph before and after, op counts and timing, for a model
preset, or a checkpoint folder's config (--checkpoint: its MoE layers too; no weight is read),
captured with shapes only (meta weights, fake process groups, nothing executed).

Writes into --out the same files as DCP_COMPILE_DUMP (dcp_compile/debug/dump.py), plus
dump.json (what was captured, timings), index.html (--format html) or .dot/.svg files
(--format svg), and prints a summary table.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dcp_compile.cli import backend_flags
from dcp_compile.cli.arguments import int_in
from dcp_compile.lowering import registry
from dcp_compile.debug import dump as text_dump
from dcp_compile.debug.fake_capture import (ATTENTION_STRATEGIES, DTYPES, MAX_BATCH, MAX_CONTEXT, MAX_LAYERS,
                                            MAX_PAGE_TABLE_ENTRIES, MAX_PAGES, GraphSpec, capture)
from dcp_compile.models import hf_config
from dcp_compile.models.config import PRESETS, MLAModelConfig
from dcp_compile.workload import MODES
from dcp_compile.passes.manager import PassManager
from dcp_compile.ops.targets import WINDOW_QUERIES

log = logging.getLogger("dcp_compile.cli.dump")

FORMATS = ("text", "html", "svg")
MLA_OP = "dcp::mla_attention"


@dataclass(frozen=True)
class CheckpointGraphSpec(GraphSpec):
    """A GraphSpec whose model is a checkpoint folder's config.json (`model` is its name)."""

    checkpoint: str = ""

    def model_config(self) -> MLAModelConfig:
        ckpt = hf_config.read_config(self.checkpoint)
        cfg = ckpt.model
        if self.num_heads is not None:
            raise ValueError("--num-heads cannot be overridden for a checkpoint")
        if self.layers is not None:
            if self.layers > cfg.num_layers:
                raise ValueError(f"--layers {self.layers} exceeds the checkpoint's num_hidden_layers {cfg.num_layers}")
            cfg = cfg.with_layers(self.layers)
        hf_config.check_tp_size(ckpt, self.tp)
        return cfg


def register(sub) -> None:
    p = sub.add_parser(
        "dump", help="dump each pass's graph before and after, op counts and timing (no GPU, one process)",
        description="Capture a model preset with shapes only and run the whole DCP pass pipeline on it.",
    )
    p.add_argument("--model", default=None,
                   help=f"model preset: {', '.join(PRESETS)} (default tiny; tiny-512 with --kernels npu)")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="capture the model of this checkpoint folder's config.json (DeepSeek-V2/V3, Kimi-K2; MoE "
                        "layers included) instead of a preset; no weight is read")
    p.add_argument("--layers", type=int_in(), default=None, help=f"layer count, keeping the preset's pattern (at most {MAX_LAYERS})")
    p.add_argument("--dcp-size", type=int_in(), default=2, help="DCP size N (default 2)")
    p.add_argument("--tp-size", type=int_in(), default=None, help="TP size; heads are split over it (default: DCP size)")
    p.add_argument("--mode", default="decode", help=f"batch shape: {', '.join(MODES)} (default decode)")
    p.add_argument("--out", required=True, help="output folder (created if missing)")
    p.add_argument("--format", default="text", help=f"{', '.join(FORMATS)} (default text; text files are always written)")
    p.add_argument("--only", default=None, metavar="PASS", help="dump the graphs of this pass only")
    p.add_argument("--disable", action="append", default=[], metavar="PASS", help="switch a pass off (repeatable)")
    p.add_argument("--batch", type=int_in(), default=4, help=f"requests (default 4, at most {MAX_BATCH})")
    p.add_argument("--draft-len", type=int_in(), default=4, help=f"verify: tokens per request k, 1..{WINDOW_QUERIES} (default 4)")
    p.add_argument("--chunk", type=int_in(), default=64, help=f"extend: new tokens per request (default 64, at most {MAX_CONTEXT})")
    p.add_argument("--context", type=int_in(), default=256,
                   help=f"tokens cached per request before the step (default 256, at most {MAX_CONTEXT}); the batch may "
                        f"hold {MAX_PAGE_TABLE_ENTRIES} tokens and {MAX_PAGES} pages in all (Kimi-K2's 128k context at "
                        "batch 256 needs --page-size 32 or more)")
    p.add_argument("--interleave", type=int_in(), default=1, help="interleave size I (default 1)")
    p.add_argument("--page-size", type=int_in(), default=None,
                   help=f"KV page size (default: the interleave size; at most {MAX_CONTEXT})")
    p.add_argument("--dtype", default=None, help=f"{', '.join(DTYPES)} (default bfloat16)")
    p.add_argument("--attention-strategy", default="auto",
                   help=f"{', '.join(ATTENTION_STRATEGIES)}: which DCP attention rewrite runs "
                        "(default auto: the cost model picks for this batch, and the summary says why)")
    p.add_argument("--debug-checks", action="store_true", help="also run the debug-check passes")
    p.add_argument("--kernels", default="auto", choices=registry.names(),
                   help="kernels the lowering picks (flashinfer: FlashInfer MLA nodes with their host plans; npu: Ascend "
                        "FIA and npu_attention_update nodes; default auto)")
    p.add_argument("--block-size", type=int_in(), default=128, help="--kernels npu: FIA block size (default 128)")
    backend_flags.add(p)
    p.set_defaults(handler=run)


def _check_names(only: str | None, disabled: list[str]) -> None:
    registry.check_pass_names(disabled)
    if only is not None and only not in registry.pass_names():
        raise ValueError(f"unknown pass name {only!r} for --only; passes are {list(registry.pass_names())}")
    if only is not None and only in disabled:
        raise ValueError(f"--only {only} names a pass that --disable switches off")


def _command(args) -> str:
    """The dump command that reproduces this run, every option spelled out."""
    parts = ["dcp-compile", "dump"]
    for option in ("checkpoint", "model", "layers", "dcp_size", "tp_size", "mode", "batch", "draft_len", "chunk", "context",
                   "interleave", "page_size", "dtype", "attention_strategy", "kernels", "block_size", "format", "only",
                   "out"):
        value = getattr(args, option)
        if value is not None:
            parts += [f"--{option.replace('_', '-')}", str(value)]
    parts += backend_flags.spelled(args)
    parts += [item for name in args.disable for item in ("--disable", name)]
    return " ".join(parts + (["--debug-checks"] if args.debug_checks else []))


def _changes(op_diff: dict) -> str:
    return "\n".join(f"{op} {c['before']} -> {c['after']}" for op, c in op_diff.items())


def _print_summary(console: Console, spec: GraphSpec, data: dict, facts: list[str]) -> None:
    table = Table(title=f"dcp-compile dump: {spec.describe()}", title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("pass")
    table.add_column("ran")
    table.add_column("sites", justify="right")
    table.add_column("nodes before -> after", justify="right")
    table.add_column("ms", justify="right")
    table.add_column("op count changes")
    for p in data["passes"]:
        table.add_row(f"{p['order']:02d}", p["name"], "yes" if p["ran"] else "no", str(p["sites"]),
                      f"{p['nodes_before']} -> {p['nodes_after']}", f"{p['milliseconds']:.1f}", _changes(p["op_diff"]))
    console.print(table)
    for fact in facts:
        console.print(fact)


def run(args) -> int:
    if not args.out:
        raise ValueError(f"--out must name a folder, got {args.out!r}")
    fmt = args.format
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {list(FORMATS)}")
    fields = dict(layers=args.layers, dcp_size=args.dcp_size, tp_size=args.tp_size,
                  mode=args.mode, batch=args.batch, draft_len=args.draft_len, chunk=args.chunk,
                  context=args.context, interleave=args.interleave, page_size=args.page_size, dtype=args.dtype,
                  debug_checks=args.debug_checks, attention_strategy=args.attention_strategy, kernels=args.kernels,
                  block_size=args.block_size, options=backend_flags.values(args))
    if args.checkpoint is not None:
        if args.model is not None:
            raise ValueError("--model and --checkpoint exclude each other: the checkpoint's config.json is the model")
        spec = CheckpointGraphSpec(model=Path(args.checkpoint).name, checkpoint=args.checkpoint, **fields)
    else:
        spec = GraphSpec(model=args.model, **fields)
        args.model = spec.model
    _check_names(args.only, args.disable)
    if fmt == "svg":
        from dcp_compile.debug.svg import require_dot

        require_dot()
    out = text_dump.writable_folder(args.out, "output folder")

    captured = capture(spec)
    log.info("captured %s: %d nodes in %.1f s", spec.describe(), len(captured.gm.graph.nodes), captured.seconds)
    writer = text_dump.TextDump(out, only=args.only)
    observers = [writer]
    if fmt == "svg":
        from dcp_compile.debug.svg import DotDump

        observers.append(DotDump(out, only=args.only))
    start = time.perf_counter()
    report = PassManager(captured.pass_config(), args.disable, passes=captured.passes(), observers=observers).run(captured.gm)
    pipeline_seconds = time.perf_counter() - start
    data = text_dump.report_dict(report)
    graph_folder = writer.graph_folder(0)

    decision = captured.strategy_decision()
    mla_before = data["passes"][0]["ops_before"].get(MLA_OP, 0)
    mla_left = data["passes"][-1]["ops_after"].get(MLA_OP, 0)
    facts = [
        f"MLA sites rewritten: {mla_before - mla_left} of {mla_before}",
        f"attention strategy: {decision.reason}" if decision.forced else f"attention strategy (cost model): {decision.reason}",
        f"capture {captured.seconds:.1f} s, passes {data['total_milliseconds']:.0f} ms "
        f"({pipeline_seconds:.1f} s with dump writing)",
    ]
    summary = {
        "command": _command(args),
        "spec": asdict(spec),
        "tp_size": spec.tp,
        "query_tokens": spec.query_tokens,
        "nodes_captured": data["passes"][0]["nodes_before"],
        "mla_sites": mla_before,
        "mla_sites_rewritten": mla_before - mla_left,
        "attention_strategy": decision.as_dict(),
        "capture_seconds": round(captured.seconds, 3),
        "pass_milliseconds": data["total_milliseconds"],
        "pipeline_seconds_with_dump": round(pipeline_seconds, 3),
        "disabled": list(args.disable),
        "only": args.only,
        "graph_folder": str(graph_folder),
    }
    (out / "dump.json").write_text(json.dumps(summary, indent=1) + "\n")
    written = [f"{graph_folder}/ (graphs, {text_dump.REPORT_JSON}, {text_dump.OP_DIFF_TXT})", str(out / "dump.json")]
    if fmt == "html":
        from dcp_compile.debug.html import render

        page = out / "index.html"
        page.write_text(render(data, graph_folder, f"dcp-compile dump: {spec.model}", [spec.describe()] + facts,
                               args.disable))
        written.append(str(page))
    if fmt == "svg":
        from dcp_compile.debug.svg import render_svgs

        svgs = render_svgs(observers[-1].written)
        written.append(f"{len(svgs)} SVG files in {graph_folder}")
    console = Console()
    if not console.is_terminal:  # piped or logged: no terminal width to respect, keep rows whole
        console = Console(width=160)
    _print_summary(console, spec, data, facts + ["written: " + ", ".join(written)])
    return 0
