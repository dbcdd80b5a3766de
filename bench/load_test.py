"""Load test: a serving loop under DCP 2 against dcp_size=1, every forward compared, memory watched.

Two gloo ranks (TP 2) each hold the tiny hybrid model (MLA layers and a recurrent linear-attention
layer) twice, at DCP 2 and at dcp_size 1 (same seed, same TP). A scripted scheduler that never
pads drives both in lockstep for `--steps` steps: requests join (a prefill of a random length)
into a free slot, leave (their KV released, their slot and its recurrent state left for the next
request), decode, and verify k drafts with a random accept count and the truncation that follows.
Every forward's logits are compared (fp32: within 1e-5, greedy tokens equal; the DCP model is fed
the baseline's tokens).

The batched dcp_size=1 baseline is itself checked against a fresh model per request: each request
also runs alone, on an eager model made when it joins and dropped when it leaves, so that no
slot, KV or recurrent state of an earlier request can reach it. Its logits must equal the
baseline's rows of that request (`isolation_*`).

Each rank's resident memory is sampled every step; after `--warmup` steps it must stay flat: the
growth (at most `--max-growth-mib`) and a least-squares slope per 100 steps (under
`--max-slope-mib`, where given) are reported.

    python -m bench.load_test --steps 6000 --warmup 2000 --max-slope-mib 0.05   # bench/results/load_test_cpu.json
    python -m bench.load_test --steps 60 --no-save                              # quick

New batch shapes compile new graphs (the last at about step 1,650 of the default seed), and each
grows memory in steps; caches of shapes seen (dynamo's, the DCP peers' agreement) fill until about
step 2,500. Over a few hundred steps the slope is noise, up to 0.9 MiB per 100 steps either way.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch

import dcp_compile
from bench.lib import result as results
from dcp_compile.models.config import preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.runtime import parallel
from dcp_compile.runtime.batch import RequestTable
from dcp_compile.runtime.launch import spawn

TOLERANCE = 1e-5
MAX_REQUESTS, MAX_CONTEXT, KV_ROWS = 8, 512, 8192


def _resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _slope_per_100(values: list[float]) -> float:
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    covariance = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    return 100 * covariance / sum((i - mean_x) ** 2 for i in range(n))


class Schedule:
    """The step kinds and their sizes, drawn from one seed so that every rank runs the same."""

    def __init__(self, seed: int, vocab: int):
        self.rng, self.vocab = random.Random(seed), vocab

    def next(self, active: dict[int, list[int]], free: list[int]) -> tuple[str, dict]:
        roll = self.rng.random()
        if free and (not active or roll < 0.2):
            joining = free[: self.rng.randint(1, min(3, len(free)))]
            return "join", {r: [self.rng.randrange(1, self.vocab) for _ in range(self.rng.randint(1, 200))] for r in joining}
        if active and roll < 0.3:
            return "leave", {"request": self.rng.choice(sorted(active))}
        if roll < 0.6:
            k = self.rng.randint(2, 8)
            drafts = {r: [self.rng.randrange(1, self.vocab) for _ in range(k - 1)] for r in sorted(active)}
            return "verify", {"k": k, "drafts": drafts, "accepted": {r: self.rng.randrange(k) for r in sorted(active)}}
        return "decode", {}


class FreshReference:
    """Each request alone on an eager dcp_size=1 model of its own (same weights, same TP), made
    when it joins and dropped when it leaves: nothing of another request can reach its logits."""

    def __init__(self, cfg, tp: parallel.ParallelState, seed: int):
        self.cfg, self.tp, self.seed = cfg, tp, seed
        self.requests: dict[int, tuple[MLAModel, RequestTable]] = {}

    def join(self, request: int) -> None:
        self.requests[request] = (MLAModel(self.cfg, MAX_CONTEXT + 1, 1, par=self.tp, seed=self.seed),
                                  RequestTable(1, MAX_CONTEXT, MAX_CONTEXT + 1, vocab_size=self.cfg.vocab_size))

    def leave(self, request: int) -> None:
        del self.requests[request]

    def truncate(self, request: int, length: int) -> None:
        self.requests[request][1].truncate(0, length)

    @torch.no_grad()
    def forward(self, requests: list[int], tokens: list[list[int]], all_logits: bool) -> torch.Tensor:
        """The logits rows of a batch of `requests`, in the batch's order, each request run alone."""
        outs = []
        for request, new_tokens in zip(requests, tokens):
            model, table = self.requests[request]
            outs.append(model(*table.extend_batch([0], [new_tokens], all_logits=all_logits).args()))
        return torch.cat(outs)


def run_on_rank(rank: int, world: int, steps: int, warmup: int, seed: int) -> dict:
    torch.manual_seed(seed)
    cfg = preset("tiny")
    if "linear" not in cfg.layer_types:
        raise ValueError(f"the load test's model must have a recurrent layer, got layers {cfg.layer_types}")
    tp = parallel.build(2)
    models = [dcp_compile.apply(MLAModel(cfg, KV_ROWS, MAX_REQUESTS, par=tp, seed=seed), dcp) for dcp in (1, 2)]
    tables = [RequestTable(MAX_REQUESTS, MAX_CONTEXT, KV_ROWS, dcp_size=dcp, vocab_size=cfg.vocab_size) for dcp in (1, 2)]
    fresh = FreshReference(cfg, tp, seed)
    schedule = Schedule(seed, cfg.vocab_size)
    active: dict[int, list[int]] = {}  # request -> its tokens so far (the baseline's greedy ones)
    counts = {"join": 0, "leave": 0, "decode": 0, "verify": 0}
    forwards = mismatches = flips = isolation_mismatches = isolation_flips = slot_reuses = 0
    max_diff = isolation_max_diff = 0.0
    memory, start = [], time.perf_counter()
    used_slots: set[int] = set()
    graphs_seen, last_compile_step = 0, None

    def forward(requests, tokens, all_logits=False):
        nonlocal forwards, mismatches, flips, max_diff, isolation_mismatches, isolation_flips, isolation_max_diff
        outs = []
        for model, table in zip(models, tables):
            batch = table.extend_batch(requests, tokens, all_logits=all_logits)
            outs.append(model(*batch.args(), host_metadata=batch.host))
        base, dcp = outs
        alone = fresh.forward(requests, tokens, all_logits)
        diff, isolation_diff = (base - dcp).abs().max().item(), (base - alone).abs().max().item()
        max_diff, isolation_max_diff = max(max_diff, diff), max(isolation_max_diff, isolation_diff)
        forwards += 1
        mismatches += diff > TOLERANCE
        isolation_mismatches += isolation_diff > TOLERANCE
        flips += int((base.argmax(-1) != dcp.argmax(-1)).sum())
        isolation_flips += int((base.argmax(-1) != alone.argmax(-1)).sum())
        return base

    for step in range(steps):
        free = [r for r in range(MAX_REQUESTS) if r not in active
                and all(int(t.seq_lens[r]) == 0 for t in tables)]
        kind, plan = schedule.next(active, free)
        if kind in ("decode", "verify") and not active:
            kind, plan = "join", {free[0]: [1, 2, 3]}
        if kind == "verify" and any(len(active[r]) + plan["k"] > MAX_CONTEXT - 1 for r in active):
            kind = "leave"
            plan = {"request": max(active, key=lambda r: len(active[r]))}
        if kind == "decode" and any(len(active[r]) + 1 > MAX_CONTEXT - 1 for r in active):
            kind, plan = "leave", {"request": max(active, key=lambda r: len(active[r]))}
        counts[kind] += 1
        if kind == "join":
            requests = sorted(plan)
            for r in requests:
                slot_reuses += r in used_slots
                used_slots.add(r)
                fresh.join(r)
            logits = forward(requests, [plan[r] for r in requests])
            for row, r in enumerate(requests):
                active[r] = plan[r] + [int(logits[row].argmax())]
        elif kind == "leave":
            for table in tables:
                table.truncate(plan["request"], 0)
            fresh.leave(plan["request"])
            del active[plan["request"]]
        elif kind == "decode":
            requests = sorted(active)
            logits = forward(requests, [[active[r][-1]] for r in requests])
            for row, r in enumerate(requests):
                active[r].append(int(logits[row].argmax()))
        else:
            requests, k = sorted(active), plan["k"]
            logits = forward(requests, [[active[r][-1]] + plan["drafts"][r] for r in requests], all_logits=True)
            for row, r in enumerate(requests):
                m = plan["accepted"][r]
                kept = int(tables[0].seq_lens[r]) - k + 1 + m
                for table in tables:
                    table.truncate(r, kept)
                fresh.truncate(r, kept)
                active[r] += plan["drafts"][r][:m] + [int(logits[row * k + m].argmax())]
        graphs = sum(len(dcp_compile.state(model).reports) for model in models)
        if graphs != graphs_seen:
            graphs_seen, last_compile_step = graphs, step
        memory.append(_resident_mib())
    steady = memory[warmup:]
    state = dcp_compile.state(models[1])
    return {
        "rank": rank, "layer_types": list(cfg.layer_types), "forwards": forwards, "mismatches": mismatches,
        "argmax_flips": flips, "max_abs_diff": max_diff, "isolation_mismatches": isolation_mismatches,
        "isolation_argmax_flips": isolation_flips, "isolation_max_abs_diff": isolation_max_diff,
        "joins_into_a_used_slot": slot_reuses, "steps": counts, "seconds": time.perf_counter() - start,
        "graphs": {"dcp2": len(state.reports), "dcp1": len(dcp_compile.state(models[0]).reports)},
        "last_compile_step": last_compile_step,
        "strategies": dict(state.strategy_counts),
        "memory_mib": {"after_warmup": steady[0] if steady else None, "end": memory[-1],
                       "growth_after_warmup": (max(steady) - steady[0]) if steady else None,
                       "slope_per_100_steps": _slope_per_100(steady),
                       "every_100_steps": memory[::100]},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=100, help="steps before memory must stay flat")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-growth-mib", type=float, default=32.0, help="most RSS growth after the warm-up")
    parser.add_argument("--max-slope-mib", type=float, default=None,
                        help="largest least-squares RSS slope after the warm-up, in MiB per 100 steps (checked only "
                             "when given: over a few hundred steps the slope is noise, up to 0.9 either way)")
    parser.add_argument("--out", default="bench/results/load_test_cpu.json")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup} (>= 0): memory is checked over the steps "
                     "after the warm-up")
    start = time.perf_counter()
    ranks = spawn(run_on_rank, 2, args.steps, args.warmup, args.seed, timeout=300)
    ok = all(r["mismatches"] == 0 and r["argmax_flips"] == 0 and r["isolation_mismatches"] == 0
             and r["isolation_argmax_flips"] == 0 and r["memory_mib"]["growth_after_warmup"] <= args.max_growth_mib
             and (args.max_slope_mib is None or r["memory_mib"]["slope_per_100_steps"] < args.max_slope_mib)
             for r in ranks)
    result = results.start("load_test", argv)
    result["run"].update(steps=args.steps, warmup=args.warmup, seed=args.seed, tolerance=TOLERANCE,
                         max_growth_mib=args.max_growth_mib, max_slope_mib=args.max_slope_mib, passed=ok,
                         seconds=time.perf_counter() - start)
    results.add(result, "ranks", *ranks)
    for r in ranks:
        mem = r["memory_mib"]
        print(f"rank {r['rank']}: {r['forwards']} forwards ({r['steps']}), {r['mismatches']} mismatches, "
              f"{r['argmax_flips']} argmax flips, max |diff| {r['max_abs_diff']:.2e}, graphs {r['graphs']} "
              f"(the last compiled at step {r['last_compile_step']}); "
              f"against a fresh model per request ({r['joins_into_a_used_slot']} joins into a used slot): "
              f"{r['isolation_mismatches']} mismatches, {r['isolation_argmax_flips']} argmax flips, max |diff| "
              f"{r['isolation_max_abs_diff']:.2e}; "
              f"memory {mem['after_warmup']:.0f} -> {mem['end']:.0f} MiB after warm-up (growth "
              f"{mem['growth_after_warmup']:.1f} MiB, slope {mem['slope_per_100_steps']:.3f} MiB/100 steps), "
              f"{r['seconds']:.0f} s")
    print("PASS" if ok else "FAIL")
    if not args.no_save:
        results.write(result, args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
