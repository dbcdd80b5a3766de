"""Which device stacks are present here: torch_npu (Ascend) is imported lazily, only when an
NPU device, HCCL or torchair is asked for. Where it is not installed (CPU machines, CI) it is
never imported: installed without Ascend's CANN libraries it breaks `import torch`
(docs/ascend.md §12)."""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch

NPU_INSTALL_HINT = (
    "install torch_npu matching your torch (torch-npu 2.12.0 pairs with torch 2.12, 2.13.0 with 2.13; 2.11.0 "
    "pins torch 2.11.0+cpu) on a machine with the Ascend CANN toolkit (>= 8.5.0 for the LSE of its MLA attention), e.g. "
    "`pip install torch-npu==2.13.0`, then `source /usr/local/Ascend/ascend-toolkit/set_env.sh`"
)


EMULATOR_ENV = "DCP_COMPILE_NPU_EMULATOR"
"""Set to 1 for the emulated NPU device (dcp_compile/testing/npu_emulator) where torch_npu is absent."""


def torch_npu_installed() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


def require_torch_npu(what: str) -> None:
    """Make `torch.npu` and the `npu` device available for `what` (an NPU device, HCCL, NPU
    graphs): torch_npu, or, with DCP_COMPILE_NPU_EMULATOR=1 and no torch_npu, the emulated
    device. This is the one place that knows which; a clear error if neither is there."""
    if torch_npu_installed():
        importlib.import_module("torch_npu")
        return
    if os.environ.get(EMULATOR_ENV) == "1":
        from dcp_compile.testing import npu_emulator

        npu_emulator.install()
        return
    raise RuntimeError(f"{what} needs torch_npu, which is not installed: {NPU_INSTALL_HINT} (or set "
                       f"{EMULATOR_ENV}=1 for the emulated device of dcp_compile/testing)")


def npu_available() -> bool:
    """Whether an `npu` device can be had here (torch_npu, or the emulator switched on)."""
    return torch_npu_installed() or os.environ.get(EMULATOR_ENV) == "1"


def capturing(device: torch.device) -> bool:
    """Whether the current stream of `device` is capturing a device graph (CUDA graph, NPU graph):
    work done then is recorded and replayed, host copies and reads are not."""
    backend = getattr(torch, torch.device(device).type, None)
    check = getattr(backend, "is_current_stream_capturing", None)
    return bool(check()) if check is not None and backend.is_available() else False


def emulated_npu() -> bool:
    """Whether the `npu` device here is the emulated one (reported by the demo, never branched on)."""
    return not torch_npu_installed() and os.environ.get(EMULATOR_ENV) == "1"
