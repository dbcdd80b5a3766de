"""User-facing configuration. Frozen, so its hash can key compile caches."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

INNER_COMPILERS = ("auto", "eager", "inductor", "torchair")
FIA_BLOCK_SIZE_RULES = ("cann-2025", "cann-2026")
FUSE_PROJECTIONS = ("auto", "on", "off")
SKINNY_MATMULS = ("auto", "on", "off")
NPU_KV_FORMATS = ("nd", "nz")
FIA_VERSIONS = (1, 2)
NPU_VERIFY_SCHEMES = ("split", "mask")


@dataclass(frozen=True)
class DCPConfig:
    dcp_size: int = 1
    """N: ranks the latent KV cache is sharded over by tokens. Must divide the TP size."""

    interleave: int = 1
    """I: consecutive logical locations owned by one rank (1 = token-interleaved)."""

    inner_compile: str = "auto"
    """Compiler run on the rewritten graph: 'eager' (run the FX graph), 'inductor', 'torchair'
    (Ascend: NPU graph capture through torchair; needs torch_npu), or 'auto': the kernel back
    end's fastest measured one (inductor for flashinfer and triton on CUDA, eager elsewhere).
    apply() records the compiler it resolved here."""

    torchair_mode: str = "reduce-overhead"
    """inner_compile='torchair': 'reduce-overhead' (aclgraph) or 'npugraph_ex' (torch_npu >= 2.14)."""

    kernels: str = "auto"
    """The kernel back end (dcp_compile.lowering.registry): 'torch' reference kernels, 'triton'
    kernels, 'flashinfer' (CUDA, Hopper: FlashInfer's MLA kernel for attention over the KV pool,
    Triton for the rest; a torch stand-in of FlashInfer on CPU), 'npu' (Ascend: FIA for attention
    over the KV pool, npu_attention_update for the merge; CPU stand-ins where torch_npu is
    absent), one registered by the user, or 'auto' (on CUDA, flashinfer where it is installed and
    serves the GPU and the model, else triton; npu on Ascend NPUs; torch elsewhere). apply()
    records the back end it resolved here."""

    fia_block_sizes: str = "cann-2025"
    """kernels='npu': which FIA block sizes (rows of a local KV block) to allow. 'cann-2025': 16 or
    128, what CANN's FIA tiling check allowed for ND MLA paged KV until 2026 (ops-transformer
    c29bc106, 2025-11), and what both engines use (128); 'cann-2026': any multiple of 16 up to
    1024, which only a CANN built from ops-transformer of 2026 or later (e197ec56) accepts
    (docs/ascend.md §4.5)."""

    npu_kv_format: str = "nd"
    """kernels='npu': the KV cache FIA reads. 'nd': latent [rows, 512] and rope [rows, 64] per layer;
    'nz': both in the NZ layout [blocks, 1, D/16, 128, 16] (the Ascend A5 layout; FIA block size
    128 only). docs/ascend.md §11.4, §15."""

    fia_version: int = 1
    """kernels='npu': 1 (npu_fused_infer_attention_score, what both engines' DCP paths call) or 2
    (npu_fused_infer_attention_score_v2, torch_npu >= 2.6.0.post3 / 2.7.1; layouts BSND_NBSD and
    TND_NTD). docs/ascend.md §1.3, §15.2."""

    npu_verify: str = "split"
    """kernels='npu', verify and short extend rows: 'split' (FIA unmasked over each row's keys
    before its first query, plus a window kernel over the rest, merged by LSE) or 'mask' (one FIA
    call per layer with a rank-local causal mask [B, 1, S, blocks x 128], as vllm-ascend and SGLang
    verify under DCP; rows of equal query counts, S <= 16). docs/ascend.md §15.3."""

    fuse_projections: str = "auto"
    """'on': the projections that read one input become one matmul at compile time (q_a with kv_a,
    gate with up; passes/fuse_projections.py), the parameters becoming views of the fused weight;
    'off'; 'auto' (default): on where the KV pool is on a CUDA device, where it was measured to pay,
    off elsewhere. apply() records what it resolved here."""

    skinny_matmuls: str = "auto"
    """'on': the projections (bias-free linears) and MLA's absorbed per-head products run through
    the skinny-matmul Triton kernel when a step has at most 64 tokens, and cuBLAS above
    (lowering/triton/lower_projections.py; back ends that run the Triton kernels, on CUDA), each
    shape by the config tuned for this GPU or, where cuBLAS measured faster, by cuBLAS; 'off':
    cuBLAS always; 'auto' (default): on where the KV pool is on a CUDA GPU the kernel has tuned
    configs for (lowering/triton/skinny_configs/), off elsewhere. apply() records what it resolved here."""

    attention_strategy: str = "auto"
    """'gather-q', 'gather-kv', or 'auto': the cost model picks per batch (dcp_compile.cost_model).
    A model whose heads are not split (tp_size 1, dcp_size up to the world size) runs
    'replicated-q' (passes/replicated_q_attention.py), which 'auto' resolves to there."""

    debug_checks: bool = False
    """Validate KV write locations and query positions before use (costs host syncs)."""

    disabled_passes: tuple[str, ...] = ()
    """Pass names the pass manager skips, for debugging."""

    dump_dir: str | None = None
    """Folder for per-pass graph dumps; also set by the DCP_COMPILE_DUMP environment variable."""

    def __post_init__(self) -> None:
        if isinstance(self.dcp_size, bool) or not isinstance(self.dcp_size, int) or self.dcp_size < 1:
            raise ValueError(f"dcp_size must be an integer >= 1, got {self.dcp_size!r}")
        if isinstance(self.interleave, bool) or not isinstance(self.interleave, int) or self.interleave < 1:
            raise ValueError(f"interleave must be an integer >= 1, got {self.interleave!r}")
        if self.inner_compile not in INNER_COMPILERS:
            raise ValueError(f"inner_compile must be one of {INNER_COMPILERS}, got {self.inner_compile!r}")
        from dcp_compile.lowering import registry  # the registered back ends, user ones included

        if self.kernels != registry.AUTO:
            registry.get(self.kernels)  # raises for a name no back end is registered under
        if self.torchair_mode not in ("reduce-overhead", "npugraph_ex"):
            raise ValueError(f"torchair_mode must be 'reduce-overhead' or 'npugraph_ex', got {self.torchair_mode!r}")
        if self.kernels == "npu" and self.inner_compile == "inductor":
            raise ValueError("kernels='npu' runs with inner_compile='eager' (inductor does not lower the torch_npu ops)")
        if self.fia_block_sizes not in FIA_BLOCK_SIZE_RULES:
            raise ValueError(f"fia_block_sizes must be one of {FIA_BLOCK_SIZE_RULES}, got {self.fia_block_sizes!r}")
        if self.npu_kv_format not in NPU_KV_FORMATS:
            raise ValueError(f"npu_kv_format must be one of {NPU_KV_FORMATS}, got {self.npu_kv_format!r}")
        if isinstance(self.fia_version, bool) or self.fia_version not in FIA_VERSIONS:
            raise ValueError(f"fia_version must be 1 or 2, got {self.fia_version!r}")
        if self.npu_verify not in NPU_VERIFY_SCHEMES:
            raise ValueError(f"npu_verify must be one of {NPU_VERIFY_SCHEMES}, got {self.npu_verify!r}")
        if self.fuse_projections not in FUSE_PROJECTIONS:
            raise ValueError(f"fuse_projections must be one of {FUSE_PROJECTIONS}, got {self.fuse_projections!r}")
        if self.skinny_matmuls not in SKINNY_MATMULS:
            raise ValueError(f"skinny_matmuls must be one of {SKINNY_MATMULS}, got {self.skinny_matmuls!r}")
        if not isinstance(self.debug_checks, bool):
            raise ValueError(f"debug_checks must be True or False, got {self.debug_checks!r}")
        if self.attention_strategy not in ("auto", "gather-q", "gather-kv", "replicated-q"):
            raise ValueError("attention_strategy must be 'auto', 'gather-q', 'gather-kv' or 'replicated-q', got "
                             f"{self.attention_strategy!r}")
        object.__setattr__(self, "disabled_passes", tuple(self.disabled_passes))

    def resolved(self, lowering, pool) -> "DCPConfig":
        """The config with each 'auto' the back end and the pool decide turned into its choice."""
        config = self
        if config.inner_compile == "auto":
            config = config.replace(inner_compile=lowering.inner_compile(pool))
        if config.fuse_projections == "auto":
            config = config.replace(fuse_projections="on" if pool.device.type == "cuda" else "off")
        if config.skinny_matmuls == "auto":
            config = config.replace(skinny_matmuls="on" if lowering.skinny_matmuls(pool) else "off")
        return config

    def check_options(self, lowering) -> None:
        """Raise where a back-end option is set away from its default for a back end that does not
        read it (Lowering.options): it would be silently ignored."""
        for name in BACK_END_OPTIONS:
            value = getattr(self, name)
            if value != DEFAULTS[name] and name not in lowering.options:
                raise ValueError(f"{name}={value!r} is an option of kernels='npu'; kernels={lowering.name!r} does not "
                                 "read it")

    def replace(self, **changes) -> "DCPConfig":
        return dataclasses.replace(self, **changes)


BACK_END_OPTIONS = ("fia_block_sizes", "npu_kv_format", "fia_version", "npu_verify")
"""DCPConfig fields that only the back end naming them in Lowering.options reads."""
DEFAULTS = {field.name: field.default for field in dataclasses.fields(DCPConfig)}
