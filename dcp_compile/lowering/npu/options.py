"""The NPU back end's options (apply(..., kernels='npu', npu_kv_format='nz', ...) sets them by
name; the demo and dump take them as flags). Facts and sources: docs/ascend.md."""

from __future__ import annotations

from dataclasses import dataclass, field

from dcp_compile.lowering.base import Options

FIA_BLOCK_SIZE_RULES = ("cann-2025", "cann-2026")
KV_FORMATS = ("nd", "nz")
FIA_VERSIONS = (1, 2)
VERIFY_SCHEMES = ("split", "mask")
TORCHAIR_MODES = ("reduce-overhead", "npugraph_ex")
KERNEL_SETS = ("native", "triton")


@dataclass(frozen=True)
class NPUOptions(Options):
    npu_kernels: str = field(default="native", metadata={
        "choices": KERNEL_SETS,
        "help": "native (CANN ops through torch_npu and aten ops it runs on the device; the default) or triton "
                "(the project's Triton kernels for the KV write, metadata, pack and window: A2/A3 with a paired "
                "triton-ascend)"})
    """Which kernels an NPU graph runs besides FIA and npu_attention_update. 'native': the KV write
    through torch_npu.npu_scatter_pa_kv_cache and the rest as aten ops torch_npu runs on the device
    (lowering/npu/native_ops.py); needs no triton-ascend, runs on A5. 'triton': the shared Triton
    kernels under triton-ascend (Atlas A2/A3 only; its releases pair with older torch). docs/ascend.md §16-§18."""

    npu_kv_format: str = field(default="nd", metadata={
        "choices": KV_FORMATS,
        "help": "the KV cache FIA reads, nd or nz (FRACTAL_NZ, [blocks, 1, D/16, 128, 16]: needs --block-size 128)"})
    """The KV cache FIA reads. 'nd': latent [rows, 512] and rope [rows, 64] per layer; 'nz': both in
    the NZ layout [blocks, 1, D/16, 128, 16] (the Ascend A5 layout; FIA block size 128 only).
    docs/ascend.md §11.4, §15."""

    fia_version: int = field(default=1, metadata={
        "choices": FIA_VERSIONS, "flag": "--fia", "flag_choices": ("v1", "v2"), "parse": lambda text: int(text[1:]),
        "help": "npu_fused_infer_attention_score (v1, the default) or its _v2"})
    """1 (npu_fused_infer_attention_score, what both engines' DCP paths call) or 2
    (npu_fused_infer_attention_score_v2, torch_npu >= 2.6.0.post3 / 2.7.1; layouts BSND_NBSD and
    TND_NTD). docs/ascend.md §1.3, §15.2."""

    npu_verify: str = field(default="split", metadata={
        "choices": VERIFY_SCHEMES,
        "help": "verify: split (FIA over the prefix + a window kernel, the default) or mask (one FIA call with a "
                "rank-local causal mask, as vllm-ascend and SGLang do)"})
    """Verify and short extend rows: 'split' (FIA unmasked over each row's keys before its first
    query, plus a window kernel over the rest, merged by LSE) or 'mask' (one FIA call per layer
    with a rank-local causal mask [B, 1, S, blocks x 128], as vllm-ascend and SGLang verify under
    DCP; rows of equal query counts, S <= 16: a step of other rows runs the split). docs/ascend.md §15.3."""

    fia_block_sizes: str = field(default="cann-2025", metadata={
        "choices": FIA_BLOCK_SIZE_RULES, "baseline": True,
        "help": "which FIA block sizes to allow: cann-2025 (16 or 128) or cann-2026 (multiples of 16 up to 1024)"})
    """Which FIA block sizes (rows of a local KV block) to allow. 'cann-2025': 16 or 128, what
    CANN's FIA tiling check allowed for ND MLA paged KV until 2026 (ops-transformer c29bc106,
    2025-11), and what both engines use (128); 'cann-2026': any multiple of 16 up to 1024, which
    only a CANN built from ops-transformer of 2026 or later (e197ec56) accepts (docs/ascend.md §4.5).
    A fact of the CANN, not a kernel choice: the demo's dcp_size=1 baseline takes it too."""

    torchair_mode: str = field(default="reduce-overhead", metadata={
        "choices": TORCHAIR_MODES,
        "help": "--inner-compile torchair: reduce-overhead (aclgraph) or npugraph_ex (torch_npu >= 2.14)"})
    """inner_compile='torchair': 'reduce-overhead' (aclgraph) or 'npugraph_ex' (torch_npu >= 2.14)."""
