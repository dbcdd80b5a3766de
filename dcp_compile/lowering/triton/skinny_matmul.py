"""Matmuls of a few rows against a large weight: a decode step's projections and MLA's absorbed
W_UK / W_UV, read at the memory rate.

    out[b, m, n] = sum_k x[b, m, k] * w[b, k, n]        M (tokens) <= MAX_ROWS; B = 1 for a linear

At a decode step a projection is a matrix-vector product: it reads its weight once for a few
tokens, so its floor is the weight's bytes at the copy rate. cuBLAS's kernels for these shapes
reach 41-79% of it on an H200 (a wide-K, narrow-N weight like q_a+kv_a 50%, the per-head
W_UK/W_UV products 41%: bench/results/skinny_matmul_h200.json). This kernel tiles N across the
GPU and splits K where N alone gives too few programs; the last program of a tile to finish sums
its splits' partials in split order (deterministic), so a split product is still one launch.
Configs are tuned per GPU and shape (skinny_configs/, written by bench/skinny_matmul.py).

Any strides: x's K and out's N must be unit-stride, w either K- or N-unit-stride (a linear's
weight [N, K] seen as [K, N], or an einsum's [B, K, N]), so both the linear and the per-head
einsum read their operands where they lie and write the output in the layout its users read:
no permute copies between kernels.

Under TRITON_INTERPRET the dot runs in fp32 (the interpreter's tl.dot multiplies the raw bits of
bf16: triton-lang/triton#11584), as in attention.py.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from dcp_compile.lowering.triton.launching import is_interpreted

MAX_ROWS = 64
"""The most rows (tokens) this kernel takes; above, a GEMM is no longer bound by its weight read."""


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    splits: int
    num_warps: int = 4
    num_stages: int = 4


@triton.jit(do_not_specialize=["M"])
def _skinny_matmul_kernel(
    x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_per_split, splits,
    stride_xb, stride_xm, stride_wb, stride_w, stride_ob, stride_om,
    W_K_CONTIGUOUS: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
):
    # Split s covers k in [s * k_per_split, (s + 1) * k_per_split), a multiple of BLOCK_K; with
    # EVEN_K every split lies inside K, so the weight loads carry no K mask and stay 16 bytes wide.
    pid_n, pid_s, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = pid_s * k_per_split
    ks = k_lo + tl.arange(0, BLOCK_K)
    row_mask, col_mask = rows < M, cols < N
    x_ptrs = x_ptr + pid_b.to(tl.int64) * stride_xb + rows[:, None] * stride_xm + ks[None, :]
    if W_K_CONTIGUOUS:  # a linear's weight [N, K]: tiles [BLOCK_N, BLOCK_K], K contiguous
        w_ptrs = w_ptr + pid_b.to(tl.int64) * stride_wb + cols[:, None].to(tl.int64) * stride_w + ks[None, :]
        w_step = BLOCK_K
    else:  # [K, N] with N contiguous: tiles [BLOCK_K, BLOCK_N]
        w_ptrs = w_ptr + pid_b.to(tl.int64) * stride_wb + ks[:, None].to(tl.int64) * stride_w + cols[None, :]
        w_step = BLOCK_K * stride_w
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
        else:
            k_in = (ks + k0) < K
            x = tl.load(x_ptrs, mask=row_mask[:, None] & k_in[None, :], other=0.0)
        if W_K_CONTIGUOUS:
            if EVEN_K and EVEN_N:
                w = tl.load(w_ptrs)
            elif EVEN_K:
                w = tl.load(w_ptrs, mask=col_mask[:, None], other=0.0)
            else:
                w = tl.load(w_ptrs, mask=col_mask[:, None] & k_in[None, :], other=0.0)
            w = tl.trans(w)
        else:
            if EVEN_K and EVEN_N:
                w = tl.load(w_ptrs)
            elif EVEN_K:
                w = tl.load(w_ptrs, mask=col_mask[None, :], other=0.0)
            else:
                w = tl.load(w_ptrs, mask=k_in[:, None] & col_mask[None, :], other=0.0)
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += w_step
    out = out_ptr + pid_b.to(tl.int64) * stride_ob + rows[:, None] * stride_om + cols[None, :]
    out_mask = row_mask[:, None] & col_mask[None, :]
    if SPLIT:
        # Split K: each program leaves its partial tile in the workspace; the last of a tile's
        # splits to arrive (a counter per tile, reset by it for the next launch) sums them in
        # split order and writes the output. One launch, no second reduce kernel.
        tile = pid_b * tl.num_programs(0) + pid_n
        tile_offsets = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        parts = part_ptr + tile.to(tl.int64) * splits * BLOCK_M * BLOCK_N
        tl.store(parts + pid_s * BLOCK_M * BLOCK_N + tile_offsets, acc)
        tl.debug_barrier()  # every thread's partial stored before the program signals
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == splits - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for split in range(0, splits):
                total += tl.load(parts + split * BLOCK_M * BLOCK_N + tile_offsets, cache_modifier=".cg")
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(count_ptr + tile, 0)
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


MAX_SPLIT_TILES = 1 << 16
"""Output tiles one split-K launch may have (the per-device counter buffer's length)."""
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device) -> torch.Tensor:
    """Zeroed int32 tile counters, one buffer per device for the process's life: a captured graph
    keeps its address, and every launch leaves the counters it used at 0 again. Split launches
    share it, so they must not run concurrently on one device: today every step runs on one
    stream; a pass that overlaps two products on two streams needs a buffer per stream."""
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def block_rows(rows: int) -> int:
    return max(16, triton.next_power_of_2(rows))  # tl.dot's smallest M


def choose(rows: int, n: int, k: int, batch: int, programs_wanted: int, device_name: str | None = None) -> SkinnyConfig | None:
    """A config for out [batch, rows, n] = x [batch, rows, k] @ w [batch, k, n]: the one tuned for
    this shape and row block on this GPU (tuned_configs; None where cuBLAS measured faster there),
    else the widest N tile that, with K split in at most 8, puts `programs_wanted` programs on the
    GPU (a few per SM, so that enough weight loads are in flight to keep the memory busy)."""
    tuned = tuned_configs(device_name).get(shape_key(batch, k, n))
    if tuned:  # the largest row block tuned up to this one's (the smallest, above all tuned)
        blocks = sorted(int(b) for b in tuned)
        fitting = [b for b in blocks if b <= block_rows(rows)]
        entry = tuned[str(fitting[-1] if fitting else blocks[0])]
        return None if entry == TORCH_FASTER else SkinnyConfig(*entry)
    for block_n in (64, 32, 16):
        tiles = batch * triton.cdiv(n, block_n)
        if tiles >= programs_wanted:
            return SkinnyConfig(block_n, 256 if k >= 1024 else 128, 1)
    block_n = 16
    tiles = batch * triton.cdiv(n, block_n)
    block_k = 256
    splits = max(1, min(8, triton.cdiv(programs_wanted, tiles), triton.cdiv(k, block_k)))
    return SkinnyConfig(block_n, block_k, splits)


TORCH_FASTER = "cublas"
"""A tuned table's entry where torch's matmul (cuBLAS) measured faster than every config tried."""


def config_for(x: torch.Tensor, n: int, k: int, batch: int) -> SkinnyConfig | None:
    """choose() for x's device; None where this GPU's table says torch's matmul is faster."""
    return choose(x.shape[-2], n, k, batch, programs_wanted(x.device), gpu_name(x.device))


def shape_key(batch: int, k: int, n: int) -> str:
    return f"{batch}x{k}x{n}"


CONFIGS_ENV = "DCP_COMPILE_SKINNY_CONFIGS"
"""A JSON file of tuned configs to use instead of the package's own (bench/skinny_matmul.py --table)."""


@functools.lru_cache(maxsize=None)
def tuned_configs(device_name: str | None) -> dict:
    """{shape_key: {row block: [block_n, block_k, splits, num_warps, num_stages]}} measured on this
    GPU model by bench/skinny_matmul.py: the file $DCP_COMPILE_SKINNY_CONFIGS, else
    skinny_configs/<GPU name>.json beside this module; {} where neither exists."""
    path = os.environ.get(CONFIGS_ENV)
    if path:
        if not Path(path).is_file():
            raise FileNotFoundError(f"{CONFIGS_ENV}={path!r} names no file (bench/skinny_matmul.py --table writes one)")
    elif device_name:
        path = Path(__file__).parent / "skinny_configs" / (re.sub(r"[^A-Za-z0-9]+", "_", device_name) + ".json")
    if not path or not Path(path).is_file():
        return {}
    return json.loads(Path(path).read_text())["configs"]


def gpu_name(device: torch.device) -> str | None:
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device()) if device.type == "cuda" else None


@functools.lru_cache(maxsize=None)
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def programs_wanted(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return 4 * _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def skinny_matmul_into(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, config: SkinnyConfig | None = None) -> torch.Tensor:
    """out [B, M, N] = x [B, M, K] @ w [B, K, N] (views of any strides, under the unit-stride rules
    of the module docstring); returns out."""
    if x.dim() != 3 or w.dim() != 3 or out.dim() != 3:
        raise ValueError(f"skinny_matmul takes x [B, M, K], w [B, K, N], out [B, M, N]; got "
                         f"{tuple(x.shape)}, {tuple(w.shape)}, {tuple(out.shape)}")
    batch, rows, k = x.shape
    n = w.shape[2]
    if w.shape[:2] != (batch, k) or out.shape != (batch, rows, n):
        raise ValueError(f"skinny_matmul: shapes do not chain: x {tuple(x.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)}")
    if rows > MAX_ROWS:
        raise ValueError(f"skinny_matmul takes at most {MAX_ROWS} rows, got {rows}")
    if x.stride(2) != 1 or out.stride(2) != 1 or (w.stride(1) != 1 and w.stride(2) != 1):
        raise ValueError(f"skinny_matmul needs x's K, out's N and one of w's dims unit-stride; strides x {x.stride()}, "
                         f"w {w.stride()}, out {out.stride()}")
    if rows == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    if config is None:  # the tuned config, or the heuristic's where the table prefers torch (a caller that
        # asked the kernel by name gets it)
        config = config_for(x, n, k, batch) or choose(rows, n, k, batch, programs_wanted(x.device))
    w_k_contiguous = w.stride(1) == 1 and not (w.stride(2) == 1 and k == 1)
    stride_w = w.stride(2) if w_k_contiguous else w.stride(1)
    k_per_split = triton.cdiv(triton.cdiv(k, config.splits), config.block_k) * config.block_k
    splits = triton.cdiv(k, k_per_split)
    tiles = batch * triton.cdiv(n, config.block_n)
    if splits > 1 and tiles > MAX_SPLIT_TILES:
        k_per_split, splits = triton.cdiv(k, config.block_k) * config.block_k, 1
    block_m = block_rows(rows)
    if splits > 1:
        parts = torch.empty(tiles * splits * block_m * config.block_n, dtype=torch.float32, device=x.device)
        counters = _counters(x.device)
    else:
        parts = counters = out  # unused
    grid = (triton.cdiv(n, config.block_n), splits, batch)
    _skinny_matmul_kernel[grid](
        x, w, out, parts, counters, rows, n, k, k_per_split, splits,
        x.stride(0), x.stride(1), w.stride(0), stride_w, out.stride(0), out.stride(1),
        W_K_CONTIGUOUS=w_k_contiguous, EVEN_K=k % k_per_split == 0, EVEN_N=n % config.block_n == 0, SPLIT=splits > 1,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        DOT_FP32=x.dtype == torch.float32 or is_interpreted(_skinny_matmul_kernel),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def skinny_matmul(x: torch.Tensor, w: torch.Tensor, config: SkinnyConfig | None = None) -> torch.Tensor:
    out = torch.empty((x.shape[0], x.shape[1], w.shape[2]), dtype=x.dtype, device=x.device)
    return skinny_matmul_into(out, x, w, config)
