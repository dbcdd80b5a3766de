"""The kernel back ends, by name: the four built in (torch, triton, flashinfer, npu) and any a
user registers, and what kernels='auto' resolves to for a KV pool."""

from __future__ import annotations

import logging

from dcp_compile.lowering.base import Lowering
from dcp_compile.passes import manager

log = logging.getLogger("dcp_compile")
AUTO = "auto"
_LOWERINGS: dict[str, Lowering] = {}


def register(lowering: Lowering) -> Lowering:
    """Make `lowering` available as apply(..., kernels=lowering.name)."""
    if not isinstance(lowering, Lowering) or not lowering.name or lowering.name == AUTO:
        raise ValueError(f"a lowering is a dcp_compile.lowering.base.Lowering with a name other than 'auto', got {lowering!r}")
    if lowering.name in _LOWERINGS and type(_LOWERINGS[lowering.name]) is not type(lowering):
        raise ValueError(f"a different lowering is registered as {lowering.name!r} already")
    _LOWERINGS[lowering.name] = lowering
    return lowering


def names() -> tuple[str, ...]:
    """'auto' and every registered back end."""
    return (AUTO, *_LOWERINGS)


def get(name: str) -> Lowering:
    if name not in _LOWERINGS:
        raise ValueError(f"kernels must be one of {list(names())}, got {name!r}")
    return _LOWERINGS[name]


def pass_names() -> tuple[str, ...]:
    """Every pass a model may run: the DCP passes and every registered back end's lowering passes."""
    return manager.all_pass_names(p.name for lowering in _LOWERINGS.values() for p in lowering.passes())


def check_pass_names(names) -> None:
    """Raise for a name that no pass has (disabled_passes, the dump's --only)."""
    manager.check_pass_names(names, pass_names())


def resolve(kernels: str, pool, config) -> Lowering:
    """The back end `kernels` names, or for 'auto' the one for the pool's device: npu on an NPU;
    on CUDA flashinfer where it serves the GPU, the pool and the config (else triton, logged
    once with the reason); the torch reference elsewhere."""
    if kernels != AUTO:
        return get(kernels)
    device = pool.device.type
    if device == "npu":
        return get("npu")
    if device == "cuda":
        reason = get("flashinfer").unsupported_reason(pool, config)
        if reason is None:
            return get("flashinfer")
        log.info("kernels='auto': the Triton attention kernel, not FlashInfer: %s", reason)
        return get("triton")
    return get("torch")


def _register_builtins() -> None:
    from dcp_compile.lowering.flashinfer.lowering import FlashInferLowering
    from dcp_compile.lowering.npu.lowering import NPULowering
    from dcp_compile.lowering.torch.lowering import TorchLowering
    from dcp_compile.lowering.triton.lowering import TritonLowering

    for lowering in (TorchLowering(), TritonLowering(), FlashInferLowering(), NPULowering()):
        register(lowering)


_register_builtins()
