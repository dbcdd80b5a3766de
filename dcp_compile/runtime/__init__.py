"""Runtime: KV pool, batch metadata, process groups, layout math. The names below load on first
use (PEP 562): dcp_compile.runtime.parent_death must import without torch."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ForwardBatch": "dcp_compile.runtime.batch",
    "RequestTable": "dcp_compile.runtime.batch",
    "MLAKVPool": "dcp_compile.runtime.kv_pool",
    "ParallelState": "dcp_compile.runtime.parallel",
}

__all__ = ["ForwardBatch", "MLAKVPool", "ParallelState", "RequestTable"]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dcp_compile.runtime' has no attribute {name!r}")
