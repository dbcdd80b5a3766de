"""Canonical graph-anchor ops (for model code) and internal DCP ops (inserted by passes)."""

from dcp_compile.ops import cache_view, canonical, internal
from dcp_compile.ops.canonical import mla_attention, mla_kv_write

__all__ = ["cache_view", "canonical", "internal", "mla_attention", "mla_kv_write"]
