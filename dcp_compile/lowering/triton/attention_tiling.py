"""Launch choices for split-KV partial attention, and the heuristic that picks them.

The choice depends only on shapes and the device, never on tensor values, so choosing reads
nothing back from the device and a captured graph stays valid for any lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

# A program's accumulator is [BLOCK_H, R] fp32 in registers: 64 heads x 512 is 128 KiB, half an
# H100/H200 register file. More heads than this run as several head tiles of one KV split,
# scheduled side by side so the second read of each KV row hits L2.
MAX_BLOCK_H = 64
# Below this many keys per split the fp32 partial written per split (H x R x 4 bytes) stops
# being small next to the KV it summarises.
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 256
# Used where the device reports no count of parallel units (triton-ascend, the interpreter).
DEFAULT_PARALLEL_UNITS = 32
# Fraction of the machine a wave of programs should fill before adding splits stops paying.
TARGET_UTILIZATION = 0.9


@dataclass(frozen=True)
class AttentionTiling:
    """How partial attention is cut into programs."""

    num_splits: int
    """KV splits per query: each split's keys are one program's work; a second kernel merges them."""
    block_h: int
    """Heads per program (a power of two >= 16); all heads when there are at most MAX_BLOCK_H."""
    block_n: int
    """Keys loaded per inner iteration (a power of two >= 16)."""
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_h", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")


def parallel_units(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_PARALLEL_UNITS


def choose_num_splits(programs_per_split: int, width: int, units: int) -> int:
    """Fewest splits whose programs fill `units` to TARGET_UTILIZATION in whole waves.

    `programs_per_split` is queries x head tiles, `width` the page-table width (the most keys a
    request can have). Without a split count that reaches the target, the best one found is used.
    """
    most = max(1, min(MAX_SPLITS, triton.cdiv(width, MIN_KEYS_PER_SPLIT)))
    best, best_utilization = 1, 0.0
    for splits in range(1, most + 1):
        programs = programs_per_split * splits
        utilization = programs / (triton.cdiv(programs, units) * units)
        if utilization >= TARGET_UTILIZATION:
            return splits
        if utilization > best_utilization:
            best, best_utilization = splits, utilization
    return best


def choose_tiling(tokens: int, heads: int, width: int, device: torch.device,
                  cache_dtype: torch.dtype = torch.bfloat16) -> AttentionTiling:
    # fp32 is the exact path, not the fast one: its IEEE dots run without tensor cores, and a
    # 64-head fp32 query tile alone would fill 147 KiB of shared memory.
    most_heads = MAX_BLOCK_H if cache_dtype != torch.float32 else MAX_BLOCK_H // 2
    block_h = min(most_heads, max(16, triton.next_power_of_2(heads)))
    head_tiles = triton.cdiv(heads, block_h)
    num_splits = choose_num_splits(max(1, tokens * head_tiles), width, parallel_units(device))
    if cache_dtype == torch.float32:
        return AttentionTiling(num_splits=num_splits, block_h=block_h, block_n=16, num_warps=8, num_stages=2)
    # Measured on an H200 at 128k context (bench/attention_sweep.py, results in
    # bench/results/attention_sweep_h200.json): 64 keys per step is best at every head count. A
    # 64-head tile runs best with 8 warps and 2 stages (35-40% of the 4.3 TB/s copy, against
    # 17-19% with 16 keys per step, although 64 spills more registers). For 32 heads, 4 warps
    # won the sweep by 1-2 points on random page tables but lost 35% on contiguous ones in
    # bench/decode.py, so 8 warps it is.
    if block_h >= 64:
        return AttentionTiling(num_splits=num_splits, block_h=block_h, block_n=64, num_warps=8, num_stages=2)
    return AttentionTiling(num_splits=num_splits, block_h=block_h, block_n=64, num_warps=8, num_stages=3)
