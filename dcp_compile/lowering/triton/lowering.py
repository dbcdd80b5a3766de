"""The Triton kernels as a back end: one source for CUDA and triton-ascend. Its options
(TritonOptions) are also those of the back ends that run its kernels for the rest (flashinfer)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dcp_compile.lowering import triton as triton_kernels
from dcp_compile.lowering.base import Lowering, Options
from dcp_compile.lowering.triton.lower_kernels import LowerKernels
from dcp_compile.lowering.triton.lower_projections import LowerProjections, tuned_for

SKINNY_MATMULS = ("auto", "on", "off")


@dataclass(frozen=True)
class TritonOptions(Options):
    skinny_matmuls: str = field(default="auto", metadata={
        "choices": SKINNY_MATMULS,
        "help": "few-token projections through the skinny-matmul kernel (CUDA): auto (where tuned), on or off"})
    """'on': the projections (bias-free linears) and MLA's absorbed per-head products run through
    the skinny-matmul Triton kernel when a step has at most 64 tokens, and cuBLAS above
    (lower_projections.py; on CUDA), each shape by the config tuned for this GPU or, where cuBLAS
    measured faster, by cuBLAS; 'off': cuBLAS always; 'auto' (default): on where the KV pool is on
    a CUDA GPU the kernel has tuned configs for (skinny_configs/), off elsewhere."""


class TritonLowering(Lowering):
    name = "triton"
    description = "the Triton kernels (CUDA; triton-ascend; the CPU under TRITON_INTERPRET=1)"
    Options = TritonOptions
    options = TritonOptions()

    def unsupported_reasons(self, pool, config, model=None) -> list[str]:
        if not triton_kernels.available():
            return ["it needs the triton package (pip install triton)"]
        if pool.device.type == "cpu" and not triton_kernels.interpreted():
            return ["on the CPU the Triton kernels run in Triton's interpreter, which is off: set TRITON_INTERPRET=1 "
                    "(no Triton driver runs on the CPU)"]
        return super().unsupported_reasons(pool, config, model)

    def resolve_options(self, pool) -> TritonOptions:
        if self.options.skinny_matmuls != "auto":
            return self.options
        return TritonOptions(skinny_matmuls="on" if tuned_for(pool.device) else "off")

    def passes(self) -> list:
        return [LowerKernels(), *self.projection_passes()]

    def projection_passes(self) -> list:
        return [LowerProjections(devices=("cuda",), enabled=self.options.skinny_matmuls == "on")]

    def fuse_projections(self, pool) -> bool:
        return pool.device.type == "cuda"  # measured to pay there (bench/results/step_fuse_h200.json)

    def inner_compile(self, pool) -> str:
        # On CUDA inductor compiles the model around the attention kernels: a 61-layer Kimi-K2
        # decode step at batch 4, 128k ran 18.1 ms against 25.4 ms eager (bench/results/step_h200.json).
        return "inductor" if pool.device.type == "cuda" else "eager"
