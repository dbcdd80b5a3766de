"""One self-contained HTML page for a graph dump: the pass list, the summary table, and each
pass's graph before and after side by side, aligned line by line, with the lines a pass removed
or added marked and long unchanged runs folded (every line stays in the page).

Inline CSS only, no script and no external asset, so the page opens from disk anywhere.
"""

from __future__ import annotations

import difflib
import html
from pathlib import Path

from dcp_compile.debug.dump import snapshot_name

_CSS = """
:root { --fg: #1d232a; --muted: #5f6b76; --line: #d7dde3; --add: #dff5e3; --del: #fde2e1; --accent: #2a5db0; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--fg); background: #f6f8fa; }
header { padding: 14px 24px; background: #1d232a; color: #fff; }
header h1 { margin: 0 0 4px; font-size: 19px; }
header p { margin: 0; color: #c9d1d9; }
main { display: grid; grid-template-columns: 230px minmax(0, 1fr); gap: 18px; padding: 16px 24px; }
nav { position: sticky; top: 12px; align-self: start; background: #fff; border: 1px solid var(--line); border-radius: 6px; padding: 10px 12px; }
nav h2 { font-size: 13px; text-transform: uppercase; letter-spacing: .04em; color: var(--muted); margin: 0 0 6px; }
nav ol { margin: 0; padding-left: 0; list-style: none; }
nav li { margin: 3px 0; white-space: nowrap; }
nav a { color: var(--accent); text-decoration: none; font-family: ui-monospace, Menlo, monospace; font-size: 13px; }
.badge { display: inline-block; min-width: 26px; margin-left: 4px; padding: 0 5px; border-radius: 9px; font-size: 11px; text-align: center; background: #e7ecf2; color: var(--muted); }
.badge.hit { background: #2a5db0; color: #fff; }
section { background: #fff; border: 1px solid var(--line); border-radius: 6px; padding: 12px 16px; margin-bottom: 16px; }
section h2 { font-size: 16px; margin: 0 0 8px; font-family: ui-monospace, Menlo, monospace; }
table { border-collapse: collapse; width: 100%; }
th, td { padding: 4px 10px; border-bottom: 1px solid var(--line); text-align: left; vertical-align: top; }
th { font-size: 12px; text-transform: uppercase; letter-spacing: .03em; color: var(--muted); }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td code, li code { font-size: 12.5px; }
tr.skipped td { color: var(--muted); }
ul.ops { margin: 4px 0 10px; padding-left: 18px; font-family: ui-monospace, Menlo, monospace; font-size: 12.5px; }
.plus { color: #176f2c; } .minus { color: #b3261e; }
.diff { border: 1px solid var(--line); border-radius: 4px; max-height: 78vh; overflow: auto; background: #fbfcfd;
        font: 12px/1.45 ui-monospace, Menlo, Consolas, monospace; }
.diffhead { position: sticky; top: 0; z-index: 1; display: grid; grid-template-columns: 1fr 1fr; background: #eef1f4;
            border-bottom: 1px solid var(--line); font: 600 12px system-ui, sans-serif; color: var(--muted); }
.diffhead span { padding: 4px 8px; }
.hunk { display: grid; grid-template-columns: 3.4em minmax(0, 1fr) 3.4em minmax(0, 1fr); }
.hunk > i { font-style: normal; text-align: right; padding: 0 6px; color: #8b96a1; background: #f1f3f5; user-select: none; }
.hunk > span { white-space: pre-wrap; overflow-wrap: anywhere; padding: 0 8px 0 2.2em; text-indent: -1.6em; min-height: 1.45em; }
.hunk.changed > span:nth-child(4n+2):not(.pad), .hunk.removed > span:nth-child(4n+2) { background: var(--del); }
.hunk.changed > span:nth-child(4n):not(.pad), .hunk.added > span:nth-child(4n) { background: var(--add); }
.hunk > span.pad { background: repeating-linear-gradient(135deg, #f6f8fa 0 4px, #eceff2 4px 8px); }
details > summary { cursor: pointer; padding: 1px 8px; background: #eef3fb; color: var(--accent);
                    font: 12px system-ui, sans-serif; border-top: 1px dashed var(--line); border-bottom: 1px dashed var(--line); }
p.note { color: var(--muted); margin: 4px 0; }
"""


def _escape(text) -> str:
    return html.escape(str(text), quote=True)


CONTEXT_LINES = 4


def _hunk(left, right, left_start: int, right_start: int, kind: str = "", anchor: str = "") -> str:
    """Rows of (line number, code) x 2; a grid keeps both sides of a row at one height when a
    long line wraps. The shorter side is padded with empty rows."""
    cells = []
    for i in range(max(len(left), len(right))):
        for lines, start in ((left, left_start), (right, right_start)):
            if i < len(lines):
                cells.append(f"<i>{start + i}</i><span>{_escape(lines[i])}</span>")
            else:
                cells.append('<i></i><span class="pad"></span>')
    ident = f' id="{anchor}"' if anchor else ""
    return f'<div class="hunk {kind}"{ident}>{"".join(cells)}</div>'


def _side_by_side(before: str, after: str, anchor: str) -> tuple[str, int, int]:
    """The two graphs aligned line by line: changed runs marked, long unchanged runs folded
    into <details>. Returns (html, lines removed, lines added)."""
    a, b = before.split("\n"), after.split("\n")
    parts, removed, added = [], 0, 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b).get_opcodes():
        if tag != "equal":
            kind = {"replace": "changed", "delete": "removed", "insert": "added"}[tag]
            parts.append(_hunk(a[i1:i2], b[j1:j2], i1 + 1, j1 + 1, kind, anchor if not (removed or added) else ""))
            removed, added = removed + i2 - i1, added + j2 - j1
            continue
        head = CONTEXT_LINES if i1 > 0 else 0
        tail = CONTEXT_LINES if i2 < len(a) else 0
        if i2 - i1 <= head + tail + 2:
            parts.append(_hunk(a[i1:i2], b[j1:j2], i1 + 1, j1 + 1))
            continue
        if head:
            parts.append(_hunk(a[i1:i1 + head], b[j1:j1 + head], i1 + 1, j1 + 1))
        folded = (i2 - tail) - (i1 + head)
        parts.append(f"<details><summary>{folded} unchanged lines</summary>"
                     f"{_hunk(a[i1 + head:i2 - tail], b[j1 + head:j2 - tail], i1 + head + 1, j1 + head + 1)}</details>")
        if tail:
            parts.append(_hunk(a[i2 - tail:i2], b[j2 - tail:j2], i2 - tail + 1, j2 - tail + 1))
    return "".join(parts), removed, added


def _op_list(op_diff: dict) -> str:
    items = []
    for op, counts in op_diff.items():
        delta = counts["after"] - counts["before"]
        cls = "plus" if delta > 0 else "minus"
        items.append(f'<li><code>{_escape(op)}</code> {counts["before"]} &rarr; {counts["after"]} '
                     f'<span class="{cls}">({delta:+d})</span></li>')
    return f'<ul class="ops">{"".join(items)}</ul>' if items else '<p class="note">op counts unchanged</p>'


def _skip_reason(name: str, disabled) -> str:
    return "disabled (--disable)" if name in disabled else "does not apply to this configuration"


def _pass_section(p: dict, graph_folder: Path, disabled) -> str:
    anchor_base = f"pass-{p['order']:02d}"
    title = f"{p['order']:02d} {_escape(p['name'])}"
    stats = (f"sites {p['sites']} &middot; nodes {p['nodes_before']} &rarr; {p['nodes_after']} "
             f"&middot; {p['milliseconds']:.2f} ms")
    head = f'<section id="{anchor_base}"><h2>{title}</h2>'
    if not p["ran"]:
        return f'{head}<p class="note">skipped: {_skip_reason(p["name"], disabled)}</p></section>'
    body = [head, f'<p class="note">{stats}</p>', _op_list(p["op_diff"])]
    paths = [graph_folder / snapshot_name(p["order"], p["name"], when) for when in ("before", "after")]
    if not all(path.exists() for path in paths):
        body.append('<p class="note">graphs not dumped for this pass (see --only)</p>')
    else:
        before, after = (path.read_text() for path in paths)
        if before == after:
            body.append(f'<p class="note">graph text unchanged ({len(before.splitlines())} lines, '
                        f'<code>{_escape(paths[0].name)}</code>)</p>')
        else:
            anchor = f"{anchor_base}-change"
            diff_html, removed, added = _side_by_side(before, after, anchor)
            body.append(
                f'<p class="note">{removed} lines removed, {added} lines added &middot; '
                f'<a href="#{anchor}">first change</a> &middot; unchanged runs are folded (click to open)</p>'
                f'<div class="diff"><div class="diffhead"><span>before &middot; {_escape(paths[0].name)}</span>'
                f'<span>after &middot; {_escape(paths[1].name)}</span></div>{diff_html}</div>'
            )
    body.append("</section>")
    return "".join(body)


def _summary(passes: list[dict]) -> str:
    rows = []
    for p in passes:
        changes = ", ".join(f"{op} {c['after'] - c['before']:+d}" for op, c in p["op_diff"].items())
        rows.append(
            f'<tr class="{"ran" if p["ran"] else "skipped"}"><td class="num">{p["order"]:02d}</td>'
            f'<td><a href="#pass-{p["order"]:02d}"><code>{_escape(p["name"])}</code></a></td>'
            f'<td>{"yes" if p["ran"] else "no"}</td><td class="num">{p["sites"]}</td>'
            f'<td class="num">{p["nodes_before"]} &rarr; {p["nodes_after"]}</td>'
            f'<td class="num">{p["milliseconds"]:.2f}</td><td><code>{_escape(changes)}</code></td></tr>'
        )
    return ('<section id="summary"><h2>summary</h2><table><thead><tr><th>#</th><th>pass</th><th>ran</th>'
            '<th>sites</th><th>nodes before &rarr; after</th><th>ms</th><th>op count changes</th></tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></section>')


def render(report: dict, graph_folder: Path, title: str, facts: list[str], disabled=()) -> str:
    """The page for one graph: report is dump.report_dict(...), graph_folder holds its snapshots."""
    passes = report["passes"]
    nav = "".join(
        f'<li><a href="#pass-{p["order"]:02d}">{p["order"]:02d} {_escape(p["name"])}</a>'
        f'<span class="badge{" hit" if p["sites"] and p["ran"] else ""}">{p["sites"] if p["ran"] else "off"}</span></li>'
        for p in passes
    )
    sections = "".join(_pass_section(p, graph_folder, disabled) for p in passes)
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{_escape(title)}</title><style>{_CSS}</style></head><body>"
        f"<header><h1>{_escape(title)}</h1><p>{' &middot; '.join(_escape(f) for f in facts)}</p></header>"
        f'<main><nav><h2>passes</h2><ol><li><a href="#summary">summary</a></li>{nav}</ol></nav>'
        f"<div>{_summary(passes)}{sections}</div></main></body></html>\n"
    )
