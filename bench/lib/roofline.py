"""The roofline floor of a kernel or a whole step: the larger of the bytes it must read at the copy
rate and the FLOPs it must do at the matmul rate, both rates measured in the same run
(bench.lib.timing). A measured time is reported as floor / time, its share of the floor."""

from __future__ import annotations


def attention_flops(heads: int, visible_keys, rank_dim: int, rope_dim: int):
    """MLA attention over the latent cache: QK over R + P and PV over R, 2 (2R + P) FLOPs for each
    (query head, visible key) pair; `visible_keys` is summed over the queries."""
    return 2 * (2 * rank_dim + rope_dim) * heads * visible_keys


def floor(bytes_read, flops, copy_rate: float, matmul_rate: float) -> tuple[float, str]:
    """(floor seconds, "memory" or "compute": the bound that sets it; a tie is "memory")."""
    memory, compute = bytes_read / copy_rate, flops / matmul_rate
    return max(memory, compute), "memory" if memory >= compute else "compute"
