"""Snapshot a torch_npu release's own artifacts for the emulator, without importing torch_npu.

    python -m dcp_compile.testing.npu_emulator.snapshot 2.13.0            # pip download the wheel, snapshot it
    python -m dcp_compile.testing.npu_emulator.snapshot --wheel W.whl     # a wheel at hand
    python -m dcp_compile.testing.npu_emulator.snapshot --check           # every committed snapshot re-derived
    python -m dcp_compile.testing.npu_emulator.snapshot --check --wheel W.whl   # ... and regenerated from W

A torch_npu wheel unzips where CANN is absent (docs/ascend.md §12.1: importing it needs CANN). The
snapshot reads, for the ops the NPU lowering calls (LOWERED_OPS) and the overloads and helpers their
NPU-graph handlers call at capture:

- `torch_npu/lib/libtorch_npu.so`: each op's registered schema string (the `m.def` text, the one
  string of the op's name that parses as a schema);
- `torch_npu/op_plugin/meta/_meta_registrations.py`: each op's meta (shape) function and the
  module-level names it uses, verbatim, with the vendor's imports of torch_npu internals replaced
  by the emulator's shims (releases/shims.py);
- `torch_npu/npu/_npugraph_handlers/*.py` and `torch_npu/npu/graphs.py`: the handler of each op
  (which arguments an update may change, the overload it captures as, the helpers it calls) and
  the code of `NPUGraph.update` (one dict broadcast, or exactly one per record; the keyword
  arguments an update replaces; whether it needs `auto_dispatch_capture`).

It writes them to `releases/torch_npu_<version>/` (version dots as underscores):
`snapshot.json` (the wheel, its sha256, the files read and their sha256, the schemas, and what was
derived from the sources), `meta.py` (the meta excerpt, importable), `npugraph_source.txt` (the
handler and update code, verbatim, for the reader and for re-deriving) and `LICENSE` (the
wheel's). `--check` re-derives every snapshot's json from its committed excerpts (and, given a
wheel, regenerates that release and compares), so a snapshot edited by hand fails.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import textwrap
import zipfile
from dataclasses import dataclass
from pathlib import Path

RELEASES = Path(__file__).with_name("releases")
LOWERED_OPS = ("npu_fused_infer_attention_score", "npu_fused_infer_attention_score_v2", "npu_attention_update",
               "npu_scatter_pa_kv_cache")
"""The torch.ops.npu ops dcp_compile's NPU lowering calls (lowering/npu/: FIA v1 and v2, the LSE
merge, the paged-cache write); tests/npu/test_release_snapshots.py checks the lowering names no
other."""
SCHEMA_LIBRARY = "torch_npu/lib/libtorch_npu.so"
META_FILE = "torch_npu/op_plugin/meta/_meta_registrations.py"
GRAPHS_FILE = "torch_npu/npu/graphs.py"
HANDLERS_DIR = "torch_npu/npu/_npugraph_handlers/"
VERSION_FILE = "torch_npu/version.py"
SHIMMED = ("torch_npu", "ErrCode", "ops_error", "get_cann_version", "get_soc_version", "impl", "m")
"""Module-level names of the meta file the emulator's shims provide (releases/shims.py): the vendor
imports them from torch_npu, and `impl(m, name)` registers a Meta kernel that the stand-ins
register themselves; the shim's `impl` only collects the functions."""
GRAPH_CODE = (("_GraphDispatchMode", "__torch_dispatch__"), ("_GraphDispatchMode", "update_capture_record"),
              ("NPUGraph", "update"), ("graph", "__init__"), ("graph", "__enter__"))
"""The parts of graphs.py an NPU graph's capture and update follow."""


@dataclass
class Extracted:
    """What a wheel gives, before anything is derived."""

    version: str
    git_version: str
    wheel: str
    wheel_sha256: str
    files: dict[str, str]
    schemas: dict[str, str]
    meta_source: str
    npugraph_source: str
    license_text: str


# --- reading the wheel -------------------------------------------------------------------------


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _version(text: str) -> tuple[str, str]:
    values = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            values[node.targets[0].id] = ast.literal_eval(node.value)
    return values["__version__"], values.get("git_version", "")


def registered_schemas(library: bytes, names) -> dict[str, str]:
    """name ("op" or "op.overload") -> the one NUL-terminated string of the library that starts with
    `name(` and parses as a schema (the C++ signatures beside them do not parse)."""
    import torch

    candidates: dict[str, set[str]] = {name: set() for name in names}
    for match in re.finditer(rb"(?<![\w.])(_?npu_[\w.]*)\([^\x00]*?\) -> [^\x00]*", library):
        name = match.group(1).decode()
        if name not in candidates:
            continue
        text = match.group(0).decode()
        try:
            torch._C.parse_schema(text)
        except RuntimeError:
            continue
        candidates[name].add(text)
    found = {}
    for name, texts in candidates.items():
        if len(texts) > 1:
            raise ValueError(f"{name}: {len(texts)} different schema strings in {SCHEMA_LIBRARY}")
        if texts:
            found[name] = texts.pop()
    return found


def _handler_modules(wheel: zipfile.ZipFile) -> dict[str, str]:
    return {name: wheel.read(name).decode() for name in sorted(wheel.namelist())
            if name.startswith(HANDLERS_DIR) and name.endswith(".py")}


def extract(wheel_path: Path) -> Extracted:
    with zipfile.ZipFile(wheel_path) as wheel:
        names = set(wheel.namelist())
        version, git_version = _version(wheel.read(VERSION_FILE).decode())
        licenses = sorted(n for n in names if re.fullmatch(r"[^/]+\.dist-info/(licenses/)?LICENSE", n))
        if not licenses:
            raise ValueError(f"{wheel_path.name} has no LICENSE in its dist-info")
        handlers = _handler_modules(wheel)
        if not handlers:
            raise ValueError(f"{wheel_path.name} has no {HANDLERS_DIR}: this script reads the NPU-graph handler "
                             "framework (2.10.0.post6, 2.13.0 and 2.14.0 have it); read this release's graphs.py by "
                             "hand and extend _derive_handlers")
        graphs = wheel.read(GRAPHS_FILE).decode()
        handler_code = handler_excerpt(handlers, LOWERED_OPS)
        ops = list(LOWERED_OPS) + capture_overloads(handler_code, LOWERED_OPS)
        library = wheel.read(SCHEMA_LIBRARY)
        schemas = registered_schemas(library, ops)
        missing = [op for op in LOWERED_OPS if op not in schemas]
        if missing:
            raise ValueError(f"{wheel_path.name}: no schema for {missing} in {SCHEMA_LIBRARY}")
        meta_text = wheel.read(META_FILE).decode()
        files = {name: _sha256(wheel.read(name)) for name in
                 [VERSION_FILE, SCHEMA_LIBRARY, META_FILE, GRAPHS_FILE, *handlers, licenses[0]]}
        license_text = wheel.read(licenses[0]).decode()
    meta_source = meta_excerpt(meta_text, [op.split(".")[0] for op in schemas])
    npugraph_source = graph_excerpt(graphs) + "\n\n" + handler_code
    return Extracted(version, git_version, wheel_path.name, _sha256(wheel_path.read_bytes()), files, schemas,
                     meta_source, npugraph_source, license_text)


# --- the meta excerpt ----------------------------------------------------------------------------


def _bound_names(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return set()


class _NameReads(ast.NodeVisitor):
    """The names a statement reads; the annotations of local variables are left out (Python never
    evaluates them)."""

    def __init__(self):
        self.names: set[str] = set()

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self.names.add(node.id)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.visit(node.target)
        if node.value is not None:
            self.visit(node.value)


def _used_names(node: ast.AST) -> set[str]:
    reader = _NameReads()
    reader.visit(node)
    return reader.names


def _impl_name(node: ast.stmt) -> str | None:
    """The op of a function decorated `@impl(m, "op")`."""
    for decorator in getattr(node, "decorator_list", ()):
        if (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Name) and decorator.func.id == "impl"
                and len(decorator.args) == 2 and isinstance(decorator.args[1], ast.Constant)):
            return decorator.args[1].value
    return None


def _segment(lines: list[str], node: ast.stmt) -> str:
    """A statement's lines, decorators included, dedented (a method becomes a top-level function)."""
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", ())])
    return textwrap.dedent("".join(lines[first - 1:node.end_lineno])).rstrip() + "\n"


def meta_excerpt(text: str, ops) -> str:
    """The meta functions of `ops` (those the file has) and, transitively, the module-level
    statements whose names they use, verbatim and in the file's order; imports of SHIMMED names
    become one import of the shims."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    wanted = [node for node in tree.body if _impl_name(node) in set(ops)]
    binders: dict[str, list[ast.stmt]] = {}
    for node in tree.body:
        for name in _bound_names(node):
            binders.setdefault(name, []).append(node)
    kept, shims, queue = set(), set(), list(wanted)
    while queue:
        node = queue.pop()
        if id(node) in kept:
            continue
        kept.add(id(node))
        for name in _used_names(node):
            if name in SHIMMED:
                shims.add(name)
                continue
            for binder in binders.get(name, ()):
                if isinstance(binder, (ast.Import, ast.ImportFrom)) and _imports_torch_npu(binder):
                    raise ValueError(f"the meta functions use {name!r}, imported from torch_npu, which the "
                                     "emulator's shims do not provide: add it to releases/shims.py and SHIMMED")
                queue.append(binder)
    body = []
    for node in tree.body:
        if id(node) not in kept:
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            body.append(_imports_of(node, _used_in(tree, kept, node)))
        else:
            body.append(_segment(lines, node))
    shim_import = f"from dcp_compile.testing.npu_emulator.releases.shims import {', '.join(sorted(shims))}\n"
    return "".join(_group_imports(body, shim_import))


def _imports_torch_npu(node) -> bool:
    modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
    return any(module.split(".")[0] == "torch_npu" for module in modules)


def _used_in(tree, kept: set[int], import_node) -> set[str]:
    used = set()
    for node in tree.body:
        if id(node) in kept and node is not import_node:
            used |= _used_names(node)
    return used & _bound_names(import_node)


def _imports_of(node, used: set[str]) -> str:
    aliases = [a for a in node.names if (a.asname or a.name).split(".")[0] in used]
    names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in aliases)
    if isinstance(node, ast.ImportFrom):
        return f"from {node.module} import {names}\n"
    return f"import {names}\n"


def _group_imports(body: list[str], shim_import: str) -> list[str]:
    imports = [s for s in body if s.startswith(("import ", "from "))]
    rest = [s for s in body if not s.startswith(("import ", "from "))]
    return [*imports, shim_import, "\n\n", "\n\n".join(rest)]


# --- the NPU-graph excerpt -----------------------------------------------------------------------


def _method(tree: ast.Module, lines, class_name: str, method: str) -> str:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    return f"# class {class_name}:\n" + _segment(lines, item)
    raise ValueError(f"{GRAPHS_FILE} has no {class_name}.{method}")


def graph_excerpt(text: str) -> str:
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    parts = [f"# --- {GRAPHS_FILE} ---"] + [_method(tree, lines, c, m) for c, m in GRAPH_CODE]
    return "\n".join(parts).rstrip() + "\n"


def _handler_names(node: ast.ClassDef) -> list[str]:
    for decorator in node.decorator_list:
        if (isinstance(decorator, ast.Call) and getattr(decorator.func, "id", "") == "register_npu_graph_handler"
                and decorator.args):
            value = ast.literal_eval(decorator.args[0])
            return [value] if isinstance(value, str) else list(value)
    return []


def handler_excerpt(modules: dict[str, str], ops) -> str:
    """The handler classes registered for `ops` (any overload), their bases defined beside them,
    and the base class's update_args, verbatim, each headed by its file."""
    parts = []
    for path, text in modules.items():
        tree = ast.parse(text)
        lines = text.splitlines(keepends=True)
        classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
        chosen = [node for node in classes.values() if any(name.split(".")[0] in ops for name in _handler_names(node))]
        bases = {base.id for node in chosen for base in node.bases if isinstance(base, ast.Name) and base.id in classes}
        keep = [node for node in classes.values() if node in chosen or node.name in bases]
        if "NpuGraphOpHandler" in classes:
            update_args = next(i for i in classes["NpuGraphOpHandler"].body
                               if isinstance(i, ast.FunctionDef) and i.name == "update_args")
            parts.append(f"# --- {path} ---\n# class NpuGraphOpHandler:\n" + _segment(lines, update_args))
        if keep:
            parts.append(f"# --- {path} ---\n" + "\n\n".join(_segment(lines, node) for node in keep))
    return "\n\n".join(parts)


def _excerpt_modules(npugraph_source: str) -> list[tuple[str, ast.Module]]:
    """The excerpt's parts, by file, parsed (each part is valid Python on its own)."""
    chunks = re.split(r"^# --- (.+?) ---\n", npugraph_source, flags=re.M)
    return [(chunks[i], ast.parse(chunks[i + 1])) for i in range(1, len(chunks), 2)]


def capture_overloads(handler_code: str, ops) -> list[str]:
    """The overloads and helpers the handlers call at capture (`torch_npu.<op>.out`,
    `torch_npu._..._infer_output(...)`), in order of appearance."""
    found = []
    for _, tree in _excerpt_modules(handler_code):
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch_npu":
                name = node.attr
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                  and isinstance(node.value.value, ast.Name) and node.value.value.id == "torch_npu"):
                name = f"{node.value.attr}.{node.attr}"
            else:
                continue
            if name not in found and name not in ops:
                found.append(name)
    return found


# --- what is derived -----------------------------------------------------------------------------


def derive(schemas: dict[str, str], meta_source: str, npugraph_source: str) -> dict:
    """The data the emulator reads, from the excerpts alone (so that --check can redo it)."""
    meta = {}
    for node in ast.parse(meta_source).body:
        name = _impl_name(node)
        if name is not None:
            meta[name] = node.name
    return {"meta_functions": meta, "npugraph": {"handlers": _derive_handlers(npugraph_source),
                                                 "update": _derive_update_rule(npugraph_source)}}


def _class_constant(node: ast.ClassDef, name: str):
    for item in node.body:
        if isinstance(item, ast.Assign) and any(getattr(t, "id", "") == name for t in item.targets):
            return ast.literal_eval(item.value)
    return None


def _derive_handlers(npugraph_source: str) -> dict:
    handlers = {}
    for _, tree in _excerpt_modules(npugraph_source):
        classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
        for node in classes.values():
            names = _handler_names(node)
            if not names:
                continue
            specs = _class_constant(node, "UPDATE_SPECS") or {}
            capture = _prepare_capture(node)
            for name in names:
                handlers[name] = {"handler": node.name,
                                  "update_specs": [list(spec) for spec in specs.get(name, [])],
                                  **(capture if not name.endswith(".out") else {"capture_as": name})}
    return handlers


def _prepare_capture(node: ast.ClassDef) -> dict:
    """What a handler's prepare_capture does to a `.default` call: the overload it captures as, the
    helpers it calls, the arguments it hands `_infer_output`."""
    method = next((i for i in node.body if isinstance(i, ast.FunctionDef) and i.name == "prepare_capture"), None)
    if method is None:
        return {"capture_as": None}
    derived = {"capture_as": None, "workspace": None, "infer_output": None, "infer_output_args": [],
               "infer_output_kwargs": []}
    for child in ast.walk(method):
        if isinstance(child, ast.Assign) and isinstance(child.targets[0], ast.Name):
            target, value = child.targets[0].id, child.value
            if target == "func_out" and isinstance(value, ast.Attribute):
                derived["capture_as"] = f"{value.value.attr}.{value.attr}"
            elif target == "out_args" and isinstance(value, ast.List):
                derived["infer_output_args"] = [e.slice.value for e in value.elts]
            elif target == "out_kwargs_keys":
                derived["infer_output_kwargs"] = ast.literal_eval(value)
        if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) and \
                getattr(child.func.value, "id", "") == "torch_npu":
            key = "workspace" if child.func.attr.endswith("_get_max_workspace") else "infer_output"
            derived[key] = child.func.attr
    return derived


def _find_function(npugraph_source: str, name: str) -> ast.FunctionDef:
    for _, tree in _excerpt_modules(npugraph_source):
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return node
    raise ValueError(f"the excerpt has no {name}")


def _derive_update_rule(npugraph_source: str) -> dict:
    record = _find_function(npugraph_source, "update_capture_record")
    update = _find_function(npugraph_source, "update")
    broadcast = any(isinstance(n, ast.Compare) and ast.unparse(n) == "len(cpu_update_input) == 1"
                    for n in ast.walk(record))
    count_check = None
    for node in ast.walk(record):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and isinstance(node.test.ops[0], ast.NotEq) \
                and any(isinstance(n, ast.Raise) for n in ast.walk(node)):
            left, right = ast.unparse(node.test.left), ast.unparse(node.test.comparators[0])
            count_check = "none: compares the records with themselves" if left == right else "exact"
    replaces_captured_kwargs = any(isinstance(n, ast.Compare) and ast.unparse(n) == "key in record.kwargs"
                                   for n in ast.walk(record))
    needs_auto_dispatch = any(isinstance(n, ast.If) and "auto_dispatch_capture" in ast.unparse(n.test)
                              and any(isinstance(r, ast.Raise) for r in ast.walk(n)) for n in ast.walk(update))
    if count_check is None:
        raise ValueError("update_capture_record has no check of the update count: read it and extend this script")
    return {"broadcast_one_dict": broadcast, "count_check": count_check,
            "replaces_captured_kwargs": replaces_captured_kwargs,
            "requires_auto_dispatch_capture": needs_auto_dispatch}


# --- writing and checking ------------------------------------------------------------------------


def folder(version: str) -> Path:
    return RELEASES / ("torch_npu_" + re.sub(r"[^0-9a-zA-Z]", "_", version))


def _provenance(extracted: Extracted) -> str:
    return (f"# wheel  {extracted.wheel}\n# sha256 {extracted.wheel_sha256}\n"
            f"# git    {extracted.git_version}\n")


def _meta_header(extracted: Extracted) -> str:
    return (f"# Excerpt of {META_FILE}\n# from the torch_npu {extracted.version} wheel:\n" + _provenance(extracted) +
            "# The meta (shape) functions of the ops dcp_compile's NPU lowering calls and the module-level\n"
            "# names they use, verbatim and in the file's order. The vendor's imports of torch_npu internals\n"
            "# are replaced by one import of the emulator's shims (releases/shims.py); nothing here imports\n"
            "# torch_npu. Generated by `python -m dcp_compile.testing.npu_emulator.snapshot`: do not edit.\n"
            "#\n"
            "# Copyright (c) 2020, Huawei Technologies Co., Ltd. All rights reserved.\n"
            "# Licensed under the BSD 3-Clause License: see LICENSE beside this file (the wheel's own).\n"
            "# ruff: noqa\n\n")


def _npugraph_header(extracted: Extracted) -> str:
    return (f"# Excerpts of {GRAPHS_FILE} and {HANDLERS_DIR}\n# from the torch_npu {extracted.version} wheel:\n"
            + _provenance(extracted) +
            "# The NPU-graph capture and update code, and the handlers of the ops dcp_compile's NPU lowering\n"
            "# calls, verbatim, for reading and for re-deriving snapshot.json. Not imported.\n"
            "# Copyright (c) 2020, Huawei Technologies Co., Ltd; BSD 3-Clause License: see LICENSE beside\n"
            "# this file.\n\n")


def snapshot_json(extracted: Extracted, derived: dict) -> dict:
    return {"torch_npu": extracted.version, "git_version": extracted.git_version, "wheel": extracted.wheel,
            "wheel_sha256": extracted.wheel_sha256, "files": extracted.files,
            "generated_by": "python -m dcp_compile.testing.npu_emulator.snapshot",
            "lowered_ops": list(LOWERED_OPS), "schemas": extracted.schemas, **derived}


def render(extracted: Extracted) -> dict[str, str]:
    """The files of a release's snapshot folder, by name."""
    meta = _meta_header(extracted) + extracted.meta_source
    npugraph = _npugraph_header(extracted) + extracted.npugraph_source
    derived = derive(extracted.schemas, meta, npugraph)
    return {"snapshot.json": json.dumps(snapshot_json(extracted, derived), indent=1) + "\n", "meta.py": meta,
            "npugraph_source.txt": npugraph, "LICENSE": extracted.license_text}


def write(extracted: Extracted) -> Path:
    target = folder(extracted.version)
    target.mkdir(parents=True, exist_ok=True)
    for name, text in render(extracted).items():
        (target / name).write_text(text)
    return target


def rederive(release_folder: Path) -> list[str]:
    """Differences between a committed snapshot's json and what its committed excerpts give."""
    committed = json.loads((release_folder / "snapshot.json").read_text())
    derived = derive(committed["schemas"], (release_folder / "meta.py").read_text(),
                     (release_folder / "npugraph_source.txt").read_text())
    return [f"{release_folder.name}: {key} differs from what its excerpts give"
            for key, value in derived.items() if committed.get(key) != value]


def download(version: str, into: Path) -> Path:
    """The wheel of `version` for this Python and platform, fetched with pip (no dependencies)."""
    subprocess.run([sys.executable, "-m", "pip", "download", f"torch-npu=={version}", "--no-deps", "-d", str(into)],
                   check=True)
    wheels = sorted(into.glob(f"torch_npu-{version}-*.whl"))
    if not wheels:
        raise FileNotFoundError(f"pip downloaded no torch_npu {version} wheel into {into}")
    return wheels[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version", nargs="?", help="a torch_npu release on the package registry (e.g. 2.13.0)")
    parser.add_argument("--wheel", type=Path, help="a torch_npu wheel file instead of downloading one")
    parser.add_argument("--check", action="store_true",
                        help="re-derive every committed snapshot; with --wheel, also regenerate that release and "
                             "compare")
    args = parser.parse_args(argv)
    if args.check:
        problems = [p for release in sorted(RELEASES.glob("torch_npu_*")) for p in rederive(release)]
        if args.wheel:
            extracted = extract(args.wheel)
            rendered = render(extracted)
            committed = folder(extracted.version)
            problems += [f"{committed.name}/{name} differs from what {args.wheel.name} gives"
                         for name, text in rendered.items()
                         if not (committed / name).exists() or (committed / name).read_text() != text]
        print("\n".join(problems) or "every snapshot is what its sources give")
        return 1 if problems else 0
    if bool(args.version) == bool(args.wheel):
        parser.error("give a version or --wheel")
    if args.wheel:
        target = write(extract(args.wheel))
    else:
        with tempfile.TemporaryDirectory() as scratch:
            target = write(extract(download(args.version, Path(scratch))))
    sizes = ", ".join(f"{p.name} {p.stat().st_size} B" for p in sorted(target.iterdir()))
    print(f"wrote {target}: {sizes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
