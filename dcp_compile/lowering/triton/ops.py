"""The `dcp_triton::` ops, one per lowerable `dcp::` op, same schema, whose implementation is
the Triton launcher of the same semantics. The lower_kernels pass swaps graph targets to them,
so the chosen kernel is visible in graph dumps.

Triton is imported only when a lowered op first runs.
"""

from __future__ import annotations

import torch

NAMESPACE = "dcp_triton"
# dcp:: op name -> launcher name in dcp_compile.lowering.triton
LAUNCHERS = {
    "sharded_kv_write": "kv_write",
    "local_metadata": "local_metadata",
    "mla_partial_attention": "partial_attention",
    "pack_partials": "pack_partials",
    "merge_partials": "merge_partials",
    "window_attention": "window_attention",
}
# dcp_triton:: ops with no dcp:: op of their own: name -> (the dcp:: op whose schema and meaning
# they keep, with a precondition of their own, and their launcher)
VARIANTS = {
    # queries grouped by request, in request order (the batches of RequestTable)
    "mla_folded_partial_attention": ("mla_partial_attention", "folded_partial_attention"),
}
_library: torch.library.Library | None = None


def _launcher(launcher: str):
    from dcp_compile.lowering import triton as triton_kernels

    if not triton_kernels.available():
        raise RuntimeError("the Triton kernels were selected but triton is not installed (pip install triton)")
    return getattr(triton_kernels, launcher)


def _define(library: torch.library.Library, name: str, canonical: str, launcher: str) -> None:
    schema = str(getattr(torch.ops.dcp, canonical).default._schema)
    library.define(schema[schema.index("(") :].join([name, ""]))

    def kernel(*args):
        return _launcher(launcher)(*args)

    def fake(*args):
        # Under a fake mode the dcp:: op dispatches to its own fake implementation.
        return getattr(torch.ops.dcp, canonical).default(*args)

    # The npu device (PrivateUse1) too: on Ascend, the same kernels run under triton-ascend.
    for device in ("CUDA", "CPU", "PrivateUse1"):
        library.impl(name, kernel, device)
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=library)


def triton_op(name: str) -> torch._ops.OpOverload:
    """The dcp_triton:: overload that lowers dcp::`name`, or of a variant (VARIANTS)."""
    global _library
    if _library is None:
        _library = torch.library.Library(NAMESPACE, "DEF")
        for op_name, launcher in LAUNCHERS.items():
            _define(_library, op_name, op_name, launcher)
        for op_name, (canonical, launcher) in VARIANTS.items():
            _define(_library, op_name, canonical, launcher)
    return getattr(getattr(torch.ops, NAMESPACE), name).default
