"""dcp_compile: decode context parallelism for MLA models, as torch.compile graph passes.

The names below load on first use (PEP 562), so `import dcp_compile.<module>` does not import
torch unless that module does: a spawned rank sets its parent-death signal before torch loads
(dcp_compile/runtime/parent_death.py), and the CLI catches Ctrl-C from its first line.
Importing `dcp_compile.ops` (or any module that builds graphs) registers the dcp:: ops."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "DCPConfig": "dcp_compile.config",
    "DCPState": "dcp_compile.api",
    "apply": "dcp_compile.api",
    "load_pretrained": "dcp_compile.models",
    "state": "dcp_compile.api",
}

__all__ = ["DCPConfig", "DCPState", "apply", "load_pretrained", "ops", "state"]


def __getattr__(name: str):
    if name == "ops":
        return importlib.import_module("dcp_compile.ops")
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dcp_compile' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
