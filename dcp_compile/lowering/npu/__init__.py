"""Ascend NPU lowering: FIA (`npu_fused_infer_attention_score`) for partial attention over a
rank's local KV pages, and `npu_attention_update` for the LSE merge.

`torch_npu` is imported lazily, only when the NPU lowering is asked for: where it is not
installed (CPU machines, CI) the schema-exact stand-ins of `dcp_compile/testing/npu_standin.py` provide the same
`torch.ops.npu.*` ops, so the lowering is built and tested on CPU. The facts it relies on are in
docs/ascend.md, cited by section where a choice rests on them.
"""

from __future__ import annotations

import importlib

from dcp_compile.runtime.devices import NPU_INSTALL_HINT, require_torch_npu, torch_npu_installed

__all__ = ["NPU_INSTALL_HINT", "ensure_ops", "require_torch_npu", "torch_npu_installed"]


def ensure_ops() -> str:
    """Make torch.ops.npu.* available: torch_npu's where installed, else the stand-ins (whose kernels
    run on the npu device: the emulated one where torch_npu is absent).
    Returns which one ('torch_npu' or 'standin')."""
    if torch_npu_installed():
        importlib.import_module("torch_npu")
        return "torch_npu"
    from dcp_compile.testing import npu_standin as standin

    standin.register()
    return "standin"
