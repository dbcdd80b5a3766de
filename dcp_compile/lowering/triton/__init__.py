"""Triton kernels for the internal DCP ops: one source for CUDA and triton-ascend.

Each launcher has the signature and return values of the matching function in
`dcp_compile.ops.reference`, which is what the tests compare it against:

    kv_write(kv_cache, latent, rope, loc, dcp_rank=0, dcp_size=1, interleave=1) -> None
    local_metadata(req_to_token, seq_lens, dcp_rank, dcp_size, interleave)
        -> (local_req_to_token, local_seq_lens, local_positions)
    partial_attention(q_latent, q_rope, kv_cache, page_table, seq_lens, key_positions,
                      q_seq_ids, q_positions, sm_scale) -> (out, lse)
    folded_partial_attention(...) -> (out, lse)   partial_attention's, with a request's queries
                      (in any order) folded into one tile (verify's k queries x heads)
    pack_partials(out, lse, dcp_size) -> packed
    merge_partials(packed, kv_lora_rank) -> merged
    window_attention(out_prefix, lse_prefix, q_latent, q_rope, kv_cache, page_table, seq_lens,
                     key_positions, q_seq_ids, q_positions, sm_scale, window) -> (out, lse)

The launchers that allocate outputs also come as `*_into` variants in their modules, writing into
given buffers (the static buffers of a captured graph); `attention.partial_attention_into` also
takes an explicit `AttentionTiling` (benchmarks sweep it) and split workspace.

Triton is imported only when a launcher is first looked up, so `import dcp_compile` works where
triton is not installed; `available()` says whether it is.
"""

from __future__ import annotations

import importlib

# Launcher name -> module defining it. Module names differ from launcher names so that importing
# a module never shadows the launcher of the same name on this package.
_LAUNCHER_MODULES = {
    "kv_write": "kv_writer",
    "local_metadata": "metadata_builder",
    "partial_attention": "attention",
    "folded_partial_attention": "folded_attention",
    "pack_partials": "pack",
    "merge_partials": "merge",
    "window_attention": "window",
}

__all__ = ["available", "interpreted", *_LAUNCHER_MODULES]


def available() -> bool:
    """Whether triton can be imported here (it says nothing about a device to run on)."""
    try:
        importlib.import_module("triton")
        importlib.import_module("triton.language")
    except ImportError:
        return False
    return True


def interpreted() -> bool:
    """Whether Triton kernels defined now run in its interpreter (TRITON_INTERPRET, read as Triton
    reads it): the only way they run on a CPU."""
    import os

    import triton

    knobs = getattr(triton, "knobs", None)  # triton >= 3.4; older builds (triton-ascend) read the variable directly
    return bool(knobs.runtime.interpret) if knobs is not None else os.environ.get("TRITON_INTERPRET", "0") == "1"


def __getattr__(name: str):
    if name in _LAUNCHER_MODULES:
        module = importlib.import_module(f"{__name__}.{_LAUNCHER_MODULES[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
