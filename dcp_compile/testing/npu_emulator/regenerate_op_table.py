"""Regenerate npu_aten_ops.py, the aten ops torch_npu runs with an NPU kernel and those of them an
NPU graph cannot capture, from the yaml files that register them (no network, no pyyaml: the files
are read with the few rules they follow):

- op-plugin's `op_plugin/config/op_plugin_functions.yaml` (Ascend/op-plugin): entries
  `  - func: name.overload(...) -> ...` under the sections `official:`, `symint:`, `autograd:`
  (aten ops; `custom:` and `quant:` are torch_npu's own `npu::` ops), each registered for the
  torch versions of its `acl_op:` and `op_api:` fields: `all_version`, `[v2.1, newest]` (a
  range of the file's `all_version` list), `v2.1` or `v2.1, v2.2` (a set), as op-plugin's
  codegen reads them (torchnpugen/op_codegen_utils.py, `get_version`);
- torch_npu's own `torch_npu/csrc/aten/npu_native_functions.yaml` (Ascend/pytorch), optional:
  the names under `supported:` and `symint:` (allocation, copies, views), every version.

An op counts when it is registered for every torch version given (`--versions`, default the
project's range), so that the table holds on any torch_npu the project supports.

An op is acl_op-only when some version gives it no `op_api:` kernel. An NPU graph captures aclnn
(op_api) kernels only: "仅支持aclnn算子入图" (Ascend/pytorch docs/zh/developer_notes/npugraph.md:40).
op-plugin's codegen (torchnpugen/gen.py:318-356) sends an op registered both ways to op_api when jit
compile is off (the default from Ascend910B1 on: Ascend/pytorch torch_npu/csrc/framework/interface/
EnvVariables.cpp, CheckJitDisableInner) and its tensor inputs are in a base format (the project makes
no format casts); an acl_op-only op runs its acl_op kernel whatever the settings. torch_npu's own ops
count as capturable: they are allocations, views and copies (`copy_` and `clone` run aclnn kernels,
`op_api: True` in its yaml) or C++ over other aten ops (`full` fills, the windows are arange and
arithmetic) that reach op-plugin's kernels, each judged by its own entry; none launches an acl_op
kernel of its own.

    python -m dcp_compile.testing.npu_emulator.regenerate_op_table \\
        --op-plugin op_plugin_functions.yaml --op-plugin-commit 517f2e7d0f202f38b76310706cb977ca2388ad21 \\
        --torch-npu npu_native_functions.yaml --torch-npu-commit 9e73e708ab9350d203475609f36f8a43f6a0c2ab
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

TABLE = Path(__file__).with_name("npu_aten_ops.py")
VERSIONS = ("v2.10", "v2.11", "v2.12", "v2.13")
"""torch_npu versions of the project's torch range (pyproject.toml: torch>=2.10,<2.14)."""
ATEN_SECTIONS = ("official", "symint", "autograd")
REGISTRATIONS = ("acl_op", "op_api")
CAPTURE_RULE = ("Ascend/pytorch docs/zh/developer_notes/npugraph.md:40 (\"仅支持aclnn算子入图\": only aclnn, op-plugin "
                "op_api, kernels enter an NPU graph)")
_SECTION = re.compile(r"^([A-Za-z_]+):\s*(.*)$")
_ENTRY = re.compile(r"^  - (?:func:\s*)?([A-Za-z0-9_.]+)")
_FIELD = re.compile(r"^    ([A-Za-z_]+):\s*(.*?)\s*$")


def versions_of(value: str, all_versions: list[str]) -> set[str]:
    """The versions a field's value names (op-plugin's get_version)."""
    value = value.strip()
    if value == "all_version":
        return set(all_versions)
    if value.startswith("["):
        start, end = (part.strip() for part in value.strip("[]").split(","))
        first = all_versions.index(start)
        last = len(all_versions) - 1 if end == "newest" else all_versions.index(end)
        return set(all_versions[first:last + 1])
    return {part.strip() for part in value.split(",") if part.strip()}


def registrations(text: str) -> dict[str, dict[str, set[str]]]:
    """Per aten op of `op_plugin_functions.yaml`, the versions its `acl_op:` and its `op_api:` fields
    name (an op listed twice, per version range, gets the union of its entries)."""
    all_versions: list[str] = []
    section, name = None, None
    registered: dict[str, dict[str, set[str]]] = {}
    for line in text.splitlines():
        if (match := _SECTION.match(line)):
            section, name = match.group(1), None
            if section == "all_version":
                all_versions = [v.strip() for v in match.group(2).strip("[]").split(",")]
        elif (match := _ENTRY.match(line)):
            name = match.group(1) if section in ATEN_SECTIONS and not match.group(1).startswith(("npu_", "_npu_")) else None
            if name is not None:
                registered.setdefault(name, {registration: set() for registration in REGISTRATIONS})
        elif name is not None and (match := _FIELD.match(line)) and match.group(1) in REGISTRATIONS:
            registered[name][match.group(1)] |= versions_of(match.group(2), all_versions)
    return registered


def op_plugin_ops(text: str, versions=VERSIONS) -> set[str]:
    """The aten ops `op_plugin_functions.yaml` registers (acl_op or op_api) for every one of `versions`."""
    return {op for op, found in registrations(text).items() if set(versions) <= found["acl_op"] | found["op_api"]}


def op_api_ops(text: str, versions=VERSIONS) -> set[str]:
    """The aten ops `op_plugin_functions.yaml` gives an op_api (aclnn) kernel for every one of
    `versions`: the ones an NPU graph can capture on any of them."""
    return {op for op, found in registrations(text).items() if set(versions) <= found["op_api"]}


def torch_npu_ops(text: str) -> set[str]:
    """The aten ops torch_npu registers itself (`supported:` and `symint:` of npu_native_functions.yaml)."""
    section, found = None, set()
    for line in text.splitlines():
        if (match := _SECTION.match(line)):
            section = match.group(1)
        elif section in ("supported", "symint") and (match := _ENTRY.match(line)):
            found.add(match.group(1))
    return found


def render(ops: set[str], capturable: set[str], op_plugin_commit: str, torch_npu_commit: str | None,
           versions=VERSIONS) -> str:
    sources = [f"Ascend/op-plugin op_plugin/config/op_plugin_functions.yaml @ {op_plugin_commit}"]
    if torch_npu_commit:
        sources.append(f"Ascend/pytorch torch_npu/csrc/aten/npu_native_functions.yaml @ {torch_npu_commit}")
    lines = ['"""The aten ops torch_npu runs with an NPU kernel, and those an NPU graph cannot capture: generated by',
             "regenerate_op_table.py, do not edit.",
             "",
             "Sources:"]
    lines += [f"- {source}" for source in sources]
    lines += ["",
              f"OPS: the ops registered (acl_op or op_api) for every one of {', '.join(versions)}.",
              "ACL_OP_ONLY: those of OPS without an op_api (aclnn) kernel for one of these versions: they run on the",
              "device in eager, and an NPU graph cannot capture them (CAPTURE_RULE). CAPTURABLE: the rest of OPS",
              "(torch_npu's own ops among them: allocations, views, copies; regenerate_op_table.py says why).",
              'Names are `name.overload` ("name" for the default overload), as the yaml files write them.',
              '"""',
              "",
              f"SOURCES = {tuple(sources)!r}",
              f"VERSIONS = {tuple(versions)!r}",
              f"CAPTURE_RULE = {CAPTURE_RULE!r}",
              "OPS = frozenset({"]
    lines += [f"    {op!r}," for op in sorted(ops)]
    lines += ["})", "ACL_OP_ONLY = frozenset({"]
    lines += [f"    {op!r}," for op in sorted(ops - capturable)]
    lines += ["})", "CAPTURABLE = OPS - ACL_OP_ONLY", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--op-plugin", type=Path, required=True, help="op_plugin_functions.yaml")
    parser.add_argument("--op-plugin-commit", required=True, help="the Ascend/op-plugin commit it was read at")
    parser.add_argument("--torch-npu", type=Path, help="torch_npu's npu_native_functions.yaml")
    parser.add_argument("--torch-npu-commit", help="the Ascend/pytorch commit it was read at")
    parser.add_argument("--versions", default=",".join(VERSIONS), help="torch_npu versions an op must be registered for")
    parser.add_argument("--out", type=Path, default=TABLE)
    args = parser.parse_args(argv)
    if (args.torch_npu is None) != (args.torch_npu_commit is None):
        parser.error("--torch-npu and --torch-npu-commit go together")
    versions = tuple(v.strip() for v in args.versions.split(","))
    op_plugin = args.op_plugin.read_text()
    ops, capturable = op_plugin_ops(op_plugin, versions), op_api_ops(op_plugin, versions)
    if args.torch_npu is not None:
        own = torch_npu_ops(args.torch_npu.read_text())
        ops, capturable = ops | own, capturable | own
    args.out.write_text(render(ops, capturable, args.op_plugin_commit, args.torch_npu_commit, versions))
    print(f"{len(ops)} ops ({len(ops - capturable)} acl_op-only) written to {args.out}")


if __name__ == "__main__":
    main()
