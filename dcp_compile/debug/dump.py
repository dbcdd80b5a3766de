"""The per-pass graph dump: one writer for `dcp-compile dump` and DCP_COMPILE_DUMP.

A dump folder holds one `graphNN/` folder per graph the pass manager ran on (under `rankNN/`
when several torch.distributed ranks dump into one folder):

    graph00/03-gather_q_attention.before.py   FX code with shapes and dtypes, before the pass
    graph00/03-gather_q_attention.after.py    ... and after it (NN- is the pass's place in the order)
    graph00/passes.json                      per pass: ran, sites, nodes before/after, ms, op counts, op diff
    graph00/op_diff.txt                      the same, to read

This module imports nothing from dcp_compile.passes (the pass manager imports it).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import torch.fx as fx
from torch.fx.graph import dtype_abbrs

log = logging.getLogger("dcp_compile.debug")

REPORT_JSON, OP_DIFF_TXT = "passes.json", "op_diff.txt"
ENV_FOLDER = "DCP_COMPILE_DUMP"
"""The environment variable that names a dump folder for every compiled model (DCPConfig.dump_dir)."""


def snapshot_name(order: int, name: str, when: str, suffix: str = "py") -> str:
    return f"{order:02d}-{name}.{when}.{suffix}"


def _dtype_code(dtype) -> str:
    return dtype_abbrs.get(dtype, str(dtype))


def describe(value) -> str:
    """'f32[4, 64]' for a tensor, '(f32[4, 8], f32[4])' for a tuple, 'None' when no value."""
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(describe(v) for v in value) + ")"
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype"):
        return f"{_dtype_code(value.dtype)}[{', '.join(str(d) for d in shape)}]"
    return repr(value)


_RELEASE = re.compile(r";  (?:\w+ = )+None$")
_PARAMETER = re.compile(r', (?=\w+: ")')


def readable(gm: fx.GraphModule) -> str:
    """FX code with shapes and dtypes: print_readable, plus the shapes of tuple-valued nodes
    (print_readable annotates single tensors only), one forward parameter per line, and
    without the `;  x = None` releases that codegen appends."""
    code = gm.print_readable(print_output=False, include_stride=False, include_device=False)
    tuples = {
        n.name: describe(n.meta.get("val", n.meta.get("example_value")))
        for n in gm.graph.nodes
        if n.op == "call_function" and isinstance(n.meta.get("val", n.meta.get("example_value")), (tuple, list))
    }
    lines = []
    for line in code.split("\n"):
        line = _RELEASE.sub("", line)
        stripped = line.lstrip()
        if stripped.startswith("def forward(self, "):
            indent = " " * (len(line) - len(stripped) + 4)
            line = line.replace("(self, ", f"(\n{indent}self,\n{indent}", 1)
            line = _PARAMETER.sub(f",\n{indent}", line)
        else:
            name = stripped.split(" = ", 1)[0]
            if name in tuples:
                line = f"{line}  # -> {tuples[name]}"
        lines.append(line)
    return "\n".join(lines)


def op_diff(before: dict, after: dict) -> dict[str, tuple[int, int]]:
    """{op: (count before, count after)} for every op whose count changed, sorted by op."""
    ops = sorted(set(before) | set(after))
    return {op: (before.get(op, 0), after.get(op, 0)) for op in ops if before.get(op, 0) != after.get(op, 0)}


def report_dict(report) -> dict:
    """A PassReport as JSON-ready data, with each pass's op diff."""
    passes = []
    for order, record in enumerate(report.records):
        diff = op_diff(record.ops_before, record.ops_after)
        passes.append({
            "order": order,
            "name": record.name,
            "ran": record.ran,
            "sites": record.sites,
            "nodes_before": record.nodes_before,
            "nodes_after": record.nodes_after,
            "milliseconds": round(record.milliseconds, 3),
            "op_diff": {op: {"before": b, "after": a} for op, (b, a) in diff.items()},
            "ops_before": dict(sorted(record.ops_before.items())),
            "ops_after": dict(sorted(record.ops_after.items())),
        })
    return {"passes": passes, "total_milliseconds": round(sum(p["milliseconds"] for p in passes), 3)}


def op_diff_text(data: dict) -> str:
    """report_dict(...) as text: one block per pass, one line per op whose count changed."""
    width = max([len(op) for p in data["passes"] for op in p["op_diff"]] + [20])
    lines = []
    for p in data["passes"]:
        state = "ran" if p["ran"] else "skipped"
        lines.append(f"{p['order']:02d} {p['name']:<20} {state:<7} sites {p['sites']:<5} "
                     f"nodes {p['nodes_before']} -> {p['nodes_after']}   {p['milliseconds']:.2f} ms")
        for op, counts in p["op_diff"].items():
            delta = counts["after"] - counts["before"]
            lines.append(f"    {op:<{width}} {counts['before']:>5} -> {counts['after']:<5} ({delta:+d})")
        if p["ran"] and not p["op_diff"]:
            lines.append("    (op counts unchanged)")
    lines.append(f"total {data['total_milliseconds']:.2f} ms")
    return "\n".join(lines) + "\n"


def graph_folder(folder: Path, graph_index: int) -> Path:
    """folder/graphNN; ranks of one torch.distributed job dumping into one folder get a
    rankNN/ level each, so that they do not overwrite each other."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        folder = folder / f"rank{dist.get_rank():02d}"
    return folder / f"graph{graph_index:02d}"


def env_folder() -> str | None:
    """The folder DCP_COMPILE_DUMP names, or None where it is unset or empty."""
    return os.environ.get(ENV_FOLDER) or None


def writable_folder(path: str | Path, what: str = "dump folder") -> Path:
    """`path`, created if missing; raises ValueError at once if it cannot be written."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".dcp-compile-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"cannot write to {what} {out}: {exc.strerror or exc}") from None
    return out


class TextDump:
    """Pass-manager observer that writes the dump folder described in this module's docstring.

    only: write the graphs of this pass alone (the report still covers every pass).
    """

    def __init__(self, folder: str | Path, only: str | None = None):
        self.folder = Path(folder)
        self.only = only
        self._last_after = None  # (graph_index, gm, text): the next pass's 'before' is this graph

    def graph_folder(self, graph_index: int) -> Path:
        return graph_folder(self.folder, graph_index)

    def __call__(self, graph_index: int, order: int, name: str, when: str, gm: fx.GraphModule) -> None:
        if self.only is not None and name != self.only:
            self._last_after = None
            return
        last = self._last_after
        # The manager notifies 'before' right after the previous pass's 'after', with no change
        # in between, so that text is reused instead of printing a large graph twice.
        if when == "before" and last is not None and last[0] == graph_index and last[1] is gm:
            text = last[2]
        else:
            text = readable(gm)
        self._last_after = (graph_index, gm, text) if when == "after" else None
        folder = self.graph_folder(graph_index)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / snapshot_name(order, name, when)).write_text(text)

    def pipeline_done(self, graph_index: int, report) -> None:
        self._last_after = None
        folder = self.graph_folder(graph_index)
        folder.mkdir(parents=True, exist_ok=True)
        data = report_dict(report)
        (folder / REPORT_JSON).write_text(json.dumps(data, indent=1) + "\n")
        (folder / OP_DIFF_TXT).write_text(op_diff_text(data))
        log.info("graph dump written to %s", folder)
