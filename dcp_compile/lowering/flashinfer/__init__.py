"""FlashInfer's batch MLA kernel as the CUDA lowering of attention over the KV pool.

`flashinfer.mla.BatchMLAPagedAttentionWrapper` (fa3 backend, Hopper) reads a rank's shard
through a CSR page list that `plan()` takes on the host, once per step for every layer. The
lower_flashinfer_attention pass replaces each attention over the pool by
`dcp_flashinfer::mla_paged_attention`, which runs the plan of its graph; `plans.FlashInferPlan`
builds that plan from the runtime's host metadata (per-rank local lengths and local block tables,
which `RequestTable` keeps).

flashinfer is imported lazily: where it is absent (CPU, CI) the same plans run a schema-faithful
torch stand-in of the wrapper (`testing/flashinfer_standin.ReferenceMLAWrapper`), so the lowering is tested end to
end without a GPU.
"""

from __future__ import annotations

import importlib
import logging
import sys

import torch

log = logging.getLogger("dcp_compile")

FA3_LATENT_DIMS = (128, 256, 512)
"""fa3 MLA serves these latent widths; the rope width must be a multiple of 64."""
DTYPES = (torch.bfloat16, torch.float16)


def _module():
    return importlib.import_module("flashinfer.mla")


def unsupported_reason(device: torch.device, kv_lora_rank: int | None = None, rope_dim: int | None = None,
                       dtype: torch.dtype | None = None) -> str | None:
    """Why FlashInfer's fa3 MLA kernel cannot serve a KV pool on `device`, or None if it can."""
    if device.type != "cuda":
        return f"FlashInfer runs on CUDA GPUs, and the KV pool is on {device}"
    try:
        module = _module()
    except Exception as exc:  # noqa: BLE001 - a broken install raises more than ImportError
        return f"flashinfer cannot be imported ({type(exc).__name__}: {exc}); install it with pip install 'dcp_compile[cuda]'"
    for name in ("BatchMLAPagedAttentionWrapper", "MLAPlanMetadata"):
        if not hasattr(module, name):
            version = getattr(sys.modules.get("flashinfer"), "__version__", "?")
            return f"flashinfer {version} has no flashinfer.mla.{name} (dcp_compile needs flashinfer-python >= 0.7)"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return (f"FlashInfer's fa3 MLA kernel needs a Hopper GPU (SM90); {torch.cuda.get_device_name(device)} is "
                f"SM{major}{minor}")
    if kv_lora_rank is not None and kv_lora_rank not in FA3_LATENT_DIMS:
        return f"fa3 MLA serves kv_lora_rank in {FA3_LATENT_DIMS}, this model has {kv_lora_rank}"
    if rope_dim is not None and rope_dim % 64:
        return f"fa3 MLA needs a rope dim that is a multiple of 64, this model has {rope_dim}"
    if dtype is not None and dtype not in DTYPES:
        return f"fa3 MLA takes a bf16 or fp16 KV cache, this one is {dtype}"
    return None


def wrapper_api(device: torch.device):
    """(wrapper class, metadata class): FlashInfer's on CUDA, the torch stand-in elsewhere."""
    if device.type == "cuda":
        module = _module()
        return module.BatchMLAPagedAttentionWrapper, module.MLAPlanMetadata
    from dcp_compile.testing import flashinfer_standin as standin

    return standin.ReferenceMLAWrapper, standin.MLAPlanMetadata


def ensure_ops() -> None:
    """Register the dcp_flashinfer:: ops (importing plans does)."""
    importlib.import_module("dcp_compile.lowering.flashinfer.plans")
