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
_library: torch.library.Library | None = None


def _launcher(name: str):
    from dcp_compile.lowering import triton as triton_kernels

    if not triton_kernels.available():
        raise RuntimeError("the Triton kernels were selected but triton is not installed (pip install triton)")
    return getattr(triton_kernels, LAUNCHERS[name])


def _define(library: torch.library.Library, name: str) -> None:
    schema = str(getattr(torch.ops.dcp, name).default._schema)
    library.define(schema[schema.index("(") :].join([name, ""]))

    def kernel(*args):
        return _launcher(name)(*args)

    def fake(*args):
        # Under a fake mode the dcp:: op dispatches to its own fake implementation.
        return getattr(torch.ops.dcp, name).default(*args)

    # The npu device (PrivateUse1) too: on Ascend, the same kernels run under triton-ascend.
    for device in ("CUDA", "CPU", "PrivateUse1"):
        library.impl(name, kernel, device)
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=library)


def triton_op(name: str) -> torch._ops.OpOverload:
    """The dcp_triton:: overload that lowers dcp::`name`."""
    global _library
    if _library is None:
        _library = torch.library.Library(NAMESPACE, "DEF")
        for op_name in LAUNCHERS:
            _define(_library, op_name)
    return getattr(getattr(torch.ops, NAMESPACE), name).default
