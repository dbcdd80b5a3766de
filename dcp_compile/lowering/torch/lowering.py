"""The torch reference kernels as a back end: every dcp:: op runs its reference implementation."""

from __future__ import annotations

from dcp_compile.lowering.base import Lowering


class TorchLowering(Lowering):
    name = "torch"
    description = "the torch reference kernels (any device; the CPU default)"
