"""What a check is, what it records, and the comparisons the attention checks share.

A check states one assumption of the NPU lowering (`relies`), where it is written down
(docs/ascend.md's section and the upstream source), and which settings it makes unsafe when it
FAILs (`gates`: option values such as "npu_kv_format='nz'", or run settings such as "--graphs").
Its function fills a Result: the verdict, the values it measured and a detail line; a SKIP always
says why. A check that raises is a FAIL (an assumption that errors is not established).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

TOLERANCE = dict(atol=2e-2, rtol=2e-2)
"""bf16 inputs, fp32 accumulation."""
LSE_TOLERANCE = dict(atol=2e-3, rtol=1e-4)


@dataclass
class Result:
    name: str
    relies: str
    source: dict
    """{"doc": "docs/ascend.md §N", "upstream": the code, doc or engine the fact was read in}."""
    verdict: str = "SKIP"
    measured: dict = field(default_factory=dict)
    detail: str = ""
    unsafe: list = field(default_factory=list)
    """The settings this result makes unsafe: the check's gates when it FAILs, unless the check
    names narrower ones itself (a PASS may name some too, e.g. block sizes the CANN refuses)."""
    seconds: float = 0.0


@dataclass
class Context:
    """What every check is handed: the device, whether it is the emulated one (the stand-ins), the
    results of the checks that ran before (checks of the environment read the capture checks'),
    and a cache for work two checks share (one spawn of 2 ranks)."""

    device: torch.device
    emulated: bool
    results: dict = field(default_factory=dict)
    shared: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Check:
    name: str
    relies: str
    doc: str
    """The docs/ascend.md sections, e.g. "§7.2"."""
    upstream: str
    gates: tuple
    run: Callable[[Result, Context], None]

    def result(self) -> Result:
        return Result(self.name, self.relies, {"doc": f"docs/ascend.md {self.doc}", "upstream": self.upstream})


def close(got, want, **tolerance) -> tuple[bool, float]:
    """(got equals want within tolerance, the largest difference): infinities must sit at the same
    places with the same sign."""
    got, want = got.cpu().float(), want.cpu().float()
    finite = torch.isfinite(want)
    if not torch.equal(torch.isfinite(got), finite) or not torch.equal(got[~finite], want[~finite]):
        return False, math.inf
    diff = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
    return bool(torch.allclose(got[finite], want[finite], **tolerance)), diff


def attention_matches(got, want) -> tuple[bool, dict]:
    """(out, lse) pairs compared: (both within tolerance, their largest differences)."""
    out_ok, out_diff = close(got[0], want[0], **TOLERANCE)
    lse_ok, lse_diff = close(got[1], want[1], **LSE_TOLERANCE)
    return out_ok and lse_ok, {"max_abs_diff_out": out_diff, "max_abs_diff_lse": lse_diff}


def first_line(exc: BaseException, limit: int = 160) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:limit]}" if text else type(exc).__name__
