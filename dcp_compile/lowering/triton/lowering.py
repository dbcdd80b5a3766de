"""The Triton kernels as a back end: one source for CUDA and triton-ascend."""

from __future__ import annotations

from dcp_compile.lowering import triton as triton_kernels
from dcp_compile.lowering.base import Lowering
from dcp_compile.lowering.triton.lower_kernels import LowerKernels
from dcp_compile.lowering.triton.lower_projections import LowerProjections, tuned_for


class TritonLowering(Lowering):
    name = "triton"
    description = "the Triton kernels (CUDA; triton-ascend; the CPU under TRITON_INTERPRET=1)"

    def unsupported_reason(self, pool, config) -> str | None:
        if not triton_kernels.available():
            return "it needs the triton package (pip install triton)"
        if pool.device.type == "cpu" and not triton_kernels.interpreted():
            return ("on the CPU the Triton kernels run in Triton's interpreter, which is off: set TRITON_INTERPRET=1 "
                    "(no Triton driver runs on the CPU)")
        return super().unsupported_reason(pool, config)

    def passes(self) -> list:
        return [LowerKernels(), LowerProjections(devices=("cuda",))]

    def skinny_matmuls(self, pool) -> bool:
        return tuned_for(pool.device)

    def inner_compile(self, pool) -> str:
        # On CUDA inductor compiles the model around the attention kernels: a 61-layer Kimi-K2
        # decode step at batch 4, 128k ran 18.1 ms against 25.4 ms eager (bench/results/step_h200.json).
        return "inductor" if pool.device.type == "cuda" else "eager"
