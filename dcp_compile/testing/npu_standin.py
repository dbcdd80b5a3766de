"""Stand-ins for the Ascend ops that the NPU lowering emits, for the emulated NPU device.

This is not Ascend code. `torch_npu` cannot be imported without the Ascend CANN libraries, and
installed without them it breaks `import torch` (docs/ascend.md §12.1, §12.2), so `register()`
defines the ops our NPU lowering calls under the `npu` namespace, with the schemas that the
selected torch_npu release registers (`$DCP_COMPILE_NPU_EMULATOR_TORCH_NPU`, default 2.13.0; the
schema strings read from its wheel's libtorch_npu.so, npu_emulator/releases, docs/ascend.md §21),
kernels for the npu device implementing the documented semantics and limits (torch code: on the
emulated device it runs on the host), and fake kernels for tracing. Every call, run or traced,
is then checked against the release's own meta (shape) function: outputs of other shapes or
dtypes than torch_npu's raise `releases.ReleaseMismatch`. Lowered graphs then run and are tested
on the emulated device (dcp_compile/testing/npu_emulator). When torch_npu is present, nothing is
registered and the real ops are used.

Ops (their facts and sources: docs/ascend.md):
- `npu_fused_infer_attention_score` (FIA v1), its `.out` overload (`workspace=`, `out=[attention_out,
  softmax_lse]`), `_npu_fused_infer_attention_score_get_max_workspace` and `_infer_output` (the
  helpers torch_npu's NPU-graph handler calls to capture `.default` as `.out`, §1.2, §21). Only
  the MLA path that DCP decode uses is implemented (query_rope/key_rope, paged latent cache,
  §3-§6); documented inputs outside it raise ValueError, documented inputs that the stand-in
  does not implement raise NotImplementedError.
- `npu_fused_infer_attention_score_v2` (FIA v2) and the same three variants: the same MLA path
  under v2's argument names (§1.3), with the layouts BSND_NBSD and TND_NTD as well (output
  [N, B, S, D] and [N, T, D]; the LSE keeps the input layout, §15.2).
- Both take the paged latent and rope caches ND or NZ ([blocks, 1, D/16, 128, 16], §11.4; not with
  BNSD layouts, block size 128 only).
- `npu_attention_update`: the LSE merge of §8; with update_type 0 its second output is NaN (the op
  leaves it undefined, §8.2).
- `npu_scatter_pa_kv_cache`: writes each token's key and value into its slot of a paged cache,
  ND ('Norm') or NZ ('PA_NZ'), 3-D keys only (§17). It raises on what the op's contract and the
  kernels of the emulated SoC and CANN (`$DCP_COMPILE_NPU_EMULATOR_SOC`, `_CANN`) do not take where
  a kernel would not check: a negative slot, an int64 slot_mapping for the 2025 A2/A3 ND kernel
  (it reads int32), more tokens than the cache has slots (the A2/A3 tiling); a slot several tokens
  write gets NaN (the op's result is undefined there).

The meta functions give shapes and dtypes only. The limits above (head dims, layouts with MLA, 16
queries a request, block sizes, slot dtype and range, NZ) are readings of the op docs and of
CANN's kernel sources, not of the wheel: §21.3 says which.

Kernel behaviours that callers rely on and that the stand-ins reproduce:
- softmax_lse is the natural-log logsumexp of the scaled scores, fp32 (§2.3; fp32: §2.2).
- A request with actual_seq_lengths_kv == 0 gets attention_out 0 and softmax_lse +inf (inferred
  for CANN >= 8.5's MLA kernel, §7.2), and npu_attention_update reads an lse of +inf as -inf (§7.3).
- A row whose every lse is -inf merges to NaN, as the kernel's arithmetic gives (§7.4).
- A strided key, value or key_rope is copied whole before the kernel (AutoContiguous, §11.1):
  the stand-in counts those copies in `contiguous_copies`.

Planted deviations (`DCP_COMPILE_STANDIN_PLANT=NAME`, read at every call, so spawned ranks see it
too) make a stand-in depart from one fact on purpose: the tests of what relies on that fact, and
bench/npu_facts.py's own check that it reports a deviation, use them. See PLANTS.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import dataclasses
from dataclasses import dataclass, fields
from typing import Sequence

import torch

from dcp_compile.testing.npu_emulator import releases

_library: torch.library.Library | None = None

PLANT_ENV = "DCP_COMPILE_STANDIN_PLANT"
PLANTS = {
    "empty-shard-lse": "FIA gives an lse of -inf (not +inf) for a request with no key",
    "empty-shard-garbage": "FIA gives garbage for a request with no key: NaN out and a finite lse of 30",
    "nz-off-by-one": "FIA reads an NZ cache's slot s + 1 for slot s (an off-by-one in the NZ index)",
}
"""Deviations a stand-in can be made to show, by name."""


def planted() -> str | None:
    """The deviation switched on (PLANT_ENV), if any."""
    name = os.environ.get(PLANT_ENV) or None
    if name is not None and name not in PLANTS:
        raise ValueError(f"{PLANT_ENV}={name!r}: no such deviation; choose one of {sorted(PLANTS)}")
    return name


def register() -> bool:
    """Define the stand-in `torch.ops.npu` ops once; True when they are (or already were) defined.

    Returns False, registering nothing, when torch_npu is installed: its ops are the real ones.
    torch_npu is not imported here, so that merely checking never initialises an NPU runtime.
    The schemas are those of the torch_npu release `$DCP_COMPILE_NPU_EMULATOR_TORCH_NPU` names
    (npu_emulator/releases: read from its wheel), and every call, traced or run, is checked
    against that release's meta function (`release().check`). The kernels are registered for the
    npu device only (PrivateUse1), as torch_npu's are: they run on the emulated device
    (dcp_compile/testing/npu_emulator), and a call with tensors of another device fails as it
    would with torch_npu.
    """
    global _library
    if importlib.util.find_spec("torch_npu") is not None:
        return False
    if _library is None:
        chosen = releases.selected()
        check_argument_names(chosen)
        _library = _define_ops(chosen)
        releases.activate(chosen)
    return True


def is_standin() -> bool:
    """Whether `torch.ops.npu` holds this module's stand-ins rather than torch_npu's ops."""
    return _library is not None


def release() -> releases.Release:
    """The torch_npu release the stand-ins stand in for: the one registered, else the one selected."""
    return releases.active()


def _kernels() -> dict:
    """Op (as a release snapshot names it) -> (npu kernel, fake kernel)."""
    return {
        "npu_fused_infer_attention_score": (_fia_kernel, _fia_fake),
        "npu_fused_infer_attention_score.out": (_fia_out_kernel, _fia_out_fake),
        "_npu_fused_infer_attention_score_get_max_workspace": (_fia_workspace, _fia_workspace),
        "_npu_fused_infer_attention_score_infer_output": (_fia_infer_output, _fia_infer_output),
        "npu_fused_infer_attention_score_v2": (_fia_v2_kernel, _fia_v2_fake),
        "npu_fused_infer_attention_score_v2.out": (_fia_v2_out_kernel, _fia_v2_out_fake),
        "_npu_fused_infer_attention_score_v2_get_max_workspace": (_fia_v2_workspace, _fia_v2_workspace),
        "_npu_fused_infer_attention_score_v2_infer_output": (_fia_v2_infer_output, _fia_v2_infer_output),
        "npu_attention_update": (_attention_update_kernel, _attention_update_fake),
        "npu_scatter_pa_kv_cache": (_scatter_pa_kv_cache_kernel, _scatter_pa_kv_cache_fake),
    }


def _define_ops(chosen: releases.Release) -> torch.library.Library:
    kernels = _kernels()
    missing = sorted(set(chosen.schemas) - set(kernels))
    if missing:
        raise NotImplementedError(f"{chosen} registers {missing}, which the stand-ins do not implement")
    library = torch.library.Library("npu", "DEF")
    for name, schema in chosen.schemas.items():
        kernel, fake_kernel = kernels[name]
        library.define(schema)
        library.impl(name, _checked(name, kernel), "PrivateUse1")
        # register_fake also installs the Meta kernel.
        torch.library.register_fake(f"npu::{name}", _checked(name, fake_kernel), lib=library)
    return library


def _checked(name: str, kernel):
    """The kernel, then the release's check of the call: its arguments bound to the release's
    schema, its outputs against the release's meta function (ReleaseMismatch otherwise)."""

    def run(*args, **kwargs):
        outputs = kernel(*args, **kwargs)
        release().check(name, args, kwargs, outputs)
        return outputs

    run.__name__ = getattr(kernel, "__name__", name)
    return run


def check_argument_names(chosen: releases.Release) -> None:
    """Every FIA argument the stand-ins read by name is an argument of the release's schema (a
    stand-in reading a name the release does not have would silently see its default)."""
    v1 = {a.name for a in chosen.schema("npu_fused_infer_attention_score").arguments}
    read_v1 = _FIA_ARG_NAMES | set(_MLA_UNSUPPORTED_ARGUMENTS)
    wrong = {"npu_fused_infer_attention_score": sorted(read_v1 - v1)}
    if "npu_fused_infer_attention_score_v2" in chosen.schemas:
        v2 = {a.name for a in chosen.schema("npu_fused_infer_attention_score_v2").arguments}
        kept = _FIA_ARG_NAMES - set(V2_RENAMES.values())
        read_v2 = set(V2_RENAMES) | kept | set(_V2_MLA_UNSUPPORTED) | set(_V2_QUANT_MODES)
        wrong["npu_fused_infer_attention_score_v2"] = sorted(read_v2 - v2)
    wrong = {op: names for op, names in wrong.items() if names}
    if wrong:
        raise releases.ReleaseMismatch(f"the FIA stand-ins read arguments {chosen} does not have: {wrong}")


# ---------------------------------------------------------------------------------------------
# npu_fused_infer_attention_score: arguments and validation
# ---------------------------------------------------------------------------------------------

MLA_ROPE_DIM = 64
MLA_LATENT_DIM = 512
MLA_QUERY_HEAD_DIMS = (MLA_LATENT_DIM, 128)
MLA_HEAD_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128)
MLA_MAX_QUERIES_PER_REQUEST = 16
MLA_LAYOUTS = ("BSH", "BSND", "BNSD", "BNSD_NBSD", "BSND_NBSD", "BSH_NBSD", "TND", "TND_NTD")
IMPLEMENTED_LAYOUTS = ("BSND", "BNSD", "TND", "BSND_NBSD", "TND_NTD")
NZ_FORBIDDEN_LAYOUTS = ("BNSD", "BNSD_NBSD")  # docs/ascend.md §11.4
# The NZ layout is restated here rather than taken from ops/nz.py: FIA's read of it is a
# model of its own, so that an NZ index the project's writers get wrong fails the comparisons.
NZ_BLOCK_SIZE = 128  # docs/ascend.md §11.4: "16 or 128, not 16 with NZ"
NZ_GROUP = 16
MLA_SPARSE_MODES = (0, 3, 4)
MAX_BLOCK_SIZE = 1024
BLOCK_SIZE_ALIGNMENT = 16
COMPRESSED_MASK_SIDE = 2048
MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)
ATTENTION_DTYPES = (torch.float16, torch.bfloat16)
DEFAULT_PRE_NEXT_TOKENS = 2147483647

# §4.7: not supported with MLA. Each is a Tensor? (or SymInt[]?) defaulting to None.
_MLA_UNSUPPORTED_ARGUMENTS = (
    "pse_shift", "dequant_scale1", "quant_scale1", "dequant_scale2", "quant_scale2",
    "quant_offset2", "antiquant_scale", "antiquant_offset", "key_antiquant_scale",
    "key_antiquant_offset", "value_antiquant_scale", "value_antiquant_offset",
    "query_padding_size", "kv_padding_size", "key_shared_prefix", "value_shared_prefix",
    "actual_shared_prefix_len", "key_rope_antiquant_scale",
)


@dataclass(frozen=True)
class FiaArgs:
    """The FIA arguments the MLA path reads; defaults are the schema's.

    The dispatcher drops keyword arguments equal to their default, so each kernel rebuilds them.
    The antiquant modes are not kept: they only qualify antiquant tensors, which MLA rejects.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    query_rope: torch.Tensor | None = None
    key_rope: torch.Tensor | None = None
    atten_mask: torch.Tensor | None = None
    actual_seq_lengths: Sequence[int] | None = None
    actual_seq_lengths_kv: Sequence[int] | None = None
    block_table: torch.Tensor | None = None
    num_heads: int = 1
    scale: float = 1.0
    pre_tokens: int = DEFAULT_PRE_NEXT_TOKENS
    next_tokens: int = DEFAULT_PRE_NEXT_TOKENS
    input_layout: str = "BSH"
    num_key_value_heads: int = 0
    sparse_mode: int = 0
    inner_precise: int = 0
    block_size: int = 0
    softmax_lse_flag: bool = False


_FIA_ARG_NAMES = frozenset(field.name for field in fields(FiaArgs))


@dataclass(frozen=True)
class FiaPlan:
    """What validation derived from the arguments: the per-request work and the output shapes."""

    query_counts: list[int]
    kv_lens: list[int]
    attention_out_shape: tuple[int, ...]
    softmax_lse_shape: tuple[int, ...]


V2_RENAMES = {"actual_seq_qlen": "actual_seq_lengths", "actual_seq_kvlen": "actual_seq_lengths_kv",
              "num_query_heads": "num_heads", "softmax_scale": "scale", "return_softmax_lse": "softmax_lse_flag"}
"""FIA v2 argument -> the v1 name FiaArgs keeps it under (docs/ascend.md §1.3)."""
_V2_MLA_UNSUPPORTED = (
    "pse_shift", "dequant_scale_query", "dequant_scale_key", "dequant_offset_key", "dequant_scale_value",
    "dequant_offset_value", "dequant_scale_key_rope", "quant_scale_out", "quant_offset_out", "quant_scale_p",
    "learnable_sink", "query_dtype", "key_dtype", "value_dtype", "query_rope_dtype", "key_rope_dtype",
    "key_shared_prefix_dtype", "value_shared_prefix_dtype", "dequant_scale_query_dtype", "dequant_scale_key_dtype",
    "dequant_scale_value_dtype", "dequant_scale_key_rope_dtype", "out_dtype",
)
_V2_QUANT_MODES = ("query_quant_mode", "key_quant_mode", "value_quant_mode")


def bind_fia_v2_args(query, key, value, keyword_args: dict) -> FiaArgs:
    """FIA v2's arguments as FiaArgs: the renamed ones under their v1 names, the rest refused as
    MLA without quantisation refuses them."""
    given = [name for name in _V2_MLA_UNSUPPORTED if keyword_args.get(name) is not None]
    given += [name for name in _V2_QUANT_MODES if keyword_args.get(name, 0) != 0]
    if given:
        raise ValueError(f"{', '.join(given)} given, but the MLA FIA stand-in takes no pse, sink, quantisation or "
                         "dtype overrides")
    kept = {V2_RENAMES.get(name, name): argument for name, argument in keyword_args.items()
            if V2_RENAMES.get(name, name) in _FIA_ARG_NAMES}
    return FiaArgs(query, key, value, **kept)


def bind_fia_args(query, key, value, keyword_args: dict) -> FiaArgs:
    given_unsupported = [
        name for name in _MLA_UNSUPPORTED_ARGUMENTS if keyword_args.get(name) is not None
    ]
    if given_unsupported:
        raise ValueError(
            f"{', '.join(given_unsupported)} given, but MLA FIA supports no pse, quantisation, "
            "padding sizes or shared prefix"
        )
    kept = {name: argument for name, argument in keyword_args.items() if name in _FIA_ARG_NAMES}
    return FiaArgs(query, key, value, **kept)


def validate_fia(args: FiaArgs) -> FiaPlan:
    """Check every documented limit that shapes, dtypes and host lists show; no tensor data is read.

    Shared by the CPU and fake kernels, so that bad calls fail at trace time too.
    """
    _check_dtypes(args)
    _check_contiguous_query(args)
    _check_mla_head_dims(args)
    _check_layout(args)
    _check_num_heads(args)
    query_counts = _query_counts(args)
    _check_paged_cache(args, batch=len(query_counts))
    kv_lens = _kv_lens(args, batch=len(query_counts))
    _check_sparse_mode(args, query_counts, kv_lens)
    _check_other_options(args)
    return FiaPlan(
        query_counts=query_counts,
        kv_lens=kv_lens,
        attention_out_shape=_attention_out_shape(args),
        softmax_lse_shape=_softmax_lse_shape(args),
    )


def _check_dtypes(args: FiaArgs) -> None:
    # §4.6: fp16/bf16 query; MLA without quantisation needs one dtype for q/k/v and the ropes.
    if args.query.dtype not in ATTENTION_DTYPES:
        raise ValueError(f"query dtype {args.query.dtype} is not supported; allowed: float16, bfloat16")
    for name in ("key", "value", "query_rope", "key_rope"):
        tensor = getattr(args, name)
        if tensor is not None and tensor.dtype != args.query.dtype:
            raise ValueError(
                f"{name} dtype {tensor.dtype} differs from query dtype {args.query.dtype}; "
                "MLA needs one dtype for query, key, value, query_rope and key_rope"
            )


def _check_contiguous_query(args: FiaArgs) -> None:
    # torch_npu's API reference for FIA: the query "不支持非连续的Tensor" (no non-contiguous
    # tensor). Key and value views of a paged cache are not documented either way.
    for name in ("query", "query_rope"):
        tensor = getattr(args, name)
        if tensor is not None and not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous (FIA does not take a non-contiguous query)")


def _check_mla_head_dims(args: FiaArgs) -> None:
    # §4.1
    if (args.query_rope is None) != (args.key_rope is None):
        given, missing = ("query_rope", "key_rope") if args.key_rope is None else ("key_rope", "query_rope")
        raise ValueError(f"{given} given without {missing}; pass both (MLA) or neither")
    if args.query_rope is None:
        raise NotImplementedError("the FIA stand-in implements MLA only: pass query_rope and key_rope")
    head_dim = args.query.shape[-1]
    if head_dim not in MLA_QUERY_HEAD_DIMS:
        raise ValueError(f"query head dim is {head_dim}; MLA allows {MLA_QUERY_HEAD_DIMS}")
    for name in ("query_rope", "key_rope"):
        rope_dim = _cache_width(getattr(args, name)) if name == "key_rope" else args.query_rope.shape[-1]
        if rope_dim != MLA_ROPE_DIM:
            raise ValueError(f"{name} last dim is {rope_dim}; MLA requires {MLA_ROPE_DIM}")
    if args.num_key_value_heads != 1:
        raise ValueError(f"num_key_value_heads is {args.num_key_value_heads}; MLA requires 1")


def input_half(layout: str) -> str:
    """The query's layout of an input_layout ("BSND" of "BSND_NBSD"); the output's is the other half."""
    return layout.split("_")[0]


def output_half(layout: str) -> str:
    return layout.split("_")[-1]


def _attention_out_shape(args: FiaArgs) -> tuple[int, ...]:
    """§2.1: the query's shape with the value's D, laid out as the output half says (NBSD: [N, B, S, D];
    NTD: [N, T, D])."""
    value_dim = _cache_width(args.value)
    shape = (*args.query.shape[:-1], value_dim)
    out = output_half(args.input_layout)
    if out == "NBSD":
        batch, query_len, heads = (shape[axis] for axis in _BATCH_QUERY_HEAD_AXES[input_half(args.input_layout)])
        return (heads, batch, query_len, value_dim)
    if out == "NTD":
        return (shape[1], shape[0], value_dim)
    return shape


def _cache_width(cache: torch.Tensor) -> int:
    """D of a paged cache view: [.., D], or NZ's [blocks, KV_N, D/16, block_size, 16]."""
    return cache.shape[2] * cache.shape[4] if cache.dim() == 5 else cache.shape[-1]


def _check_layout(args: FiaArgs) -> None:
    # §3.1, §3.2
    layout = args.input_layout
    if layout not in MLA_LAYOUTS:
        raise ValueError(f"input_layout {layout!r} is not allowed with MLA; allowed: {MLA_LAYOUTS}")
    if layout not in IMPLEMENTED_LAYOUTS:
        raise NotImplementedError(
            f"input_layout {layout!r} is valid for MLA but the stand-in implements {IMPLEMENTED_LAYOUTS}"
        )
    expected_rank = 3 if input_half(layout) == "TND" else 4
    if args.query.dim() != expected_rank:
        raise ValueError(
            f"query must be {expected_rank}-D for input_layout {layout!r}, "
            f"got shape {tuple(args.query.shape)}"
        )
    if args.query_rope.shape[:-1] != args.query.shape[:-1]:
        raise ValueError(
            f"query_rope shape {tuple(args.query_rope.shape)} must match query shape "
            f"{tuple(args.query.shape)} except the last dim"
        )


# (batch, query_len, heads) axes of the 4-D layouts; TND's heads are axis 1.
_BATCH_QUERY_HEAD_AXES = {"BSND": (0, 1, 2), "BNSD": (0, 2, 1)}


def _head_axis(layout: str) -> int:
    layout = input_half(layout)
    return 1 if layout == "TND" else _BATCH_QUERY_HEAD_AXES[layout][2]


def _check_num_heads(args: FiaArgs) -> None:
    # §4.2: the gathered DCP head count must be one of these too.
    if args.num_heads not in MLA_HEAD_COUNTS:
        raise ValueError(f"num_heads is {args.num_heads}; MLA allows {MLA_HEAD_COUNTS}")
    query_heads = args.query.shape[_head_axis(args.input_layout)]
    if args.num_heads != query_heads:
        raise ValueError(
            f"num_heads is {args.num_heads} but the {args.input_layout} query has {query_heads} heads"
        )


def _query_counts(args: FiaArgs) -> list[int]:
    """Queries per request: the S dim for BSND/BNSD, differences of the cumulative list for TND."""
    if input_half(args.input_layout) == "TND":
        counts = _tnd_query_counts(args.actual_seq_lengths, total_tokens=args.query.shape[0])
    else:
        batch_axis, query_axis, _ = _BATCH_QUERY_HEAD_AXES[input_half(args.input_layout)]
        batch, query_len = args.query.shape[batch_axis], args.query.shape[query_axis]
        counts = [query_len] * batch
        _check_no_query_padding(args.actual_seq_lengths, query_len, batch)
    if args.query.shape[-1] == MLA_LATENT_DIM:
        too_many = [count for count in counts if count > MLA_MAX_QUERIES_PER_REQUEST]
        if too_many:
            raise ValueError(
                f"a request has {max(too_many)} query tokens; MLA with D=512 allows at most "
                f"{MLA_MAX_QUERIES_PER_REQUEST}"
            )
    return counts


def _tnd_query_counts(actual_seq_lengths, total_tokens: int) -> list[int]:
    # §5.3: cumulative for TND.
    if actual_seq_lengths is None:
        raise ValueError("input_layout TND requires actual_seq_lengths (cumulative query counts)")
    cumulative = list(actual_seq_lengths)
    if not cumulative:
        raise ValueError("actual_seq_lengths is empty; TND needs one cumulative count per request")
    counts = [cumulative[0]] + [end - start for start, end in zip(cumulative, cumulative[1:])]
    if any(count < 0 for count in counts):
        raise ValueError(f"actual_seq_lengths {cumulative} must be non-negative and non-decreasing")
    if cumulative[-1] != total_tokens:
        raise ValueError(
            f"actual_seq_lengths ends at {cumulative[-1]} but the TND query has T = {total_tokens} tokens"
        )
    return counts


def _check_no_query_padding(actual_seq_lengths, query_len: int, batch: int) -> None:
    # §5.3: ignored when S == 1; for S > 1 a shorter length means padded queries.
    if actual_seq_lengths is None or query_len == 1:
        return
    used = _per_request(actual_seq_lengths, batch, "actual_seq_lengths")
    if any(length != query_len for length in used):
        raise NotImplementedError(
            f"actual_seq_lengths {list(actual_seq_lengths)} pads queries below S = {query_len}; "
            "the stand-in implements unpadded BSND/BNSD queries only"
        )


def _per_request(lengths, batch: int, name: str) -> list[int]:
    """§5.3: one length per request, or a single length broadcast; extra entries are unused."""
    lengths = list(lengths)
    if len(lengths) == 1:
        return lengths * batch
    if len(lengths) < batch:
        raise ValueError(f"{name} has {len(lengths)} entries for {batch} requests; give >= {batch} or 1")
    return lengths[:batch]


def _check_paged_cache(args: FiaArgs, batch: int) -> None:
    # §4.5, §5.1: PageAttention is mandatory for MLA D=512.
    block_table = args.block_table
    if block_table is None:
        if args.query.shape[-1] == MLA_LATENT_DIM:
            raise ValueError("block_table is required: PageAttention is mandatory for MLA with D=512")
        raise NotImplementedError("the stand-in implements paged (block_table) KV only")
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise ValueError(
            f"block_table must be a 2-D int32 tensor, got {block_table.dim()}-D {block_table.dtype}"
        )
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table has {block_table.shape[0]} rows for {batch} requests")
    block_size = args.block_size
    if not 0 < block_size <= MAX_BLOCK_SIZE or block_size % BLOCK_SIZE_ALIGNMENT:
        raise ValueError(
            f"block_size is {block_size}; MLA needs a positive multiple of {BLOCK_SIZE_ALIGNMENT} "
            f"<= {MAX_BLOCK_SIZE}"
        )
    head_dim = args.query.shape[-1]
    _check_cache_view("key", args.key, block_size, head_dim)
    _check_cache_view("key_rope", args.key_rope, block_size, MLA_ROPE_DIM)
    if (args.key.dim() == 5) != (args.key_rope.dim() == 5):
        raise ValueError("key and key_rope must share one format (both ND or both NZ): key_rope takes key's format")
    if args.key.dim() == 5:
        if args.input_layout in NZ_FORBIDDEN_LAYOUTS:
            raise ValueError(f"input_layout {args.input_layout!r} is not allowed with an NZ KV cache; NZ excludes "
                             f"{NZ_FORBIDDEN_LAYOUTS}")
        if block_size != NZ_BLOCK_SIZE:
            raise ValueError(f"block_size is {block_size}; an NZ KV cache takes {NZ_BLOCK_SIZE} only")
    if args.value.shape != args.key.shape:
        raise ValueError(
            f"value shape {tuple(args.value.shape)} differs from key shape {tuple(args.key.shape)}; "
            "in MLA both are the latent cache"
        )
    if args.key_rope.shape[0] != args.key.shape[0]:
        raise ValueError(
            f"key_rope has {args.key_rope.shape[0]} blocks but key has {args.key.shape[0]}"
        )


def _check_cache_view(name: str, cache: torch.Tensor, block_size: int, head_dim: int) -> None:
    # §11.3: [num_blocks, block_size, D] or [num_blocks, KV_N=1, block_size, D]; §11.4: NZ
    # [num_blocks, KV_N=1, D/16, block_size, 16].
    shape = tuple(cache.shape)
    valid = (cache.dim() == 3 and shape[1:] == (block_size, head_dim)) or (
        cache.dim() == 4 and shape[1:] == (1, block_size, head_dim)
    ) or (cache.dim() == 5 and head_dim % NZ_GROUP == 0 and shape[1:] == (1, head_dim // NZ_GROUP, block_size, NZ_GROUP))
    if not valid:
        raise ValueError(
            f"{name} shape {shape} must be [num_blocks, {block_size}, {head_dim}], "
            f"[num_blocks, 1, {block_size}, {head_dim}] or NZ [num_blocks, 1, {head_dim // NZ_GROUP}, {block_size}, "
            f"{NZ_GROUP}] (block_size {block_size})"
        )


def _kv_lens(args: FiaArgs, batch: int) -> list[int]:
    # §5.1, §5.3: per request, never cumulative (also TND with D=512 and PageAttention).
    if args.actual_seq_lengths_kv is None:
        raise ValueError("actual_seq_lengths_kv is required with a block_table (PageAttention)")
    kv_lens = _per_request(args.actual_seq_lengths_kv, batch, "actual_seq_lengths_kv")
    capacity = args.block_table.shape[1] * args.block_size
    for kv_len in kv_lens:
        if not 0 <= kv_len <= capacity:
            raise ValueError(
                f"actual_seq_lengths_kv value {kv_len} is outside [0, {capacity}] "
                f"(block_table width {args.block_table.shape[1]} x block_size {args.block_size})"
            )
    return kv_lens


def _check_sparse_mode(args: FiaArgs, query_counts: list[int], kv_lens: list[int]) -> None:
    # §4.4, §6.1-§6.3
    mode = args.sparse_mode
    if mode not in MLA_SPARSE_MODES:
        raise ValueError(f"sparse_mode is {mode}; MLA allows {MLA_SPARSE_MODES}")
    if mode == 4:
        raise NotImplementedError("sparse_mode 4 (band) is not implemented by the stand-in")
    mask = args.atten_mask
    if mask is not None and mask.dtype not in MASK_DTYPES:
        raise ValueError(f"atten_mask dtype {mask.dtype} is not supported; allowed: bool, int8, uint8")
    if mode == 3:
        _check_compressed_causal_mask(mask)
    elif mask is not None:
        _check_full_mask(args, query_counts, kv_lens)


def _check_compressed_causal_mask(mask: torch.Tensor | None) -> None:
    side = COMPRESSED_MASK_SIDE
    allowed = ((side, side), (1, side, side), (1, 1, side, side))
    if mask is None or tuple(mask.shape) not in allowed:
        got = None if mask is None else tuple(mask.shape)
        raise ValueError(f"sparse_mode 3 needs the compressed atten_mask of shape {allowed}, got {got}")


def _check_full_mask(args: FiaArgs, query_counts: list[int], kv_lens: list[int]) -> None:
    if input_half(args.input_layout) == "TND":
        raise NotImplementedError("an atten_mask with input_layout TND is not implemented by the stand-in")
    shape = tuple(args.atten_mask.shape)
    batch, query_len = len(query_counts), query_counts[0] if query_counts else 0
    mask_width = shape[-1]
    allowed_leading = {(batch, 1, query_len), (1, query_len), (1, 1, query_len)}
    # CANN rejects a zero-width mask, even when every request is empty (§6.3).
    longest_kv = max(kv_lens, default=0)
    if shape[:-1] not in allowed_leading or mask_width < max(1, longest_kv):
        raise ValueError(
            f"atten_mask shape {shape} must be (B, 1, S, KV_S), (1, S, KV_S) or (1, 1, S, KV_S) "
            f"with B = {batch}, S = {query_len} and KV_S >= max(1, longest kv length {longest_kv})"
        )


def _check_other_options(args: FiaArgs) -> None:
    if args.inner_precise not in (0, 1):
        raise ValueError(f"inner_precise is {args.inner_precise}; MLA allows 0 or 1")
    # §6.2 documents pre_tokens/next_tokens as ignored in modes 1-3 only.
    windowed = args.pre_tokens != DEFAULT_PRE_NEXT_TOKENS or args.next_tokens != DEFAULT_PRE_NEXT_TOKENS
    if args.sparse_mode == 0 and windowed:
        raise NotImplementedError("pre_tokens/next_tokens windows are not implemented by the stand-in")


def _softmax_lse_shape(args: FiaArgs) -> tuple[int, ...]:
    # §2.2: (B, N, S, 1) or (T, N, 1) with the flag; the meta kernel's [0] without it.
    if not args.softmax_lse_flag:
        return (0,)
    # The LSE keeps the input half's layout whatever the output's (docs/ascend.md §15.2).
    query_shape = tuple(args.query.shape)
    layout = input_half(args.input_layout)
    if layout == "TND":
        return (*query_shape[:2], 1)
    batch, query_len, heads = (query_shape[axis] for axis in _BATCH_QUERY_HEAD_AXES[layout])
    return (batch, heads, query_len, 1)


# ---------------------------------------------------------------------------------------------
# npu_fused_infer_attention_score: kernels
# ---------------------------------------------------------------------------------------------


AUTO_CONTIGUOUS = ("key", "value", "key_rope")
"""FIA inputs the op definition marks AutoContiguous (docs/ascend.md §11.1) that the stand-in
takes strided: the framework copies them whole before the kernel runs."""
contiguous_copies: list[tuple[str, int]] = []
"""(argument, bytes) of every copy that framework step would make, in call order: read it to
see what a lowering's FIA calls cost in copies; clear it at will."""


def _fia_kernel(query, key, value, **keyword_args):
    return _run_fia(bind_fia_args(query, key, value, keyword_args))


def _fia_v2_kernel(query, key, value, **keyword_args):
    return _run_fia(bind_fia_v2_args(query, key, value, keyword_args))


def _run_fia(args: FiaArgs):
    plan = validate_fia(args)
    for name in AUTO_CONTIGUOUS:
        tensor = getattr(args, name)
        if tensor is not None and not tensor.is_contiguous():
            contiguous_copies.append((name, tensor.numel() * tensor.element_size()))
    return _compute_fia(args, plan)


_HOST_LIST_ARGUMENTS = ("actual_seq_lengths", "actual_seq_lengths_kv")


def _fia_fake(query, key, value, **keyword_args):
    return _fake_outputs(query, _hinted(bind_fia_args(query, key, value, keyword_args)))


def _fia_v2_fake(query, key, value, **keyword_args):
    return _fake_outputs(query, _hinted(bind_fia_v2_args(query, key, value, keyword_args)))


def _fake_outputs(query, args: FiaArgs):
    plan = validate_fia(args)
    return (
        query.new_empty(plan.attention_out_shape),
        query.new_empty(plan.softmax_lse_shape, dtype=torch.float32),
    )


def _hinted(args: FiaArgs) -> FiaArgs:
    """Host lengths traced as SymInts (graph inputs an NPU graph refreshes) are checked at their
    example values: comparing the SymInts themselves would add guards that specialise them."""
    hinted = {name: [v.node.hint if isinstance(v, torch.SymInt) else v for v in getattr(args, name)]
              for name in _HOST_LIST_ARGUMENTS if getattr(args, name) is not None}
    return dataclasses.replace(args, **hinted)


def _out_pair(out) -> tuple[torch.Tensor, torch.Tensor]:
    if len(out) != 2:
        raise ValueError(f"out must be [attention_out, softmax_lse] (2 tensors), got {len(out)}")
    return out[0], out[1]


def _fia_out_kernel(query, key, value, *, out, workspace=None, **keyword_args):
    return _run_fia_out(bind_fia_args(query, key, value, keyword_args), *_out_pair(out))


def _fia_v2_out_kernel(query, key, value, *, out, workspace=None, **keyword_args):
    return _run_fia_out(bind_fia_v2_args(query, key, value, keyword_args), *_out_pair(out))


def _run_fia_out(args: FiaArgs, attention_out, softmax_lse):
    plan = validate_fia(args)
    _check_out_buffers(args, plan, attention_out, softmax_lse)
    computed_out, computed_lse = _compute_fia(args, plan)
    attention_out.copy_(computed_out)
    if args.softmax_lse_flag:
        softmax_lse.copy_(computed_lse)
    else:
        softmax_lse.zero_()
    return attention_out, softmax_lse


def _fia_out_fake(query, key, value, *, out, workspace=None, **keyword_args):
    attention_out, softmax_lse = _out_pair(out)
    args = _hinted(bind_fia_args(query, key, value, keyword_args))
    _check_out_buffers(args, validate_fia(args), attention_out, softmax_lse)
    return attention_out, softmax_lse


def _fia_v2_out_fake(query, key, value, *, out, workspace=None, **keyword_args):
    attention_out, softmax_lse = _out_pair(out)
    args = _hinted(bind_fia_v2_args(query, key, value, keyword_args))
    _check_out_buffers(args, validate_fia(args), attention_out, softmax_lse)
    return attention_out, softmax_lse


def _check_out_buffers(args: FiaArgs, plan: FiaPlan, attention_out, softmax_lse) -> None:
    if tuple(attention_out.shape) != plan.attention_out_shape or attention_out.dtype != args.query.dtype:
        raise ValueError(
            f"attention_out is {tuple(attention_out.shape)} {attention_out.dtype}; expected "
            f"{plan.attention_out_shape} {args.query.dtype}"
        )
    # §2.2: without the flag the docs say [1] and the meta kernel gives [0]; accept both.
    allowed_lse_shapes = [plan.softmax_lse_shape] if args.softmax_lse_flag else [(0,), (1,)]
    if tuple(softmax_lse.shape) not in allowed_lse_shapes or softmax_lse.dtype != torch.float32:
        raise ValueError(
            f"softmax_lse is {tuple(softmax_lse.shape)} {softmax_lse.dtype}; expected float32 of "
            f"shape {' or '.join(map(str, allowed_lse_shapes))}"
        )


def _fia_workspace(query, key, value, **keyword_args):
    """The real op returns a workspace of the maximal size for capture; no stand-in kernel needs one.

    Zeroed rather than empty so that the result is deterministic.
    """
    validate_fia(_hinted(bind_fia_args(query, key, value, keyword_args)))
    return torch.zeros(1, dtype=torch.uint8, device=query.device)


def _fia_v2_workspace(query, key, value, **keyword_args):
    validate_fia(_hinted(bind_fia_v2_args(query, key, value, keyword_args)))
    return torch.zeros(1, dtype=torch.uint8, device=query.device)


def _fia_infer_output(query, value, **keyword_args):
    """Both outputs, allocated (torch_npu's NPU-graph handler hands them to `.out` at capture): of
    the shapes and dtypes the release's meta function of FIA gives for these arguments (the
    kernel's own `_infer_output` is C++, not in the wheel's Python)."""
    return _allocated(release().meta("_npu_fused_infer_attention_score_infer_output", (query, value), keyword_args),
                      query)


def _fia_v2_infer_output(query, value, **keyword_args):
    return _allocated(release().meta("_npu_fused_infer_attention_score_v2_infer_output", (query, value),
                                     keyword_args), query)


def _allocated(metas, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(like.new_empty(meta.shape, dtype=meta.dtype) for meta in metas)


def _compute_fia(args: FiaArgs, plan: FiaPlan) -> tuple[torch.Tensor, torch.Tensor]:
    layout = input_half(args.input_layout)
    query = _token_major(args.query, layout).float()
    query_rope = _token_major(args.query_rope, layout).float()
    latent_cache, rope_cache, value_cache = (
        _flat_blocks(cache) for cache in (args.key, args.key_rope, args.value)
    )
    # A request with kv_len 0 keeps these: out 0 and lse +inf (inferred for CANN >= 8.5's MLA kernel, §7.2).
    out = query.new_zeros(*query.shape[:2], value_cache.shape[-1])
    lse = query.new_full(query.shape[:2], math.inf)
    first_query = 0
    for request, (query_count, kv_len) in enumerate(zip(plan.query_counts, plan.kv_lens)):
        queries = slice(first_query, first_query + query_count)
        first_query += query_count
        if kv_len == 0:
            continue
        rows = _cache_rows(args.block_table[request], kv_len, args.block_size)
        out[queries], lse[queries] = _attend_request(
            query[queries],
            query_rope[queries],
            latent_cache[rows].float(),
            rope_cache[rows].float(),
            value_cache[rows].float(),
            _visible_keys(args, request, query_count, kv_len).to(query.device),
            args.scale,
        )
    _plant_empty_requests(out, lse, plan)
    attention_out = _from_token_major(out, args.input_layout, args.query.shape)
    return attention_out.to(args.query.dtype), _lse_output(lse, plan, args)


def _plant_empty_requests(out: torch.Tensor, lse: torch.Tensor, plan: "FiaPlan") -> None:
    plant = planted()
    if plant not in ("empty-shard-lse", "empty-shard-garbage"):
        return
    first_query = 0
    for query_count, kv_len in zip(plan.query_counts, plan.kv_lens):
        queries = slice(first_query, first_query + query_count)
        first_query += query_count
        if kv_len == 0 and plant == "empty-shard-lse":
            lse[queries] = -math.inf
        elif kv_len == 0:
            out[queries], lse[queries] = math.nan, 30.0


def _token_major(tensor: torch.Tensor, layout: str) -> torch.Tensor:
    """[T, N, D] with the queries of each request contiguous, in request order."""
    if layout == "BNSD":
        tensor = tensor.transpose(1, 2)
    return tensor.reshape(-1, *tensor.shape[-2:])


def _from_token_major(tensor: torch.Tensor, input_layout: str, query_shape) -> torch.Tensor:
    layout, out = input_half(input_layout), output_half(input_layout)
    if out == "NTD":
        return tensor.transpose(0, 1).contiguous()
    if out == "NBSD":
        batch, query_len, heads = (query_shape[axis] for axis in _BATCH_QUERY_HEAD_AXES[layout])
        return tensor.reshape(batch, query_len, heads, tensor.shape[-1]).permute(2, 0, 1, 3).contiguous()
    if layout == "TND":
        return tensor
    if layout == "BSND":
        return tensor.reshape(*query_shape[:3], tensor.shape[-1])
    batch, heads, query_len = query_shape[:3]
    return tensor.reshape(batch, query_len, heads, tensor.shape[-1]).transpose(1, 2).contiguous()


def _lse_output(lse: torch.Tensor, plan: FiaPlan, args: FiaArgs) -> torch.Tensor:
    if not args.softmax_lse_flag:
        return lse.new_empty(plan.softmax_lse_shape)
    if input_half(args.input_layout) == "TND":
        return lse.unsqueeze(-1)
    batch, heads, query_len, _ = plan.softmax_lse_shape
    return lse.reshape(batch, query_len, heads).transpose(1, 2).unsqueeze(-1).contiguous()


def _flat_blocks(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks * block_size, D] from any paged view: NZ's channel d of slot s of block b is at
    [b, 0, d // 16, s, d % 16] (docs/ascend.md §11.4)."""
    if cache.dim() == 5:
        if planted() == "nz-off-by-one":
            cache = cache.roll(-1, dims=3)
        return cache.permute(0, 1, 3, 2, 4).reshape(-1, _cache_width(cache))
    return cache.reshape(-1, cache.shape[-1])


def _cache_rows(block_table_row: torch.Tensor, kv_len: int, block_size: int) -> torch.Tensor:
    positions = torch.arange(kv_len, device=block_table_row.device)
    blocks = block_table_row[positions // block_size].long()
    return blocks * block_size + positions % block_size


def _visible_keys(args: FiaArgs, request: int, query_count: int, kv_len: int) -> torch.Tensor:
    """[query_count, kv_len] bool: which of the request's keys each of its queries attends to."""
    if args.sparse_mode == 3:
        # rightDownCausal: the last query sees every key, earlier ones one fewer each.
        query_index = torch.arange(query_count).unsqueeze(1)
        key_index = torch.arange(kv_len).unsqueeze(0)
        return key_index <= kv_len - query_count + query_index
    if args.atten_mask is None:
        return torch.ones(query_count, kv_len, dtype=torch.bool)
    mask = args.atten_mask.reshape(-1, query_count, args.atten_mask.shape[-1])
    request_mask = mask[request if mask.shape[0] > 1 else 0, :, :kv_len]
    return ~request_mask.bool()


def _attend_request(query, query_rope, latent, key_rope, value, visible, scale):
    """Attention of one request with kv_len > 0, in fp32: out [S, N, Dv], natural-log lse [S, N].

    A query whose mask hides every key gets out 0 and lse -inf: the stand-in's choice (the docs say
    nothing), a row with no weight that npu_attention_update ignores.
    """
    scores = scale * (
        torch.einsum("snd,kd->snk", query, latent) + torch.einsum("snr,kr->snk", query_rope, key_rope)
    )
    scores = scores.masked_fill(~visible.unsqueeze(1), -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    lse_column = lse.unsqueeze(-1)
    weights = torch.exp(scores - lse_column).masked_fill(lse_column == -math.inf, 0.0)
    return torch.einsum("snk,kd->snd", weights, value), lse


# ---------------------------------------------------------------------------------------------
# npu_attention_update
# ---------------------------------------------------------------------------------------------

MAX_UPDATE_SOURCES = 16
UPDATE_HEAD_DIM_RANGE = (8, 512)
UPDATE_HEAD_DIM_ALIGNMENT = 8
UPDATE_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def validate_attention_update(
    lse: Sequence[torch.Tensor], local_out: Sequence[torch.Tensor], update_type: int
) -> None:
    """The limits of docs/ascend.md §8.3 (op-plugin doc: at most 16 sources)."""
    if len(lse) != len(local_out) or not 1 <= len(lse) <= MAX_UPDATE_SOURCES:
        raise ValueError(
            f"lse and local_out have {len(lse)} and {len(local_out)} entries; they need the same "
            f"count in [1, {MAX_UPDATE_SOURCES}]"
        )
    rows = local_out[0].shape[0] if local_out[0].dim() == 2 else None
    for index, (source_lse, source_out) in enumerate(zip(lse, local_out)):
        _check_update_source(index, source_lse, source_out, rows, local_out[0].dtype)
    if update_type not in (0, 1):
        raise ValueError(f"update_type is {update_type}; allowed: 0 (out only) or 1 (out and lse)")


def _check_update_source(index, source_lse, source_out, rows, out_dtype) -> None:
    low, high = UPDATE_HEAD_DIM_RANGE
    if source_out.dim() != 2:
        raise ValueError(f"local_out[{index}] must be 2-D [M, D], got shape {tuple(source_out.shape)}")
    head_dim = source_out.shape[1]
    if not low <= head_dim <= high or head_dim % UPDATE_HEAD_DIM_ALIGNMENT:
        raise ValueError(
            f"local_out[{index}] head dim is {head_dim}; allowed: a multiple of "
            f"{UPDATE_HEAD_DIM_ALIGNMENT} in [{low}, {high}]"
        )
    if source_out.dtype not in UPDATE_OUT_DTYPES:
        raise ValueError(
            f"local_out[{index}] dtype {source_out.dtype} is not supported; "
            "allowed: float32, float16, bfloat16"
        )
    if source_out.dtype != out_dtype:
        raise ValueError(
            f"local_out[{index}] dtype {source_out.dtype} differs from local_out[0] dtype {out_dtype}"
        )
    if source_out.shape[0] != rows:
        raise ValueError(f"local_out[{index}] has {source_out.shape[0]} rows, local_out[0] has {rows}")
    if source_lse.dim() != 1 or source_lse.dtype != torch.float32 or source_lse.shape[0] != rows:
        raise ValueError(
            f"lse[{index}] is {tuple(source_lse.shape)} {source_lse.dtype}; expected 1-D float32 "
            f"[{rows}] matching local_out's rows"
        )


def _attention_update_kernel(lse, local_out, update_type):
    validate_attention_update(lse, local_out, update_type)
    lses = torch.stack(lse).float()
    # An empty FIA shard reports +inf; the kernel reads it as -inf so it gets no weight (§7.3).
    lses = lses.masked_fill(lses == math.inf, -math.inf)
    # No guard for rows where every lse is -inf: like the kernel, they come out NaN (§7.4).
    lse_max = lses.max(dim=0).values
    merged_lse = lse_max + torch.log(torch.exp(lses - lse_max).sum(dim=0))
    weights = torch.exp(lses - merged_lse).unsqueeze(-1)
    merged_out = (torch.stack(local_out).float() * weights).sum(dim=0)
    if update_type == 0:  # the op makes lse_out for update_type 1 only (§8.2): never read it
        merged_lse = torch.full_like(merged_lse, math.nan)
    return merged_out.to(local_out[0].dtype), merged_lse


def _attention_update_fake(lse, local_out, update_type):
    validate_attention_update(lse, local_out, update_type)
    return (
        local_out[0].new_empty(local_out[0].shape),
        lse[0].new_empty(lse[0].shape, dtype=torch.float32),
    )


# ---------------------------------------------------------------------------------------------
# npu_scatter_pa_kv_cache (docs/ascend.md §17)
# ---------------------------------------------------------------------------------------------

SCATTER_CACHE_MODES = (None, "Norm", "PA_NZ")
SLOT_DTYPES = (torch.int32, torch.int64)
SLOTS_2026_CANN = (9, 0)
"""The CANN (major, minor) taken to carry the 2026 scatter kernels, which template on the slot dtype
(ops-transformer scatter_pa_kv_cache.cpp @ 1aaa6504); below it on A2/A3 the 2025 ND kernel reads the
slots as int32 (scatter_pa_kv_cache_nd.h @ 3b632b4f). Which release ships which is not stated (§17):
the line lowering/npu/versions.py draws for the 2026 FIA checks."""
A2_A3_SOC_VERSIONS = (*range(220, 226), *range(250, 257))
"""torch.npu.get_soc_version() of Atlas A2 (220-225) and A3 (250-256) (§18.1)."""


def _kernel_reads_int32_slots(cache_mode) -> bool:
    """Whether the emulated SoC and CANN run the 2025 A2/A3 ND kernel, which reads slot_mapping
    through a GlobalTensor<int32_t> whatever its dtype (§17)."""
    if cache_mode not in (None, "Norm") or torch.npu.get_soc_version() not in A2_A3_SOC_VERSIONS:
        return False
    cann = re.match(r"\s*(\d+)\.(\d+)", torch.npu.utils.get_cann_version() or "")
    return cann is None or (int(cann.group(1)), int(cann.group(2))) < SLOTS_2026_CANN


def validate_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, compress_lens=None,
                                 compress_seq_offsets=None, seq_lens=None, cache_mode="PA_NZ") -> tuple[int, int]:
    """The documented limits of the 3-D-key scenario (op-plugin docs/zh/custom_APIs/torch_npu/
    torch_npu-npu_scatter_pa_kv_cache.md @ 517f2e7d, 约束说明) and the A2/A3 tiling's check of the
    tokens against the cache's slots (ops-transformer scatter_pa_kv_cache_tiling.cpp @ 001b95e5);
    returns (block_size, NZ last dim, 0 for ND). Slot values are checked by the kernel."""
    if compress_lens is not None or compress_seq_offsets is not None or seq_lens is not None:
        raise NotImplementedError("npu_scatter_pa_kv_cache stand-in: compress_lens, compress_seq_offsets and seq_lens "
                                  "(the compressed scenarios) are not implemented")
    if cache_mode not in SCATTER_CACHE_MODES:
        raise ValueError(f"npu_scatter_pa_kv_cache: cache_mode {cache_mode!r} is not one of None, 'Norm', 'PA_NZ'")
    if key.dim() != 3 or value.dim() != 3:
        raise NotImplementedError(f"npu_scatter_pa_kv_cache stand-in: only 3-D key and value [T, num_head, head_size] "
                                  f"are implemented, got {key.dim()}-D and {value.dim()}-D")
    tokens, heads, k_size = key.shape
    if value.shape[:2] != key.shape[:2]:
        raise ValueError(f"npu_scatter_pa_kv_cache: value {tuple(value.shape)} and key {tuple(key.shape)} differ in "
                         "tokens or heads")
    if len({key.dtype, value.dtype, key_cache.dtype, value_cache.dtype}) != 1:
        raise ValueError(f"npu_scatter_pa_kv_cache: key, value, key_cache and value_cache must share a dtype, got "
                         f"{key.dtype}, {value.dtype}, {key_cache.dtype}, {value_cache.dtype}")
    if slot_mapping.dtype not in SLOT_DTYPES:
        raise ValueError(f"npu_scatter_pa_kv_cache: slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if slot_mapping.shape != (tokens,):
        raise ValueError(f"npu_scatter_pa_kv_cache: slot_mapping must be [{tokens}] (one slot per token), got "
                         f"{tuple(slot_mapping.shape)}")
    for name, tensor in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache),
                         ("slot_mapping", slot_mapping)):
        if not tensor.is_contiguous():
            raise ValueError(f"npu_scatter_pa_kv_cache: {name} is not contiguous (the op takes no strided input)")
    v_size = value.shape[2]
    nz = cache_mode == "PA_NZ"
    last = 32 // key.element_size() if nz else 0
    expected = []
    for name, cache, size in (("key_cache", key_cache, k_size), ("value_cache", value_cache, v_size)):
        blocks = cache.shape[0] if cache.dim() else 0
        if not nz:
            block_size = cache.shape[1] if cache.dim() == 4 else -1
            shapes = [(blocks, block_size, heads, size)]
        else:
            if heads * size % last:
                raise ValueError(f"npu_scatter_pa_kv_cache: 'PA_NZ' needs num_head * head_size ({heads} * {size}) "
                                 f"divisible by 32 // itemsize = {last}")
            block_size = cache.shape[-2] if cache.dim() in (4, 5) else -1
            shapes = [(blocks, heads * size // last, block_size, last)]
            if size % last == 0:
                shapes.append((blocks, heads, size // last, block_size, last))
        if cache.dim() not in (4, 5) or (cache.dim() == 5 and not nz) or tuple(cache.shape) not in shapes:
            raise ValueError(f"npu_scatter_pa_kv_cache: {name} {tuple(cache.shape)} is not a {cache_mode or 'Norm'} "
                             f"cache for [T, {heads}, {size}] rows: expected one of {shapes} "
                             "(ND: [num_blocks, block_size, num_head, head_size]; NZ: [num_blocks, "
                             "num_head * head_size // (32 // itemsize), block_size, 32 // itemsize])")
        expected.append((blocks, block_size))
    if expected[0] != expected[1]:
        raise ValueError(f"npu_scatter_pa_kv_cache: key_cache and value_cache differ in blocks or block size: "
                         f"{expected[0]} vs {expected[1]}")
    blocks, block_size = expected[0]
    if tokens > blocks * block_size:
        raise ValueError(f"npu_scatter_pa_kv_cache: numBlocks * blockSize should larger than numTokens: {tokens} "
                         f"tokens for {blocks} blocks of {block_size} (the A2/A3 tiling refuses the call; write them "
                         "in calls of at most numBlocks * blockSize tokens)")
    return block_size, last


def _scatter_pa_kv_cache_kernel(key, value, key_cache, value_cache, slot_mapping, *, compress_lens=None,
                                compress_seq_offsets=None, seq_lens=None, cache_mode="PA_NZ"):
    block_size, last = validate_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, compress_lens,
                                                    compress_seq_offsets, seq_lens, cache_mode)
    if slot_mapping.dtype == torch.int64 and _kernel_reads_int32_slots(cache_mode):
        raise ValueError("npu_scatter_pa_kv_cache: the 2025 A2/A3 ND kernel reads slot_mapping as int32 (token i reads "
                         "the i-th 32-bit word of an int64 mapping: KV in wrong slots, no error); pass int32 slots "
                         f"(emulated {torch.npu.get_device_name()}, CANN {torch.npu.utils.get_cann_version()})")
    # The kernel reads the slots on the device: the host views of the same bytes, so that the
    # stand-in itself is no host sync.
    host = torch.ops.dcp_npu_emulator.host_view
    slots = host(slot_mapping).long()
    capacity = key_cache.shape[0] * block_size
    if bool((slots >= capacity).any()):
        raise ValueError(f"npu_scatter_pa_kv_cache: slot {int(slots.max())} is out of range: slots must be below "
                         f"num_blocks * block_size = {capacity}")
    if bool((slots < 0).any()):  # the A2/A3 kernels skip it; an A5 ND kernel writes before the cache (§17)
        raise ValueError(f"npu_scatter_pa_kv_cache: slot {int(slots.min())} is negative: slots must lie in "
                         f"[0, num_blocks * block_size - 1] = [0, {capacity - 1}]")
    blocks, offsets = slots // block_size, slots % block_size
    for source, cache in ((key, key_cache), (value, value_cache)):
        rows_in = host(source)
        target = host(cache)
        if not last:
            target[blocks, offsets] = rows_in
        else:
            target = target.view(target.shape[0], -1, block_size, last)  # the 5-D form is the same bytes
            target[blocks, :, offsets] = rows_in.reshape(rows_in.shape[0], target.shape[1], last)
    _poison_repeated_slots(slots, block_size, last, host(key_cache), host(value_cache))


def _poison_repeated_slots(slots, block_size: int, last: int, *caches) -> None:
    """NaN into every slot that several tokens write: the op's result is undefined there ("重复时不保证
    正确性", §17), so a read of such a slot shows in a test."""
    values, counts = slots.unique(return_counts=True)
    repeated = values[counts > 1]
    if not repeated.numel():
        return
    blocks, offsets = repeated // block_size, repeated % block_size
    for cache in caches:
        if not cache.is_floating_point():
            continue
        if not last:
            cache[blocks, offsets] = math.nan
        else:
            cache.view(cache.shape[0], -1, block_size, last)[blocks, :, offsets] = math.nan


def _scatter_pa_kv_cache_fake(key, value, key_cache, value_cache, slot_mapping, *, compress_lens=None,
                              compress_seq_offsets=None, seq_lens=None, cache_mode="PA_NZ"):
    validate_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, compress_lens,
                                 compress_seq_offsets, seq_lens, cache_mode)
