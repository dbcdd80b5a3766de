"""End-to-end comparison of a DCP model against the same model at dcp_size=1.

Used by `dcp-compile demo` and the distributed tests. On every rank: build the reference model
twice with one seed (dcp_size=1 and dcp_size=N, same TP), prefill B requests of mixed lengths
(plus padded rows that write to location 0), then run greedy decode steps on both in lockstep.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from dcp_compile import api
from dcp_compile.models.config import preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.runtime import layout, parallel
from dcp_compile.runtime.batch import RequestTable
from dcp_compile.runtime.launch import spawn


@dataclass(frozen=True)
class Scenario:
    dcp_size: int = 2
    tp_size: int = 2
    batch: int = 4
    contexts: tuple[int, ...] = (1, 3, 17, 64)
    steps: int = 8
    seed: int = 0
    model: str = "tiny"
    layers: int | None = None
    interleave: int = 1
    pad_rows: int = 1
    kv_rows: int = 4096
    debug_checks: bool = True

    def __post_init__(self):
        if self.batch < 1 or self.steps < 0 or self.pad_rows < 0:
            raise ValueError("batch must be >= 1, steps and pad_rows >= 0")
        if not self.contexts or min(self.contexts) < 1:
            raise ValueError(f"every context length must be >= 1, got {self.contexts}")
        parallel.validate_sizes(self.tp_size, self.dcp_size, self.tp_size)

    @property
    def lengths(self) -> list[int]:
        return [self.contexts[i % len(self.contexts)] for i in range(self.batch)]

    def model_config(self):
        cfg = preset(self.model)
        return cfg.with_layers(self.layers) if self.layers else cfg


def _prompts(scenario: Scenario, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(scenario.seed)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in scenario.lengths]


def _run_model(model, scenario: Scenario, prompts):
    """Prefill, then greedy decode; returns (logits per step, tokens per request, table)."""
    max_context = max(scenario.lengths) + scenario.steps + 1
    table = RequestTable(scenario.batch, max_context, scenario.kv_rows)
    requests = list(range(scenario.batch))
    logits, tokens = [], [[] for _ in requests]
    step_input = prompts
    for _ in range(scenario.steps + 1):
        batch = table.extend_batch(requests, step_input, pad_rows=scenario.pad_rows)
        out = model(*batch.args())
        logits.append(out)
        nxt = out[: scenario.batch].argmax(-1).tolist()
        for seq, tok in zip(tokens, nxt):
            seq.append(tok)
        step_input = [[t] for t in nxt]
    return logits, tokens, table


def run_on_rank(rank: int, world_size: int, scenario: Scenario) -> dict:
    torch.manual_seed(scenario.seed)
    cfg = scenario.model_config()
    tp = parallel.build(scenario.tp_size, 1)
    prompts = _prompts(scenario, cfg.vocab_size)

    def make(dcp_size: int):
        model = MLAModel(cfg, kv_capacity=scenario.kv_rows, max_requests=scenario.batch, par=tp, seed=scenario.seed)
        return api.apply(model, dcp_size, interleave=scenario.interleave if dcp_size > 1 else 1,
                         debug_checks=scenario.debug_checks)

    start = time.perf_counter()
    baseline, sharded = make(1), make(scenario.dcp_size)
    base_logits, base_tokens, _ = _run_model(baseline, scenario, prompts)
    dcp_logits, dcp_tokens, table = _run_model(sharded, scenario, prompts)
    state = api.state(sharded)
    used = table.req_to_token[table.req_to_token != layout.PADDING_LOC]
    owners = layout.owner(used, scenario.dcp_size, scenario.interleave)
    max_abs_diff = max((a - b).abs().max().item() for a, b in zip(base_logits, dcp_logits))
    finite = all(bool(torch.isfinite(x).all()) for x in base_logits + dcp_logits)
    return {
        "rank": rank,
        "dcp_rank": state.parallel.dcp_rank,
        "tokens_match": base_tokens == dcp_tokens,
        "max_abs_diff": max_abs_diff,
        "finite": finite,
        "tokens_stored": int((owners == state.parallel.dcp_rank).sum()),
        "tokens_total": int(used.numel()),
        "capacity": state.capacity.as_dict(),
        "pass_summary": state.pass_summary(),
        "graphs": len(state.backend.reports),
        "tokens": dcp_tokens,
        "seconds": time.perf_counter() - start,
    }


def compare(scenario: Scenario) -> dict:
    """Spawn tp_size CPU ranks (gloo), run the comparison, and summarise all ranks."""
    ranks = spawn(run_on_rank, scenario.tp_size, scenario)
    head = ranks[0]
    return {
        "dcp_size": scenario.dcp_size,
        "tp_size": scenario.tp_size,
        "interleave": scenario.interleave,
        "batch": scenario.batch,
        "contexts": scenario.lengths,
        "steps": scenario.steps,
        "tokens_match": all(r["tokens_match"] for r in ranks),
        "max_abs_diff": max(r["max_abs_diff"] for r in ranks),
        "finite": all(r["finite"] for r in ranks),
        "kv_capacity_ratio": head["capacity"]["capacity_ratio"],
        "kv_rows_per_rank": head["capacity"]["rows_per_rank"],
        "kv_rows_lost": head["capacity"]["rows_lost"],
        "tokens_stored_per_dcp_rank": [r["tokens_stored"] for r in ranks[: scenario.dcp_size]],
        "tokens_total": head["tokens_total"],
        "pass_summary": head["pass_summary"],
        "graphs_captured": head["graphs"],
        "tokens": head["tokens"],
        "seconds": max(r["seconds"] for r in ranks),
        "scenario": asdict(scenario),
    }
