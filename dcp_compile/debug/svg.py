"""Graphviz views of each pass's graph before and after (`dcp-compile dump --format svg`).

The DOT text is written here (no pydot dependency); Graphviz's `dot` renders it to SVG. A graph
of at most FULL_GRAPH_NODES nodes is drawn whole. A larger one shows only what the pass changed
(nodes added, removed or rewired) with their direct inputs and users, so that a 61-layer graph
stays drawable. Removed nodes are red in `before`, added ones green in `after`, rewired ones
yellow in both.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch.fx as fx

from dcp_compile.debug.dump import describe, graph_folder, snapshot_name

log = logging.getLogger("dcp_compile.debug")

FULL_GRAPH_NODES = 400
DOT_TIMEOUT_S = 300


def require_dot() -> str:
    dot = shutil.which("dot")
    if dot is None:
        raise RuntimeError(
            "--format svg needs Graphviz's `dot` program on PATH, and none was found; install Graphviz "
            "(e.g. `apt-get install graphviz`, `brew install graphviz`, `conda install graphviz`) or use "
            "--format text or --format html"
        )
    return dot


@dataclass(frozen=True)
class _NodeView:
    op: str
    target: str
    inputs: tuple[str, ...]
    arguments: str
    value: str

    def same_call(self, other: "_NodeView") -> bool:
        """Same op on the same arguments: a change of recorded value alone is not a rewrite."""
        return (self.op, self.target, self.arguments) == (other.op, other.target, other.arguments)


def _target_name(node: fx.Node) -> str:
    if node.op in ("placeholder", "output"):
        return node.op
    target = node.target
    if isinstance(target, str):
        return f".{target}()" if node.op == "call_method" else target
    return getattr(target, "__name__", str(target)).replace("torch.ops.", "")


def _snapshot(gm: fx.GraphModule) -> dict[str, _NodeView]:
    views = {}
    for node in gm.graph.nodes:
        target = node.target
        qualified = f"{target.namespace}::{target._opname}" if hasattr(target, "_opname") else _target_name(node)
        value = node.meta.get("val", node.meta.get("example_value"))
        views[node.name] = _NodeView(node.op, qualified, tuple(n.name for n in node.all_input_nodes),
                                     repr((node.args, node.kwargs)), describe(value) if value is not None else "")
    return views


def _color(view: _NodeView) -> str:
    if view.op == "placeholder":
        return "#eef1f4"
    if view.target.startswith("dcp::"):
        return "#ffd8a8"
    if view.target.startswith("_c10d_functional::"):
        return "#ffc9c9"
    return "#ffffff"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_dot(views: dict[str, _NodeView], marked: dict[str, str], title: str, shown: set[str] | None = None) -> str:
    """DOT for the nodes in `shown` (all when None); marked maps node name -> fill colour."""
    names = [n for n in views if shown is None or n in shown]
    lines = [
        "digraph G {",
        f"  graph [rankdir=TB, fontname=Helvetica, fontsize=12, labelloc=t, label={_quote(title)}];",
        '  node [shape=box, style="rounded,filled", fontname=Helvetica, fontsize=10];',
    ]
    for name in names:
        view = views[name]
        label = "\n".join(part for part in (name[:48], view.target[:48], view.value[:60]) if part)
        lines.append(f"  {_quote(name)} [label={_quote(label)}, fillcolor={_quote(marked.get(name, _color(view)))}];")
    shown_names = set(names)
    for name in names:
        for source in views[name].inputs:
            if source in shown_names:
                lines.append(f"  {_quote(source)} -> {_quote(name)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _neighbourhood(views: dict[str, _NodeView], focus: set[str]) -> set[str]:
    shown = set(focus)
    for name, view in views.items():
        if name in focus:
            shown.update(i for i in view.inputs if i in views)
        elif any(i in focus for i in view.inputs):
            shown.add(name)
    return shown


class DotDump:
    """Pass-manager observer writing graphNN/OO-pass.{before,after}.dot next to the text dump."""

    def __init__(self, folder: str | Path, only: str | None = None):
        self.folder, self.only = Path(folder), only
        self.written: list[Path] = []
        self._before: dict[str, _NodeView] | None = None

    def __call__(self, graph_index: int, order: int, name: str, when: str, gm: fx.GraphModule) -> None:
        if self.only is not None and name != self.only:
            return
        if when == "before":
            self._before = _snapshot(gm)
            return
        before, after = self._before, _snapshot(gm)
        removed = set(before) - set(after)
        added = set(after) - set(before)
        rewired = {n for n in set(before) & set(after) if not before[n].same_call(after[n])}
        folder = graph_folder(self.folder, graph_index)
        folder.mkdir(parents=True, exist_ok=True)
        for when_, views, gone, marks in (("before", before, added, {n: "#ff8787" for n in removed}),
                                          ("after", after, removed, {n: "#8ce99a" for n in added})):
            marks.update({n: "#ffe066" for n in rewired})
            if not (removed or added or rewired):
                shown, scope = set(), f"no node changed ({len(views)} nodes)"
            elif len(views) <= FULL_GRAPH_NODES:
                shown, scope = None, f"all {len(views)} nodes"
            else:
                # The inputs of nodes that exist on the other side only, too: where they attach.
                other = after if when_ == "before" else before
                attach = {i for n in gone for i in other[n].inputs if i in views}
                shown = _neighbourhood(views, set(marks)) | attach
                scope = f"{len(shown)} of {len(views)} nodes: the ones this pass changed, with their inputs and users"
            title = f"{order:02d} {name} ({when_}): {scope}"
            path = folder / snapshot_name(order, name, when_, "dot")
            path.write_text(to_dot(views, marks, title, shown))
            self.written.append(path)
        self._before = None


def render_svgs(dot_files: list[Path]) -> list[Path]:
    """Run `dot -Tsvg` on each file; returns the SVG paths."""
    dot = require_dot()
    svgs = []
    for path in dot_files:
        svg = path.with_suffix(".svg")
        try:
            subprocess.run([dot, "-Tsvg", str(path), "-o", str(svg)], check=True, capture_output=True, text=True,
                           timeout=DOT_TIMEOUT_S)
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"dot failed on {path}: {exc.stderr.strip()}") from None
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"dot took over {DOT_TIMEOUT_S} s on {path}; narrow the dump with --only PASS") from None
        log.info("rendered %s", svg)
        svgs.append(svg)
    return svgs
