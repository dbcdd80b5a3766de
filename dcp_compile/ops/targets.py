"""Every dcp:: op overload the passes and lowerings insert or match, in one place."""

from __future__ import annotations

import torch

from dcp_compile.ops import cache_view, canonical, internal  # noqa: F401 - registers the ops
from dcp_compile.runtime.batch import WINDOW_QUERIES

__all__ = ["WINDOW_QUERIES"]

dcp = torch.ops.dcp
KV_WRITE = dcp.mla_kv_write.default
ATTENTION = dcp.mla_attention.default
SHARDED_KV_WRITE = dcp.sharded_kv_write.default
LOCAL_METADATA = dcp.local_metadata.default
PARTIAL_ATTENTION = dcp.mla_partial_attention.default
PACK_PARTIALS = dcp.pack_partials.default
MERGE_PARTIALS = dcp.merge_partials.default
GUARD_BATCH = dcp.guard_batch.default
CHECK_LOCATIONS = dcp.check_locations.default
CHECK_METADATA = dcp.check_metadata.default
CHECK_HOST_METADATA = dcp.check_host_metadata.default
GATHER_LOCAL_ROWS = dcp.gather_local_rows.default
GATHERED_KV_METADATA = dcp.gathered_kv_metadata.default
WINDOW_ATTENTION = dcp.window_attention.default
CACHE_VIEW = dcp.mla_cache_view.default
