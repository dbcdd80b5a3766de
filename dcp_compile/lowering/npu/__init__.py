"""Ascend NPU lowering: FIA (`npu_fused_infer_attention_score`) for partial attention over a
rank's local KV pages, and `npu_attention_update` for the LSE merge.

`torch_npu` is imported lazily, only when the NPU lowering is asked for: where it is not
installed (CPU machines, CI) the schema-exact stand-ins of `standin.py` provide the same
`torch.ops.npu.*` ops, so the lowering is built and tested on CPU. The facts it relies on are in
the project's ASCEND.md, cited by section where a choice rests on them.
"""

from __future__ import annotations

import importlib.util

INSTALL_HINT = (
    "install torch_npu matching your torch (torch-npu 2.11.0 pairs with torch 2.11, 2.12.0 with 2.12, "
    "2.13.0 with 2.13) on a machine with the Ascend CANN toolkit >= 8.5.0 (FIA's LSE with MLA), e.g. "
    "`pip install torch-npu==2.13.0`, then `source /usr/local/Ascend/ascend-toolkit/set_env.sh`"
)


def torch_npu_installed() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


def require_torch_npu(what: str) -> None:
    """Raise a clear error if `what` (an NPU device, HCCL, torchair) needs torch_npu and it is absent."""
    if not torch_npu_installed():
        raise RuntimeError(f"{what} needs torch_npu, which is not installed: {INSTALL_HINT}")
    importlib.import_module("torch_npu")


def ensure_ops() -> str:
    """Make torch.ops.npu.* available: torch_npu's where installed, else the CPU stand-ins.
    Returns which one ('torch_npu' or 'standin')."""
    if torch_npu_installed():
        importlib.import_module("torch_npu")
        return "torch_npu"
    from dcp_compile.lowering.npu import standin

    standin.register()
    return "standin"
