"""The one result schema every bench script writes, and the reading of it.

    {"schema": "dcp_compile.bench/1", "benchmark": "step",
     "command": "torchrun --nproc-per-node 1 -m bench.step --out bench/results/step.json",
     "date": "2026-12-03T10:00:00+00:00",
     "machine": {"host": ..., "platform": ..., "cpus": ..., "gpu": ..., "gpus": ..., ...},
     "versions": {"python": ..., "torch": ..., "cuda": ..., "triton": ..., "dcp_compile": ..., ...},
     "run": {...},
     "rows": [{"part": "cases", "context": 131072, "batch": 4, ...}, {"part": "compile", ...}]}

`run` holds what is true of the whole run (shapes, the copy and matmul rates measured in it,
target verdicts, wall time); every measured case is a row, and a row's `part` names the table it
belongs to, "cases" for a script's main one. `command` is what ran, as typed again: the launcher,
`-m bench.NAME`, the arguments, and the DCP_COMPILE_* and TRITON_INTERPRET settings the process
started with.

Results committed before this schema (each script had a layout of its own) are read through
`upgrade`, which moves every figure of the old layout into this one; the files stay as recorded.

A result names no path of the machine it ran on (`portable`, applied by `write`): a path in the
repository becomes relative to it, one in an installed package `<site-packages>/...`, and any other
absolute path `<local>/` and its last part (an output folder, a cache, a temporary directory).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

SCHEMA = "dcp_compile.bench/1"
MAIN = "cases"
"""The part of a script's main table."""

_SETTINGS = {name: value for name, value in os.environ.items()
             if name.startswith("DCP_COMPILE_") or name == "TRITON_INTERPRET"}
"""The settings this process started with (a script may set more for itself: those are not typed)."""


def start(benchmark: str, argv=None, device=None) -> dict:
    """A new result of `python -m bench.<benchmark>` with `argv` (default: this process's), on
    `device` (a CUDA device adds the GPU to the machine record)."""
    return {"schema": SCHEMA, "benchmark": benchmark, "command": command(benchmark, argv),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(device), "versions": versions(), "run": {}, "rows": []}


def add(result: dict, part: str, *rows: dict) -> list[dict]:
    """Append `rows` to `part` of `result`; returns the stored rows (copies that carry `part`)."""
    stored = [{"part": part, **row} for row in rows]
    result["rows"].extend(stored)
    return stored


def rows(result: dict, part: str = MAIN) -> list[dict]:
    """The rows of one part, in the order they were measured, without their `part` key."""
    return [{k: v for k, v in row.items() if k != "part"} for row in result["rows"] if row["part"] == part]


def parts(result: dict) -> list[str]:
    return list(dict.fromkeys(row["part"] for row in result["rows"]))


def write(result: dict, path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(portable(json.dumps(result, indent=1, default=str)) + "\n")


REPO = Path(__file__).resolve().parents[2]
_ABSOLUTE = re.compile(r"(?:(?<=file://)|(?<![\w.<>/-]))/(?:[\w.+-]+/)*[\w.+-]+/?")
"""An absolute path in text: a '/' that no word, dot, angle bracket or slash comes right before
(not a relative path's inner '/', nor a web URL's '//'), or a file URL's path."""


def portable(text: str) -> str:
    """`text` without paths of this machine (see the module's docstring)."""
    def local(match: re.Match) -> str:
        path = match.group(0)
        if path == "/":
            return path
        if Path(path).is_relative_to(REPO):
            return str(Path(path).relative_to(REPO)) or "."
        if "/site-packages/" in path:
            return "<site-packages>/" + path.split("/site-packages/", 1)[1]
        return "<local>/" + path.rstrip("/").rsplit("/", 1)[-1]

    return _ABSOLUTE.sub(local, text)


def read(path) -> dict:
    """A result in this schema, from a file written in it or in a layout from before it."""
    return upgrade(json.loads(Path(path).read_text()))


def command(benchmark: str, argv=None) -> str:
    arguments = sys.argv[1:] if argv is None else list(argv)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # set by torchrun
        launcher = ["torchrun", "--nproc-per-node", os.environ.get("LOCAL_WORLD_SIZE", "1")]
    else:
        launcher = [Path(sys.executable).name]
    settings = [f"{name}={value}" for name, value in sorted(_SETTINGS.items())]
    return shlex.join([*settings, *launcher, "-m", f"bench.{benchmark}", *arguments])


def machine(device=None) -> dict:
    record = {"host": platform.node(), "platform": platform.platform(),
              "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    if device is not None and device.type == "cuda":
        import torch

        properties = torch.cuda.get_device_properties(device)
        record.update(gpu=torch.cuda.get_device_name(device), gpus=torch.cuda.device_count(),
                      sm_count=properties.multi_processor_count, l2_bytes=getattr(properties, "L2_cache_size", None),
                      memory_bytes=properties.total_memory)
    return record


def versions() -> dict:
    import torch

    record = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
              "triton": _installed("triton", "triton-ascend"), "flashinfer": _installed("flashinfer-python"),
              "torch_npu": _installed("torch_npu", "torch-npu"), "torchair": _installed("torchair"),
              "dcp_compile": _source_version()}
    if torch.cuda.is_available():
        record["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    cann = os.environ.get("ASCEND_TOOLKIT_VERSION") or os.environ.get("ASCEND_HOME_PATH")
    if cann:
        record["cann"] = cann
    return record


def _installed(*distributions: str) -> str | None:
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _source_version() -> str | None:
    """The checkout's commit (+dirty with uncommitted changes to tracked files), else the installed version."""
    root = Path(__file__).resolve().parents[2]

    def git(*arguments: str) -> str:
        return subprocess.run(["git", "-C", str(root), *arguments], capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()

    try:
        commit = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return _installed("dcp_compile")
    return commit + ("+dirty" if dirty else "")


# --- results written before this schema -----------------------------------------------------------

_OLD_MACHINE_KEYS = ("gpu", "sm_count", "l2_bytes", "host", "cpu", "cores")
_OLD_VERSION_KEYS = ("python", "torch", "cuda", "triton", "flashinfer", "nccl")
_OLD_MAIN_KEYS = ("cases", "rows")
_OLD_HEADER_KEYS = ("benchmark", "command", "date", "machine", "versions")


def upgrade(raw: dict) -> dict:
    """`raw` in this schema. A result from before it keeps every figure: its list of cases
    ("cases" or "rows") becomes part "cases", any other list of records a part of its own name,
    top-level GPU, host and version fields join machine and versions, and the rest goes to run.
    A machine recorded as one string becomes {"name": it}."""
    if raw.get("schema") == SCHEMA:
        return raw
    if "schema" in raw:
        raise ValueError(f"result schema {raw['schema']!r} is not {SCHEMA!r}, the one this reader reads")
    old_machine = raw.get("machine", {})
    result = {"schema": SCHEMA, "benchmark": raw.get("benchmark") or _old_benchmark(raw), "command": raw.get("command"),
              "date": raw.get("date"),
              "machine": dict(old_machine) if isinstance(old_machine, dict) else {"name": old_machine},
              "versions": dict(raw.get("versions", {})), "run": {}, "rows": []}
    for key, value in raw.items():
        if key in _OLD_HEADER_KEYS:
            continue
        if key in _OLD_MACHINE_KEYS:
            result["machine"][key] = value
        elif key in _OLD_VERSION_KEYS:
            result["versions"][key] = value
        elif isinstance(value, list) and value and all(isinstance(row, dict) for row in value):
            add(result, MAIN if key in _OLD_MAIN_KEYS else key, *value)
        else:
            result["run"][key] = value
    return result


def _old_benchmark(raw: dict) -> str | None:
    """The script named in the recorded command (a merged file: in its runs' commands)."""
    commands = [raw.get("command")] + [run.get("command") for run in raw.get("runs", [])]
    for text in filter(None, commands):
        found = re.search(r"bench/(\w+)\.py", text)
        if found:
            return found.group(1)
    return None


def make_portable(paths) -> list[Path]:
    """Rewrite the text files at `paths` (a folder: every file under it) through `portable`, as a
    device call's logs are before they are committed; returns the files changed."""
    files = [f for p in map(Path, paths) for f in ([p] if p.is_file() else sorted(p.rglob("*"))) if f.is_file()]
    changed = []
    for path in files:
        try:
            text = path.read_text()
        except UnicodeDecodeError:  # a plot
            continue
        if portable(text) != text:
            path.write_text(portable(text))
            changed.append(path)
    return changed


if __name__ == "__main__":  # python -m bench.lib.result FILE_OR_FOLDER...
    for changed in make_portable(sys.argv[1:]):
        print(f"no local paths left in {changed}")
