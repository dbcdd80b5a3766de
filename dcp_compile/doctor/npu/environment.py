"""The checks of the machine around the ops: the HCCL expansion mode and the driver (HDK) version,
which vllm-ascend's experience ties to NPU-graph capture failures (docs/ascend.md §20.4)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import torch

from dcp_compile.doctor.npu.checks import Context, Result, first_line

EXPANSION_ENV = "HCCL_OP_EXPANSION_MODE"
ADVISED_EXPANSION = "AIV"
HCCL_CAPTURE_CHECKS = ("hccl-in-graphs", "all-to-all-no-splits-in-graphs")
EXPANSION_ADVICE = ("vllm-ascend's troubleshooting prefers HCCL_OP_EXPANSION_MODE=AIV for graph-capture stability "
                    "(capture error 507903)")


def check_hccl_expansion_mode(result: Result, context: Context) -> None:
    """AIV passes. Another value (or none, HCCL's default) is judged by this run's captures of
    HCCL collectives: it FAILs where one failed (set AIV and run again), passes with the advice
    where all passed, and is a SKIP where none ran."""
    value = os.environ.get(EXPANSION_ENV)
    result.measured = {EXPANSION_ENV: value}
    if value is not None and value.strip().upper() == ADVISED_EXPANSION:
        result.verdict = "PASS"
        return
    shown = f"{EXPANSION_ENV}={value}" if value is not None else f"{EXPANSION_ENV} unset"
    ran = {name: context.results[name].verdict for name in HCCL_CAPTURE_CHECKS if name in context.results}
    result.measured["hccl_captures"] = ran
    failed = [name for name, verdict in ran.items() if verdict == "FAIL"]
    if failed:
        result.verdict = "FAIL"
        result.detail = f"{shown} and {', '.join(failed)} failed: export {EXPANSION_ENV}={ADVISED_EXPANSION} and run again"
    elif ran and all(verdict == "PASS" for verdict in ran.values()) and len(ran) == len(HCCL_CAPTURE_CHECKS):
        result.verdict = "PASS"
        result.detail = (f"{shown}: this run's HCCL captures passed; should one fail with error 507903, export "
                         f"{EXPANSION_ENV}={ADVISED_EXPANSION} (vllm-ascend's troubleshooting)")
    else:
        result.detail = f"{shown}, and this run captured no HCCL collective to judge it by; {EXPANSION_ADVICE}"


HDK_MIN = "25.5.1"
VERSION_INFO = Path("/usr/local/Ascend/driver/version.info")
NPU_SMI = "npu-smi"
_HDK = re.compile(r"^\s*(\d+)\.(\d+)(?:\.(rc)?(\d+))?(?:\.(\d+))?", re.IGNORECASE)
_NPU_SMI_VERSION = re.compile(r"Version:\s*(\d+\.\d+[\w.]*)")


def parse_hdk(text: str | None) -> tuple | None:
    """A sortable key for a driver version ("25.5.1", "24.1.rc2", "25.0.rc1.1", "23.0.3"): an RC
    before the release of its major.minor. None where it cannot be read."""
    found = _HDK.match(text or "")
    if not found:
        return None
    major, minor, rc, number, extra = found.groups()
    stage = (0 if rc else 1, int(number or 0))
    return (int(major), int(minor)) + stage + (int(extra or 0),)


def _torch_npu_driver() -> str:
    return torch.npu.utils.get_cann_version(module="DRIVER")


def driver_version(get_version=_torch_npu_driver, version_info: Path = VERSION_INFO,
                   npu_smi: str = NPU_SMI) -> tuple[str | None, str]:
    """(the driver version, where it was read), or (None, why it could not be): from torch_npu
    (torch.npu.utils.get_cann_version(module="DRIVER"), which reads /etc/ascend_install.info and the
    driver's version.info; "" below CANN 8.1.RC1), else the driver's version.info ("Version=..."),
    else `npu-smi info` ("Version: ...")."""
    tried = []
    try:
        version = get_version()
    except Exception as exc:
        tried.append(f"get_cann_version(module='DRIVER') raised {first_line(exc, 80)}")
    else:
        if version:
            return version, 'torch.npu.utils.get_cann_version(module="DRIVER")'
        tried.append("get_cann_version(module='DRIVER') gave '' (CANN before 8.1.RC1, or the files not mounted)")
    try:
        for line in version_info.read_text().splitlines():
            if line.strip().startswith("Version="):
                return line.split("=", 1)[1].strip(), str(version_info)
        tried.append(f"{version_info} has no Version= line")
    except OSError as exc:
        tried.append(f"{version_info}: {exc.strerror or type(exc).__name__}")
    if shutil.which(npu_smi) is None:
        tried.append(f"no {npu_smi} on PATH")
    else:
        try:
            shown = subprocess.run([npu_smi, "info"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            tried.append(f"{npu_smi} info: {first_line(exc, 80)}")
        else:
            found = _NPU_SMI_VERSION.search(shown)
            if found:
                return found.group(1), f"{npu_smi} info"
            tried.append(f"{npu_smi} info shows no Version:")
    return None, "; ".join(tried)


def hdk_verdict(version: str | None) -> tuple[str, str]:
    """(verdict, detail) for a driver version against the HDK vllm-ascend asks for when a capture
    fails with "Alloc sq cq fail"."""
    key = parse_hdk(version)
    if key is None:
        return "SKIP", f"driver version {version!r} could not be read as a version"
    if key >= parse_hdk(HDK_MIN):
        return "PASS", ""
    return "FAIL", (f"driver (HDK) {version} is older than {HDK_MIN}: vllm-ascend reads the NPU-graph capture error "
                    f"'Alloc sq cq fail' as this, and asks for Ascend HDK {HDK_MIN} or later with its CANN")


def check_driver_version(result: Result, context: Context) -> None:
    if context.emulated:
        result.detail = "the emulated device has no Ascend driver"
        return
    version, where = driver_version()
    result.measured = {"driver": version, "read_from": where if version else None}
    if version is None:
        result.detail = f"the driver version could not be read: {where}"
        return
    result.verdict, result.detail = hdk_verdict(version)
