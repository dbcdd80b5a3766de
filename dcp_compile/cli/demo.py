"""`dcp-compile demo`: DCP decode on CPU ranks, checked against dcp_size=1."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from dcp_compile.scenario import Scenario, compare


def _lengths(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--context takes one length or a comma list of lengths, got {text!r}") from None
    return values


def register(sub) -> None:
    p = sub.add_parser("demo", help="prefill + greedy decode under DCP on CPU ranks, compared with dcp_size=1")
    p.add_argument("--dcp-size", type=int, default=2, help="ranks the KV cache is sharded over (default 2)")
    p.add_argument("--tp-size", type=int, default=None, help="tensor-parallel ranks to spawn (default: dcp size)")
    p.add_argument("--batch", type=int, default=4, help="requests (default 4)")
    p.add_argument("--context", default="1,3,17,64", help="prompt length, or comma list cycled over the batch")
    p.add_argument("--steps", type=int, default=8, help="greedy decode steps (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="tiny", help="model preset (default tiny)")
    p.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--interleave", type=int, default=1, help="interleave size I (default 1)")
    p.add_argument("--pad-rows", type=int, default=1, help="padded rows per batch, written to location 0")
    p.add_argument("--json", action="store_true", help="end with one JSON summary line")
    p.set_defaults(handler=run)


def run(args) -> int:
    scenario = Scenario(
        dcp_size=args.dcp_size, tp_size=args.tp_size or args.dcp_size, batch=args.batch,
        contexts=_lengths(args.context), steps=args.steps, seed=args.seed, model=args.model,
        layers=args.layers, interleave=args.interleave, pad_rows=args.pad_rows,
    )
    result = compare(scenario)
    console = Console(stderr=args.json)
    table = Table(title=f"dcp-compile demo: {scenario.model}, DCP {scenario.dcp_size} x TP {scenario.tp_size}")
    table.add_column("check")
    table.add_column("value", justify="right")
    table.add_row("greedy tokens identical to dcp_size=1", "yes" if result["tokens_match"] else "NO")
    table.add_row("max |logits - logits(dcp=1)|", f"{result['max_abs_diff']:.3e}")
    table.add_row("all logits finite (padded rows too)", "yes" if result["finite"] else "NO")
    table.add_row("requests x context", f"{scenario.batch} x {result['contexts']}")
    table.add_row("KV tokens stored per DCP rank", " / ".join(map(str, result["tokens_stored_per_dcp_rank"])) + f" of {result['tokens_total']}")
    table.add_row("KV rows per rank (allocated)", str(result["kv_rows_per_rank"]))
    table.add_row("logical capacity ratio, same memory", f"{result['kv_capacity_ratio']:.4f}")
    table.add_row("rows lost to reserved loc 0 / rounding", str(result["kv_rows_lost"]))
    for name, sites in result["pass_summary"].items():
        if name != "verify":
            table.add_row(f"pass {name}: sites", str(sites))
    table.add_row("graphs captured", str(result["graphs_captured"]))
    table.add_row("wall time (s)", f"{result['seconds']:.1f}")
    console.print(table)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "tokens"}))
    return 0 if result["tokens_match"] and result["finite"] else 1
