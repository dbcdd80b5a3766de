"""The Triton kernels as a back end: one source for CUDA and triton-ascend. Its options
(TritonOptions) are also those of the back ends that run its kernels for the rest (flashinfer)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dcp_compile.lowering import triton as triton_kernels
from dcp_compile.lowering.base import Lowering, Options
from dcp_compile.lowering.triton.lower_kernels import LowerKernels
from dcp_compile.lowering.triton.lower_projections import LowerProjections, tuned_for

SKINNY_MATMULS = ("auto", "on", "off")
VERIFY_ATTENTION = ("auto", "folded", "default")


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
    verify_attention: str = field(default="auto", metadata={
        "choices": VERIFY_ATTENTION,
        "help": "verify and extend attention over the KV pool: the folded Triton kernel, the back end's "
                "default kernel, or auto"})
    """Attention over the KV pool in the graphs that read the pool in place (gather-q,
    replicated-q): 'folded', through the folded Triton kernel's launcher
    (lowering/triton/folded_attention.py), which folds a request's queries (in any order) x
    heads into the rows of one tile (each KV block read once for all of them) at verify's shapes
    where that measured faster, and runs Triton's per-query kernel at the others (decode
    included); 'default', the back end's own kernel (Triton's per-query split-KV kernel;
    FlashInfer's fa3 MLA, whose decode stays with fa3 under 'folded' too); 'auto' (default): the
    back end's choice (`folds_verify`)."""


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
        options = self.options
        if options.skinny_matmuls == "auto":
            options = dataclasses.replace(options, skinny_matmuls="on" if tuned_for(pool.device) else "off")
        if options.verify_attention == "auto":
            options = dataclasses.replace(options, verify_attention="folded" if self.folds_verify(pool) else "default")
        return options

    def folds_verify(self, pool) -> bool:
        """verify_attention='auto': whether the folded kernel serves verify here. Its launcher
        folds only at the shapes where it measured faster than Triton's per-query kernel (at most 32
        heads, with enough tiles) and runs that one elsewhere (folded_attention.folds)."""
        return True

    def passes(self) -> list:
        return [LowerKernels(fold_verify=self.options.verify_attention == "folded"), *self.projection_passes()]

    def projection_passes(self) -> list:
        return [LowerProjections(devices=("cuda",), enabled=self.options.skinny_matmuls == "on")]

    def fuse_projections(self, pool) -> bool:
        return pool.device.type == "cuda"  # measured to pay there (bench/results/step_fuse_h200.json)

    def inner_compile(self, pool) -> str:
        # On CUDA inductor compiles the model around the attention kernels: a 61-layer Kimi-K2
        # decode step at batch 4, 128k ran 18.1 ms against 25.4 ms eager (bench/results/step_h200.json).
        return "inductor" if pool.device.type == "cuda" else "eager"
