"""Cost model for how attention reaches a sharded KV cache: gather-q versus gather-kv.

Per rank and per MLA layer, as sympy expressions in:
  T  query tokens in the batch          B  request rows        W  page-table width
  V  sum over queries of visible keys   H  heads per rank      N  dcp_size
  R  kv_lora_rank   P  rope dim         s  bytes per cache/activation element

gather-q  : Q all-gather moves (N-1) T H (R+P) s bytes in; the all-to-all moves (N-1) T H (R s + 4)
            (partial out + fp32 LSE); attention is over N H heads and ~V/N keys; the merge reads
            N partials per output.
gather-kv : the batch's local rows, padded to [B, W], are all-gathered: (N-1) B W (R+P) s bytes in;
            attention is over H heads and V keys; no merge.
Attention FLOPs are the same for both (N H heads x V/N keys = H heads x V keys), so the choice
comes down to bytes moved against the merge: long prefixes favour gather-q, long chunks over
short prefixes favour gather-kv. Time = bytes / link bandwidth + FLOPs / FLOP rate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import sympy

STRATEGIES = ("gather-q", "gather-kv")
T, B, W, V, H, N, R, P, s = sympy.symbols("T B W V H N R P s", positive=True)

ATTENTION_FLOPS = 2 * V * H * (2 * R + P)
EXPRESSIONS = {
    "gather-q": {
        "bytes": (N - 1) * T * H * (R + P) * s + (N - 1) * T * H * (R * s + 4),
        "flops": ATTENTION_FLOPS + 4 * N * T * H * R,
    },
    "gather-kv": {
        "bytes": (N - 1) * B * W * (R + P) * s,
        "flops": ATTENTION_FLOPS,
    },
}
_SYMBOLS = (T, B, W, V, H, N, R, P, s)
_EVALUATE = {
    name: {kind: sympy.lambdify(_SYMBOLS, expr, "math") for kind, expr in exprs.items()}
    for name, exprs in EXPRESSIONS.items()
}


@dataclass(frozen=True)
class Hardware:
    link_bytes_per_s: float = 150e9
    """Bytes per second one rank receives over the DCP group's links (NVLink-class default)."""
    flops_per_s: float = 400e12
    """Attention FLOP rate per rank."""


@dataclass(frozen=True)
class Decision:
    strategy: str
    forced: bool
    costs: dict
    reason: str

    def as_dict(self) -> dict:
        return asdict(self)


def check_strategy(name: str, allow_auto: bool = True) -> None:
    allowed = (("auto",) if allow_auto else ()) + STRATEGIES
    if name not in allowed:
        raise ValueError(f"unknown attention strategy {name!r}; choose one of {list(allowed)}")


def costs(query_tokens: int, rows: int, width: int, visible_keys: int, heads: int, dcp_size: int,
          kv_lora_rank: int, rope_dim: int, element_bytes: int, hardware: Hardware = Hardware()) -> dict:
    values = (query_tokens, rows, width, visible_keys, heads, dcp_size, kv_lora_rank, rope_dim, element_bytes)
    result = {}
    for name, fns in _EVALUATE.items():
        moved, flops = fns["bytes"](*values), fns["flops"](*values)
        seconds = moved / hardware.link_bytes_per_s + flops / hardware.flops_per_s
        result[name] = {"bytes": float(moved), "flops": float(flops), "seconds": float(seconds)}
    return result


def choose(strategy: str, **batch) -> Decision:
    """Pick the strategy for one batch; `strategy` is 'auto' or a forced strategy name."""
    check_strategy(strategy)
    table = costs(**batch)
    if strategy != "auto":
        return Decision(strategy, True, table, f"forced {strategy}")
    best = min(STRATEGIES, key=lambda name: table[name]["seconds"])
    other = next(name for name in STRATEGIES if name != best)
    reason = (
        f"{best}: {table[best]['bytes'] / 1e3:.1f} kB, {table[best]['seconds'] * 1e6:.2f} us "
        f"vs {other}: {table[other]['bytes'] / 1e3:.1f} kB, {table[other]['seconds'] * 1e6:.2f} us (per layer, per rank)"
    )
    return Decision(best, False, table, reason)
