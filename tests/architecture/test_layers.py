"""The package's layers point one way (the README's "Layout"): no import circle between modules,
and no import from a lower layer to a higher one but the one the README's layout names. Every
import counts, lazy ones (inside functions) too. And the generic modules name no back end."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "dcp_compile"

LAYERS = [
    ("testing",),
    ("runtime",),
    ("ops",),
    ("passes",),
    ("lowering",),
    ("config", "cost_model", "shapes", "models"),
    ("strategy",),
    ("backend", "regions"),
    ("binding", "workload"),
    ("compiled_step",),
    ("hf",),
    ("api", "debug"),
    ("__init__", "harness", "doctor"),
    ("cli",),
]
"""Lowest first. A module may import its own layer and those below it."""

ALLOWED_UPWARD = {("backend", "debug")}
"""The one import from a lower layer to a higher one: the backend writes the per-pass dumps with
debug.dump (debug also holds the dump's shape-only capture, which sits above the binding)."""

BACK_END_WORDS = re.compile(r"\b(fia|torchair|nz|flashinfer|npu_kv_format|fia_version|npu_verify)\b", re.IGNORECASE)
GENERIC = ["config.py", "workload.py", "api.py", "backend.py", "regions.py", "strategy.py", "binding.py", "compiled_step.py", "runtime"]


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = edges.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dcp_compile"):
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
                targets = subs if len(subs) == len(node.names) else [node.module, *subs]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("dcp_compile")]
            else:
                continue
            found.update(t for t in targets if t in modules and t != name)
    return edges


def _layer(module: str) -> tuple[int, str]:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    for index, names in enumerate(LAYERS):
        if top in names:
            return index, top
    raise AssertionError(f"{module}: dcp_compile/{top} is in no layer of LAYERS; place it")


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle():
    assert _cycles(_imports()) == []


def test_a_circle_is_found():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_layers_point_one_way():
    upward = set()
    for module, targets in _imports().items():
        (low, source) = _layer(module)
        for target in targets:
            high, destination = _layer(target)
            if high > low:
                upward.add((source, destination, module, target))
    assert {(s, d) for s, d, _, _ in upward} <= ALLOWED_UPWARD, sorted(upward)
    assert len({(s, d) for s, d, _, _ in upward}) <= 1


def test_generic_modules_name_no_back_end_in_code():
    """Back-end words may appear in docstrings and comments (examples), not in code."""
    found = []
    for entry in GENERIC:
        for path in sorted((PACKAGE / entry).rglob("*.py")) if (PACKAGE / entry).is_dir() else [PACKAGE / entry]:
            tree = ast.parse(path.read_text())
            docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)
                          and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}
            for node in ast.walk(tree):
                words = []
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                    words = BACK_END_WORDS.findall(node.value)
                elif isinstance(node, ast.Name):
                    words = BACK_END_WORDS.findall(node.id)
                elif isinstance(node, ast.Attribute):
                    words = BACK_END_WORDS.findall(node.attr)
                found += [(path.name, node.lineno, word) for word in words]
    assert found == []
