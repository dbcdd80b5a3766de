"""The --kernels npu options that demo and dump share (DCPConfig.npu_kv_format, fia_version, npu_verify)."""

from __future__ import annotations

from dcp_compile.config import NPU_KV_FORMATS, NPU_VERIFY_SCHEMES


def add(p) -> None:
    p.add_argument("--npu-kv-format", default="nd", choices=NPU_KV_FORMATS,
                   help="--kernels npu: the KV cache FIA reads, nd or nz (FRACTAL_NZ, [blocks, 1, D/16, 128, 16]: "
                        "needs --block-size 128); default nd")
    p.add_argument("--fia", default="v1", choices=("v1", "v2"),
                   help="--kernels npu: npu_fused_infer_attention_score (v1, default) or its _v2")
    p.add_argument("--npu-verify", default="split", choices=NPU_VERIFY_SCHEMES,
                   help="--kernels npu, verify: split (FIA over the prefix + a window kernel, default) or mask (one "
                        "FIA call with a rank-local causal mask, as vllm-ascend and SGLang do)")


def fields(args) -> dict:
    return dict(npu_kv_format=args.npu_kv_format, fia_version=int(args.fia[1]), npu_verify=args.npu_verify)
