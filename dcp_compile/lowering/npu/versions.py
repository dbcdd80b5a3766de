"""Which Ascend deployments (SoC family x CANN x torch_npu x triton-ascend) each NPU option needs,
as data with a source per row, and the check that refuses an option set a deployment cannot run.

    versions.deployment() -> Deployment(soc, family, cann, torch_npu, triton_ascend)
    versions.unsupported_reasons(options, deployment) -> list[str]   (empty: nothing refused)
    versions.advisories(options, deployment) -> list[str]            (accepted, but not advised)

Nothing here has run on Ascend hardware: the rules are read from the sources named per row
(docs/ascend.md §18 collects them). `options` is any object with the attributes npu_kernels,
npu_kv_format, fia_version, npu_verify and fia_block_sizes (missing ones take NPUOptions'
defaults, npu_kernels "native"). A deployment without torch_npu (the emulated device) skips the
rules that read the torch_npu and triton-ascend versions; those on the SoC and CANN still apply.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from typing import NamedTuple

# --- SoC families ------------------------------------------------------------------------------

# The SoC names torch.npu.get_device_name() gives, by family (Ascend/pytorch COMPATIBILITY.en.md,
# "Hardware support", names the families), from torch_npu's own SoC table: the torch_npu 2.13.0 wheel's
# include/torch_npu/csrc/core/npu/NpuVariables.h (enum SocVersion) and the names its
# lib/libtorch_npu.so maps to it (socVersionMap of torch_npu/csrc/core/npu/NpuVariables.cpp). Atlas A2
# is SocVersion 220-225, Atlas A3 250-256 (Ascend910_9361 from the same table at Ascend/pytorch
# 00acf37e), Ascend 950 (A5) 260, whose names are Ascend950PR_xxxx and Ascend950DT_xxxx. "Ascend910B"
# (SocVersion 104) is a first-generation Ascend 910 beside Ascend910A and Ascend910ProB, not an A2.
A2_SOCS = ("Ascend910B1", "Ascend910B2", "Ascend910B2C", "Ascend910B3", "Ascend910B4", "Ascend910B4-1")
A3_SOCS = ("Ascend910_9391", "Ascend910_9392", "Ascend910_9381", "Ascend910_9382", "Ascend910_9372", "Ascend910_9362",
           "Ascend910_9363", "Ascend910_9361")
A5_PREFIX = "Ascend950"
FAMILIES = ("A2", "A3", "A5")

EMULATOR_ENV = "DCP_COMPILE_NPU_EMULATOR"
EMULATOR_SOC_ENV = "DCP_COMPILE_NPU_EMULATOR_SOC"
EMULATOR_CANN_ENV = "DCP_COMPILE_NPU_EMULATOR_CANN"
EMULATOR_SOC_DEFAULT = "Ascend910B3"
EMULATOR_CANN_DEFAULT = "9.0.0"  # the CANN of torch_npu 2.10.0 (vllm-ascend's pin): every option accepted


def soc_family(soc: str | None) -> str | None:
    """'A2', 'A3' or 'A5' for a torch.npu.get_device_name() answer; None for any other SoC."""
    if soc in A2_SOCS:
        return "A2"
    if soc in A3_SOCS:
        return "A3"
    if soc and soc.startswith(A5_PREFIX):
        return "A5"
    return None


# --- version parsing ---------------------------------------------------------------------------

_CANN = re.compile(r"^\s*(\d+)\.(\d+)\.(?:(RC)(\d+)|(T)(\d+)|(\d+))(?:\.(alpha|beta)(\d+))?")


def parse_cann(text: str | None) -> tuple | None:
    """A sortable key for a CANN version as torch_npu reports it ("8.5.0", "8.3.RC1", "8.0.RC3.alpha001",
    "9.0.T5"; GetCANNInfo.cpp VersionToNum @ Ascend/pytorch 9e73e708 reads the same forms): T < RC < final
    within one major.minor, alpha < beta < none within one of those. None where it cannot be read."""
    m = _CANN.match(text or "")
    if not m:
        return None
    major, minor = int(m.group(1)), int(m.group(2))
    if m.group(3):
        stage = (1, int(m.group(4)))
    elif m.group(5):
        stage = (0, int(m.group(6)))
    else:
        stage = (2, int(m.group(7)))
    pre = {"alpha": (0, int(m.group(9) or 0)), "beta": (1, int(m.group(9) or 0))}.get(m.group(8), (2, 0))
    return (major, minor) + stage + pre


_PEP440 = re.compile(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?(?:(rc|a|b)(\d+))?(?:\.?post(\d+))?")


def parse_release(text: str | None) -> tuple | None:
    """A sortable key for a torch_npu or triton-ascend version ("2.7.1.post4", "2.10.0", "3.2.0rc4",
    "2.13.0+cpu"): (major, minor, patch, pre, post), a release candidate before its release, a post
    after it. None where it cannot be read."""
    m = _PEP440.match(text or "")
    if not m:
        return None
    pre = (0, int(m.group(5))) if m.group(4) else (1, 0)
    post = int(m.group(6)) if m.group(6) is not None else -1
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0), pre, post)


def _cann_at_least(cann: str | None, minimum: str) -> bool:
    key = parse_cann(cann)
    return key is not None and key >= parse_cann(minimum)


# --- the data ----------------------------------------------------------------------------------

class Release(NamedTuple):
    torch_npu: str
    branch: str          # Ascend/pytorch branch the wheel is built from
    torch: str
    cann: str            # the CANN release it is paired with
    line: str            # Ascend Extension for PyTorch release line


_COMPAT = "Ascend/pytorch COMPATIBILITY.en.md @ 9e73e708"

# torch_npu releases with the CANN each is paired with (Ascend/pytorch COMPATIBILITY.en.md @ 9e73e708,
# "TorchNPU version mapping table"); 2.10.0 of line 26.0.0 from the tag v26.0.0-pytorch2.10.0 (version.txt).
TORCH_NPU_RELEASES = (
    Release("2.6.0", "v2.6.0-7.1.0", "2.6.0", "8.2.RC1", "7.1.0"),
    Release("2.5.1.post1", "v2.5.1-7.1.0", "2.5.1", "8.2.RC1", "7.1.0"),
    Release("2.6.0.post3", "v2.6.0-7.2.0", "2.6.0", "8.3.RC1", "7.2.0"),
    Release("2.7.1", "v2.7.1-7.2.0", "2.7.1", "8.3.RC1", "7.2.0"),
    Release("2.8.0", "v2.8.0-7.2.0", "2.8.0", "8.3.RC1", "7.2.0"),
    Release("2.6.0.post5", "v2.6.0-7.3.0", "2.6.0", "8.5.0", "7.3.0"),
    Release("2.7.1.post2", "v2.7.1-7.3.0", "2.7.1", "8.5.0", "7.3.0"),
    Release("2.8.0.post2", "v2.8.0-7.3.0", "2.8.0", "8.5.0", "7.3.0"),
    Release("2.9.0", "v2.9.0-7.3.0", "2.9.0", "8.5.0", "7.3.0"),
    Release("2.7.1.post4", "v2.7.1-26.0.0", "2.7.1", "9.0.0", "26.0.0"),
    Release("2.8.0.post4", "v2.8.0-26.0.0", "2.8.0", "9.0.0", "26.0.0"),
    Release("2.9.0.post2", "v2.9.0-26.0.0", "2.9.0", "9.0.0", "26.0.0"),
    Release("2.10.0", "v2.10.0-26.0.0", "2.10.0", "9.0.0", "26.0.0"),
    Release("2.7.1.post8", "v2.7.1-26.1.0", "2.7.1", "9.1.0", "26.1.0"),
    Release("2.9.0.post6", "v2.9.0-26.1.0", "2.9.0", "9.1.0", "26.1.0"),
    Release("2.10.0.post4", "v2.10.0-26.1.0", "2.10.0", "9.1.0", "26.1.0"),
    Release("2.11.0", "v2.11.0-26.1.0", "2.11.0", "9.1.0", "26.1.0"),
    Release("2.12.0", "v2.12.0-26.1.0", "2.12.0", "9.1.0", "26.1.0"),
)


class TritonAscend(NamedTuple):
    version: str
    torch: str
    cann: str
    families: tuple


_TRITON_NOTES = "triton-lang/triton-ascend docs/en/release_note.md @ 30b4f77c"

# triton-ascend's "Version Compatibility Matrix" and "Release Compatibility Matrix" (hardware: Atlas A2/A3).
TRITON_ASCEND_RELEASES = (
    TritonAscend("3.2.0", "2.6.0", "8.5.0", ("A2", "A3")),
    TritonAscend("3.2.1", "2.7.1", "9.0.0", ("A2", "A3")),
    TritonAscend("3.2.2", "2.10.0", "9.1.0", ("A2", "A3")),
    TritonAscend("main", "2.10.0", "9.0.0", ("A2", "A3")),
)
"""3.2.2 has no release note: vllm-ascend pins it with torch 2.10.0 and torch_npu 2.10.0.post6
(requirements.txt @ 0baa3f12), and SGLang's docker/npu-950.Dockerfile @ ae0ef169 installs it with CANN
9.1.0 (docs/ascend.md §18.3)."""

# The first torch_npu, per torch series, whose npu_scatter_pa_kv_cache takes cache_mode: the op came with
# op-plugin d69b9aa7 (2025-08-21) with cache_mode fixed to "PA_NZ" inside (line 7.2.0 on); the argument
# (None/"Norm" for ND, "PA_NZ" for NZ) with op-plugin e785e295 (master, 2026-04-16) and its 26.0.0
# cherry-pick 02717ef1: every wheel of line 26.0.0 on. A later series (2.11, 2.12, ...) has it from its first.
NATIVE_KV_WRITE_MIN = {(2, 7): "2.7.1.post4", (2, 8): "2.8.0.post4", (2, 9): "2.9.0.post2", (2, 10): "2.10.0"}
NATIVE_KV_WRITE_ALL_FROM = (2, 11)
FIA_V2_MIN = "2.6.0.post3"          # docs/ascend.md §15.2: the 2025-10-23 wheels (line 7.2.0)
LSE_MLA_MIN_CANN = "8.5.0"           # docs/ascend.md §2.4, §7.5
CANN_2026_MIN = "9.0.0"              # the first CANN release line paired with 2026 sources (docs/ascend.md §18.4) [I]
TRITON_MIN = "3.2.0"


class Row(NamedTuple):
    option: str
    value: str
    socs: str
    cann: str
    torch_npu: str
    triton_ascend: str
    source: str


# The matrix: what each option value needs. README "Ascend versions" prints it (matrix_markdown()).
MATRIX = (
    Row("(every option set)", "-", "A2, A3, A5", ">= 8.5.0", "paired with its CANN", "-",
        "FIA softmax LSE with MLA and zero-length shards: docs/ascend.md §2.4, §7.5 (vllm-ascend PR #6013)"),
    Row("npu_kernels", "native (default)", "A2, A3, A5 [U: op docs list A2/A3]", ">= 8.5.0 (9.0.0 is the paired one)",
        "2.7.1.post4, 2.8.0.post4, 2.9.0.post2, 2.10.0, any 2.11+", "-",
        "npu_scatter_pa_kv_cache(cache_mode=): op-plugin d69b9aa7, e785e295, 02717ef1; " + _COMPAT + "; §18.2"),
    Row("npu_kernels", "triton", "A2, A3", ">= 8.5.0 (3.2.0), >= 9.0.0 (3.2.1, main)", "any",
        ">= 3.2.0 (3.2.0: torch 2.6.0; 3.2.1: 2.7.1; main: 2.10.0)", _TRITON_NOTES + "; §12.4, §18.3"),
    Row("npu_kv_format", "nd (default)", "A2, A3, A5", "-", "-", "-", "docs/ascend.md §11.2, §11.3"),
    Row("npu_kv_format", "nz", "A2, A3, A5 (FIA block 128 only)",
        ">= 8.5.0 (LSE with NZ [I]); A5 with npu_kernels='native': >= 9.0.0 [I: PA_NZ in arch35]", "-", "-",
        "docs/ascend.md §11.4, §15.1; ops-transformer e5b0ac51 (ND only on Ascend950), da7cb684 (PA_NZ); §18.4"),
    Row("fia_version", "1 (default)", "A2, A3, A5", "-", "every wheel from 2.7.1.post2 checked", "-",
        "docs/ascend.md §1.1"),
    Row("fia_version", "2", "A2, A3, A5", "-", ">= 2.6.0.post3 (2.6.0.post3, 2.7.1, 2.8.0 and later)", "-",
        "docs/ascend.md §1.3, §15.2"),
    Row("npu_verify", "split (default)", "A2, A3, A5", "-", "-", "-", "docs/ascend.md §6.5, §13 #7"),
    Row("npu_verify", "mask", "A2, A3 (A5: accepted, not advised)", ">= 9.0.0 [I: 2026 ops-transformer]", "-", "-",
        "ops-transformer c29bc106 fused_infer_attention_score_tiling_check_feature.cpp:213-250; e197ec56; "
        "docs/ascend.md §6.4, §15.3, §18.4"),
    Row("fia_block_sizes", "cann-2025 (default)", "A2, A3, A5", "-", "-", "-", "docs/ascend.md §4.5"),
    Row("fia_block_sizes", "cann-2026", "A2, A3, A5", ">= 9.0.0 [I: 2026 ops-transformer]", "-", "-",
        "ops-transformer e197ec56 CheckFeatureBlockSize; docs/ascend.md §4.5, §18.4"),
)


def matrix_markdown() -> str:
    """MATRIX as the Markdown table of the README's "Ascend versions" section."""
    head = "| option | value | SoC | CANN | torch_npu | triton-ascend | source |\n| --- | --- | --- | --- | --- | --- | --- |"
    rows = [f"| `{r.option}` | {r.value} | {r.socs} | {r.cann} | {r.torch_npu} | {r.triton_ascend} | {r.source} |"
            if not r.option.startswith("(") else
            f"| {r.option} | {r.value} | {r.socs} | {r.cann} | {r.torch_npu} | {r.triton_ascend} | {r.source} |"
            for r in MATRIX]
    return "\n".join([head] + rows)


# --- the stacks users run ----------------------------------------------------------------------

class Stack(NamedTuple):
    name: str
    soc: str              # a SoC name of the family the stack is built for
    cann: str
    torch: str
    torch_npu: str
    triton_ascend: str | None
    source: str


# The engines' published Ascend stacks, each as a deployment (docs/ascend.md §18.7).
STACKS = (
    Stack("SGLang NPU image (A2/A3)", "Ascend910_9391", "8.5.0", "2.10.0", "2.10.0", "3.2.1",
          "sgl-project/sglang docker/npu.Dockerfile @ 066209de (DEVICE_TYPE a3, or 910b for A2)"),
    Stack("SGLang NPU image (A5)", "Ascend950PR_9579", "9.1.0", "2.10.0", "2.10.0.post4", "3.2.2",
          "sgl-project/sglang docker/npu-950.Dockerfile @ ae0ef169"),
    Stack("vllm-ascend 0.26.0rc1 (A2)", "Ascend910B3", "9.1.0", "2.10.0", "2.10.0.post4", None,
          "docs.vllm.ai/projects/ascend/en/v0.26.0rc1/installation.html"),
    Stack("vllm-ascend main (A2)", "Ascend910B3", "9.1.0 [I]", "2.10.0", "2.10.0.post6", "3.2.2",
          "vllm-project/vllm-ascend requirements.txt @ 0baa3f12 (its CANN: 0.26.0rc1's, inferred)"),
)
OPTION_VALUES = (("npu_kernels", ("native", "triton")), ("npu_kv_format", ("nd", "nz")), ("fia_version", (1, 2)),
                 ("npu_verify", ("split", "mask")), ("fia_block_sizes", ("cann-2025", "cann-2026")))


def stack_deployment(stack: Stack) -> Deployment:
    cann = stack.cann.split()[0]
    return Deployment(stack.soc, soc_family(stack.soc), cann, stack.torch_npu, stack.triton_ascend)


def refused_on(stack: Stack) -> list[str]:
    """The option values (each alone, the others at their defaults) unsupported_reasons refuses on `stack`."""
    from dcp_compile.lowering.npu.options import NPUOptions

    deployment = stack_deployment(stack)
    return [f"{name}={value!r}" for name, values in OPTION_VALUES for value in values
            if unsupported_reasons(NPUOptions(**{name: value}), deployment)]


def stacks_markdown() -> str:
    """STACKS as the Markdown table of the README's "Ascend versions" section: what each refuses."""
    head = ("| stack | SoC | CANN | torch | torch_npu | triton-ascend | refused there (the rest runs) | source |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = [f"| {s.name} | {s.soc} | {s.cann} | {s.torch} | {s.torch_npu} | {s.triton_ascend or '-'} | "
            f"{', '.join(f'`{v}`' for v in refused_on(s)) or 'nothing'} | {s.source} |" for s in STACKS]
    return "\n".join([head] + rows)


# --- detection ---------------------------------------------------------------------------------

class Deployment(NamedTuple):
    soc: str | None            # torch.npu.get_device_name(), e.g. "Ascend910B3"
    family: str | None         # "A2", "A3", "A5" or None
    cann: str | None           # torch.npu.utils.get_cann_version(module="CANN"), e.g. "8.5.0"
    torch_npu: str | None      # importlib.metadata.version("torch_npu"); None without it
    triton_ascend: str | None  # importlib.metadata.version("triton-ascend"); None without it


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def deployment() -> Deployment:
    """The SoC, CANN, torch_npu and triton-ascend this process runs with, read as torch_npu exposes them:
    torch.npu.get_device_name() and torch.npu.utils.get_cann_version(module="CANN") (torch_npu/npu/utils.py:37
    @ Ascend/pytorch 9e73e708). Where torch.npu lacks them and DCP_COMPILE_NPU_EMULATOR=1, the emulated
    device's DCP_COMPILE_NPU_EMULATOR_SOC (default Ascend910B3) and DCP_COMPILE_NPU_EMULATOR_CANN
    (default 9.0.0). torch_npu's "" for an unreadable CANN version is None."""
    import torch

    npu = getattr(torch, "npu", None)
    emulated = os.environ.get(EMULATOR_ENV) == "1"
    soc = cann = None
    get_name = getattr(npu, "get_device_name", None)
    if get_name is not None:
        try:
            soc = get_name() or None
        except Exception:  # no device visible, or the runtime failed to start
            soc = None
    get_cann = getattr(getattr(npu, "utils", None), "get_cann_version", None)
    if get_cann is not None:
        try:
            cann = get_cann(module="CANN") or None
        except Exception:
            cann = None
    if emulated:
        soc = soc or os.environ.get(EMULATOR_SOC_ENV, EMULATOR_SOC_DEFAULT)
        cann = cann or os.environ.get(EMULATOR_CANN_ENV, EMULATOR_CANN_DEFAULT)
    return Deployment(soc, soc_family(soc), cann, _dist_version("torch_npu"), _dist_version("triton-ascend"))


# --- the rules ---------------------------------------------------------------------------------

def _opt(options, name, default):
    return getattr(options, name, default)


def _found(d: Deployment) -> str:
    return (f"{d.soc or 'an unknown SoC'} ({d.family or 'no known family'}), CANN {d.cann or 'unknown'}, "
            f"torch_npu {d.torch_npu or 'absent'}, triton-ascend {d.triton_ascend or 'absent'}")


def _native_kv_write_ok(torch_npu: str) -> bool:
    key = parse_release(torch_npu)
    if key is None:
        return False
    if key[:2] >= NATIVE_KV_WRITE_ALL_FROM:
        return True
    minimum = NATIVE_KV_WRITE_MIN.get(key[:2])
    return minimum is not None and key >= parse_release(minimum)


def unsupported_reasons(options, deployment: Deployment) -> list[str]:
    """One sentence per rule the option set breaks on this deployment (empty: accepted). Each names the
    option, what was found, what is allowed and its source."""
    d = Deployment(*deployment)
    kernels = _opt(options, "npu_kernels", "native")
    fia = _opt(options, "fia_version", 1)
    verify = _opt(options, "npu_verify", "split")
    blocks = _opt(options, "fia_block_sizes", "cann-2025")
    found = _found(d)
    reasons = []

    if d.family is None:
        reasons.append(f"the NPU back end runs FIA's MLA path on Atlas A2 ({', '.join(A2_SOCS)}), Atlas A3 "
                       f"({', '.join(A3_SOCS)}) or Ascend 950 (A5, {A5_PREFIX}*), found {found} (docs/ascend.md §18.1)")
    if parse_cann(d.cann) is None:
        reasons.append(f"the CANN version could not be read (torch.npu.utils.get_cann_version(module=\"CANN\") gave "
                       f"{d.cann!r}); FIA's softmax LSE with MLA needs CANN >= {LSE_MLA_MIN_CANN} (docs/ascend.md §2.4)")
    elif not _cann_at_least(d.cann, LSE_MLA_MIN_CANN):
        reasons.append(f"every option set needs FIA's softmax LSE with MLA and zero-length shards, which need CANN >= "
                       f"{LSE_MLA_MIN_CANN}, found {found} (docs/ascend.md §2.4, §7.5)")

    if kernels == "triton":
        if d.family not in ("A2", "A3"):
            reasons.append(f"npu_kernels='triton' needs triton-ascend, released for Atlas A2/A3 only, found {found}; "
                           f"use npu_kernels='native' (docs/ascend.md §18.3)")
        if d.torch_npu is not None:
            tkey = parse_release(d.triton_ascend)
            if d.triton_ascend is None:
                reasons.append(f"npu_kernels='triton' needs triton-ascend >= {TRITON_MIN} installed (it replaces the "
                               f"triton package), found {found} (docs/ascend.md §12.4, §18.3)")
            elif tkey is None or tkey < parse_release(TRITON_MIN):
                reasons.append(f"npu_kernels='triton' needs triton-ascend >= {TRITON_MIN}, found {found} "
                               f"(docs/ascend.md §18.3)")
            elif tkey >= parse_release("3.2.1") and parse_cann(d.cann) is not None \
                    and not _cann_at_least(d.cann, "9.0.0"):
                reasons.append(f"npu_kernels='triton' with triton-ascend {d.triton_ascend} needs CANN >= 9.0.0 (its "
                               f"release notes pair 3.2.1 and main with CANN 9.0.0, 3.2.0 with 8.5.0), found {found} "
                               f"(docs/ascend.md §18.3)")
    elif kernels == "native" and d.torch_npu is not None and not _native_kv_write_ok(d.torch_npu):
        reasons.append(f"npu_kernels='native' writes the KV cache with torch_npu.npu_scatter_pa_kv_cache(cache_mode=...), "
                       f"which torch_npu has from 2.7.1.post4, 2.8.0.post4, 2.9.0.post2, 2.10.0 and every 2.11 on, found "
                       f"{found}; upgrade torch_npu or use npu_kernels='triton' (docs/ascend.md §18.2)")

    if fia == 2 and d.torch_npu is not None:
        key = parse_release(d.torch_npu)
        if key is None or key < parse_release(FIA_V2_MIN):
            reasons.append(f"fia_version=2 needs npu_fused_infer_attention_score_v2, in torch_npu >= {FIA_V2_MIN} "
                           f"(2.6.0.post3, 2.7.1, 2.8.0 and later), found {found} (docs/ascend.md §15.2)")

    if verify == "mask" and parse_cann(d.cann) is not None and not _cann_at_least(d.cann, CANN_2026_MIN):
        reasons.append(f"npu_verify='mask' needs FIA to take sparse_mode=0 with an explicit mask for S > 1, which CANN's "
                       f"2025-11 tiling check refuses (ops-transformer c29bc106) and only a CANN built from 2026 "
                       f"ops-transformer accepts (>= {CANN_2026_MIN} here), found {found}; use npu_verify='split' "
                       f"(docs/ascend.md §6.4, §18.4)")
    if (_opt(options, "npu_kv_format", "nd") == "nz" and kernels == "native" and d.family == "A5"
            and parse_cann(d.cann) is not None and not _cann_at_least(d.cann, CANN_2026_MIN)):
        reasons.append(f"npu_kv_format='nz' with npu_kernels='native' on Ascend950 writes the cache with "
                       f"npu_scatter_pa_kv_cache(cache_mode='PA_NZ'), which the Ascend950 (arch35) kernels take only "
                       f"from a CANN built from 2026 ops-transformer (>= {CANN_2026_MIN} here; earlier builds write ND "
                       f"'Norm' only), found {found}; use npu_kv_format='nd', the default, as vllm-ascend does on A5 "
                       f"(docs/ascend.md §18.4)")
    if blocks == "cann-2026" and parse_cann(d.cann) is not None and not _cann_at_least(d.cann, CANN_2026_MIN):
        reasons.append(f"fia_block_sizes='cann-2026' needs a CANN built from 2026 ops-transformer (>= {CANN_2026_MIN} "
                       f"here), found {found}; use fia_block_sizes='cann-2025' (docs/ascend.md §4.5, §18.4)")
    return reasons


def advisories(options, deployment: Deployment) -> list[str]:
    """Accepted, but not advised: one sentence each, with its source."""
    d = Deployment(*deployment)
    notes = []
    if _opt(options, "npu_verify", "split") == "mask" and d.family == "A5":
        notes.append("npu_verify='mask' on Ascend950 is not advised: no engine runs a masked MLA FIA there, and "
                     "vllm-ascend's newest DCP verify splits as npu_verify='split' does (docs/ascend.md §6.5, §18.4)")
    if _opt(options, "npu_kernels", "native") == "native" and d.family == "A5":
        notes.append("npu_kernels='native' on Ascend950: op-plugin's npu_scatter_pa_kv_cache doc lists Atlas A2/A3 "
                     "only (so does its FIA doc, which A5 deployments run) (docs/ascend.md §18.2)")
    if _opt(options, "fia_version", 1) == 2 and d.torch_npu is not None:
        key = parse_release(d.torch_npu)
        if key is not None and key[:3] == (2, 7, 1):
            notes.append(f"fia_version=2 with torch_npu {d.torch_npu}: torch_npu 2.7.1's NPU-graph capture updates "
                         f"FIA v1's lengths only (docs/ascend.md §9.3, §15.2)")
    return notes
