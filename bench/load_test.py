"""Load test: a serving loop under DCP 2 against dcp_size=1 or transformers, every output compared, memory watched.

Three workloads (`--front-end`, `--device`, `--graphs`); the first is the default.

The canonical-op model (`--front-end canonical`).

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

New batch shapes compile new graphs (the last at about step 1,650 of the default seed), and each
grows memory in steps; caches of shapes seen (dynamo's, the DCP peers' agreement) fill until about
step 2,500. Over a few hundred steps the slope is noise, up to 0.9 MiB per 100 steps either way.

The transformers front end (`--front-end transformers`): `dcp_compile.apply(<tiny DeepSeek-V3>,
dcp_size=2)` on 2 gloo ranks, fp32, driven alike on both ranks by a seeded mix of operations, one
a step: greedy generate() calls (random prompt lengths, new tokens, one or two rows, left-padded or
not), generate() over a cache of the caller's own (model.new_cache; released after, or dropped),
turns of two conversations whose caches stay live across steps (interleaved with each other and
with the rest), refusals (a mask with holes, an out-of-vocabulary id on every rank or on one, float
ids, a released cache: a ValueError on every rank, and the model serves on), cache releases,
caches dropped in a reference cycle that one rank's garbage collector alone collects (the
automatic collector is off: the ranks' free KV locations differ until the other rank collects,
and the caches after agree on theirs), and injected failures (`--failure-rate`): one rank's
cache.advance raises once inside a generate(), after that step's collectives; that rank must
raise it and its peer a PeerFailedError, then every call on both ranks the latch's error
("an earlier step failed ..."), and the load test restarts: it builds the model anew and goes on
(`--restart`: by default it first clears dynamo's caches, as a restarted process starts without
them; `rebuild` keeps them, and with them every dropped model's compiled steps and KV pool).
Every generate()'s tokens and logits are compared with the untouched transformers model's own
generate(), run on each rank (tokens equal, logits within 1e-5). Memory is judged at the steps that
compile nothing: a step that compiles a graph or restarts (which compiles every graph anew) grows
it, and that growth is taken out of the series and reported apart (`added_by_compiling_steps`).
A restart in one process keeps about 5 MiB that torch._dynamo.reset() does not give back, most of
it torch.compile's own (bench/rebuild_memory.py: 4.4 MiB per rebuild under a plain torch.compile,
5.3 under dcp_compile, no dropped model alive); a restarted process starts without it.

The same on the npu device (`--device npu`: the emulated one, DCP_COMPILE_NPU_EMULATOR=1 set for
you, where torch_npu is absent; HCCL) with the npu back end (kernels='npu': FIA over the pool), so
in bf16 with FIA's widths (R 512, P 64) and dense layers (transformers' MoE counts tokens with an
integer histc the emulated device lacks); `--graphs` replays generate()'s decode steps from NPU
graphs (capture_decode_graphs; `replays` counts them). The reference is transformers in bf16 on
the CPU, under the near-tie rule (tests/hf/models.agree_near_ties: tokens may part only where the
reference's two best are within 2 x 0.2, the logits before that within 0.2). The npu back end
compiles a graph per shape, so sizes come from buckets (BUCKETS), and failures are injected at a
generate()'s last step (run_transformers_on_rank says why).

    python -m bench.load_test --steps 6000 --warmup 2000 --max-slope-mib 0.05   # bench/results/load_test_cpu.json
    python -m bench.load_test --front-end transformers --steps 3000 --warmup 1000   # load_test_hf_cpu.json
    python -m bench.load_test --front-end transformers --device npu --graphs --steps 3000 --warmup 1000 --failure-rate 0.003
                                                                            # load_test_hf_npu_emulator.json
    python -m bench.load_test --steps 60 --no-save                              # quick
"""

from __future__ import annotations

import argparse
import collections
import copy
import gc
import os
import random
import time
from dataclasses import dataclass

import torch

import dcp_compile
from bench.lib import result as results
from dcp_compile.models.config import preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.runtime import parallel
from dcp_compile.runtime import devices
from dcp_compile.runtime.batch import RequestTable
from dcp_compile.runtime.launch import spawn
from tests.hf.models import agree_near_ties, tiny_model

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


def _memory_summary(memory: list[float], warmup: int) -> dict:
    """A rank's resident memory per step (MiB): after the warm-up, its growth and slope."""
    steady = memory[warmup:]
    return {"after_warmup": steady[0] if steady else None, "end": memory[-1],
            "growth_after_warmup": (max(steady) - steady[0]) if steady else None,
            "slope_per_100_steps": _slope_per_100(steady), "every_100_steps": memory[::100]}


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
    state = dcp_compile.state(models[1])
    return {
        "rank": rank, "layer_types": list(cfg.layer_types), "forwards": forwards, "mismatches": mismatches,
        "argmax_flips": flips, "max_abs_diff": max_diff, "isolation_mismatches": isolation_mismatches,
        "isolation_argmax_flips": isolation_flips, "isolation_max_abs_diff": isolation_max_diff,
        "joins_into_a_used_slot": slot_reuses, "steps": counts, "seconds": time.perf_counter() - start,
        "graphs": {"dcp2": len(state.reports), "dcp1": len(dcp_compile.state(models[0]).reports)},
        "last_compile_step": last_compile_step,
        "strategies": dict(state.strategy_counts),
        "memory_mib": _memory_summary(memory, warmup),
    }


# --- The transformers front end ----------------------------------------------------------------------

HF_KV_CAPACITY = 256
"""KV rows per rank of the transformers model's pool (512 logical locations at DCP 2): two
conversations, a generate() and the caches dropped in cycles that one rank has not collected yet
fit, and now and then the ranks' common free locations run short, so that every rank collects
before the allocation (hf/locations.py)."""
MAX_PROMPT, MAX_NEW_TOKENS, CONVERSATION_WIDTH = 24, 10, 48
"""Tokens of a prompt, new tokens of a generate(), a conversation cache's width (the tiny model
has 64 positions)."""
FIA_WIDTHS = dict(kv_lora_rank=512, qk_rope_head_dim=64)
"""The npu back end's FIA takes MLA of R 512 and P 64, in bf16 (its dtypes)."""
FIA_BLOCK = 16
"""FIA's smaller block: pages of 16 rows per rank."""
BF16_LOGITS = 0.2
"""bf16's logit tolerance under the near-tie rule: the tiny model's logits reach about 10, where a
bf16 step is 0.06; the absorbed and the expanded attention round apart by up to 0.1."""
INJECTED = "injected failure"
LATCHED = "an earlier step failed"
REFUSALS = ("mask_with_holes", "out_of_vocabulary", "out_of_vocabulary_on_one_rank", "float_ids", "released_cache")
OPERATIONS = {"generate": 0.30, "own_cache": 0.12, "turn": 0.28, "refusal": 0.12, "release": 0.06, "collect": 0.12}
"""Each operation's share of the steps that are not injected failures (--failure-rate)."""
FAILURE_RATE = 0.01
"""The share of steps that inject a failure by default: each restarts the model (a compile anew)."""
RESTARTS = {
    "fresh": "drop the model, clear dynamo's caches (torch._dynamo.reset(): what a restarted process starts "
             "without), build it anew",
    "rebuild": "drop the model and build it anew in the same process: dynamo keeps every dropped model's compiled "
               "steps (the model class's forward is one code object) and the backends torch.compile was given, each "
               "with its KV pool, and its 256-graph limit counts every model's graphs",
}
"""What a restart after an injected failure does (--restart)."""
SIZES = {"prompt": range(1, MAX_PROMPT + 1), "new_tokens": range(1, MAX_NEW_TOKENS + 1), "spare": range(9),
         "turn_tokens": range(1, 9)}
"""What the transformers workload draws its sizes from: prompt tokens, new tokens, a caller's cache's
columns past its generate(), a conversation turn's new prompt tokens."""
BUCKETS = {"prompt": (3, 8, 16, 24), "new_tokens": (2, 5, 10), "spare": (6,), "turn_tokens": (2, 5)}
"""The sizes where the back end compiles a graph per shape (rows, tokens, cache width), as the npu
one does (its FIA lengths are planned on the host): a server buckets them so, and any size would
run into the model's 256 graphs."""


def _outcome(call) -> tuple:
    """("ok", what call returned), or (its error's type name, the error's first line)."""
    try:
        return "ok", call()
    except Exception as exc:  # each rank's outcome is checked against the failure rule
        return type(exc).__name__, str(exc).splitlines()[0] if str(exc) else ""


class TransformersSchedule:
    """The operations of the transformers workload and their sizes (from `sizes`: SIZES or
    BUCKETS), drawn from one seed so that every rank runs the same (the tokens generate() returns
    are agreed: the ranks' conversations stay alike too)."""

    def __init__(self, seed: int, vocab: int, failure_rate: float, sizes: dict[str, range | tuple] = SIZES,
                 fail_last_steps: bool = False):
        self.rng, self.vocab, self.failure_rate, self.sizes = random.Random(seed), vocab, failure_rate, sizes
        self.fail_last_steps = fail_last_steps
        """Inject failures at a generate()'s last step only (see run_transformers_on_rank)."""

    def size(self, name: str) -> int:
        return self.rng.choice(self.sizes[name])

    def tokens(self, count: int) -> list[int]:
        return [self.rng.randrange(1, self.vocab) for _ in range(count)]

    def prompts(self, rows: int, same_length: bool) -> list[list[int]]:
        lengths = [self.size("prompt")] * rows if same_length else [self.size("prompt") for _ in range(rows)]
        return [self.tokens(length) for length in lengths]

    def next(self, conversations: list[int]) -> tuple[str, dict]:
        """The next operation, given the live conversations."""
        rng = self.rng
        new_tokens = self.size("new_tokens")
        if rng.random() < self.failure_rate:
            at = new_tokens if self.fail_last_steps else rng.randint(1, new_tokens)
            return "failure", {"rank": rng.randrange(2), "at": at, "new_tokens": new_tokens,
                               "prompt": self.tokens(self.size("prompt"))}
        kind = rng.choices(list(OPERATIONS), weights=list(OPERATIONS.values()))[0]
        if kind == "release" and not conversations:
            kind = "turn"
        if kind == "generate":
            rows = rng.choice((1, 1, 2))
            return kind, {"prompts": self.prompts(rows, same_length=rng.random() < 0.5), "new_tokens": new_tokens}
        if kind == "own_cache":
            return kind, {"prompts": self.prompts(rng.choice((1, 2)), same_length=True), "new_tokens": new_tokens,
                          "spare": self.size("spare"), "release": rng.random() < 0.5}
        if kind == "turn":
            return kind, {"conversation": rng.randrange(2), "tokens": self.tokens(self.size("turn_tokens")),
                          "new_tokens": rng.randint(1, 8)}
        if kind == "refusal":  # refused before anything compiles: any length
            prompt = self.tokens(rng.randint(3, MAX_PROMPT))
            return kind, {"refusal": rng.choice(REFUSALS), "prompt": prompt, "at": rng.randrange(1, len(prompt) - 1),
                          "rank": rng.randrange(2), "new_tokens": new_tokens}
        if kind == "release":
            return kind, {"conversation": rng.choice(conversations)}
        return kind, {"conversation": rng.choice(conversations) if conversations else None, "rank": rng.randrange(2)}


@dataclass
class Conversation:
    """A cache of the caller's own, of one row, held across generate() calls, and its tokens so far."""

    cache: object
    tokens: list[int]


def _batch(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prompts as one batch, left-padded, with its attention mask where their lengths differ."""
    width = max(map(len, prompts))
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, tokens in enumerate(prompts):
        input_ids[row, width - len(tokens):] = torch.tensor(tokens)
        mask[row, width - len(tokens):] = 1
    return input_ids, (None if bool(mask.all()) else mask)


class TransformersLoad:
    """One rank of the transformers workload: `dcp_compile.apply(tiny DeepSeek-V3, dcp_size=world)`
    on `device`, each operation of TransformersSchedule run by the method of its name, every
    generate() compared with the untouched model's on the CPU and every refusal's and injected
    failure's outcome checked (the counts in `counts`)."""

    def __init__(self, rank: int, world: int, seed: int, device: torch.device, graphs: bool, restart: str = "fresh"):
        self.rank, self.world, self.device, self.graphs, self.restart = rank, world, device, graphs, restart
        if device.type == "cpu":
            self.reference, self.apply_kwargs = tiny_model(seed), {"kernels": "auto"}
        else:
            # Dense layers: transformers' MoE counts the tokens per expert with an integer histc,
            # which has no kernel the emulated device runs.
            self.reference = tiny_model(seed, first_k_dense_replace=2, **FIA_WIDTHS).to(torch.bfloat16)
            self.apply_kwargs = {"kernels": "npu", "block_size": FIA_BLOCK}
        self.exact = self.reference.dtype == torch.float32
        """fp32: tokens equal and logits within TOLERANCE; bf16: the near-tie rule within BF16_LOGITS."""
        self.counts = collections.Counter()
        self.max_diff = 0.0
        self.first_errors: dict[str, tuple] = {}
        """The first unexpected outcome of each kind of check, for the report."""
        self.replays_before = self.graphs_before = 0
        """Of the models before the current one (restarts)."""
        self.model, self.conversations = None, {}
        self.build()

    def build(self) -> None:
        """A model of the reference's weights: at the start, and after a failure (a restart; see
        RESTARTS)."""
        restarting = self.model is not None
        if restarting:
            self.replays_before, self.graphs_before = self.replays(), self.graphs_compiled()
        self.model, self.conversations = None, {}
        gc.collect()  # the model's own cycles (its forward refers to it), on every rank
        if restarting and self.restart == "fresh":
            torch._dynamo.reset()
        self.model = dcp_compile.apply(copy.deepcopy(self.reference).to(self.device), dcp_size=self.world,
                                       kv_capacity=HF_KV_CAPACITY, **self.apply_kwargs)
        if self.graphs:
            self.model.capture_decode_graphs(batch_sizes=(1, 2), max_length=CONVERSATION_WIDTH)

    def replays(self) -> int:
        graphs = self.model.decode_graphs
        return self.replays_before + (graphs.replays if graphs is not None else 0)

    def graphs_compiled(self) -> int:
        return self.graphs_before + len(dcp_compile.state(self.model).reports)

    def _unexpected(self, check: str, outcome: tuple) -> None:
        self.counts[check] += 1
        self.first_errors.setdefault(check, outcome)

    def _generate(self, model, input_ids: torch.Tensor, new_tokens: int, mask=None, cache=None) -> tuple:
        """(tokens, logits [rows, steps, vocab]) of a greedy generate() of `model`, on the CPU."""
        on = torch.device("cpu") if model is self.reference else self.device
        kwargs = {} if mask is None else {"attention_mask": mask.to(on)}
        if cache is not None:
            kwargs[model.cache_kwarg] = cache
        with torch.no_grad():
            out = model.generate(input_ids.to(on), max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, **kwargs)
        return out.sequences.cpu(), torch.stack(out.logits, 1).cpu()

    def _served(self, input_ids: torch.Tensor, new_tokens: int, mask=None, cache=None) -> list[list[int]] | None:
        """A generate() of the model, compared with the reference's: the model's tokens (agreed by
        the ranks, so that a mismatch cannot part them), or None where it raised."""
        outcome = _outcome(lambda: self._generate(self.model, input_ids, new_tokens, mask, cache))
        self.counts["generates"] += 1
        if outcome[0] != "ok":
            self._unexpected("mismatches", outcome)
            return None
        tokens, logits = outcome[1]
        want_tokens, want_logits = self._generate(self.reference, input_ids, new_tokens, mask)
        if self.exact:
            diff = float((logits - want_logits).abs().max()) if logits.shape == want_logits.shape else float("inf")
            agrees = torch.equal(tokens, want_tokens) and diff <= TOLERANCE
        else:
            try:
                diff, agrees = agree_near_ties((tokens, logits), (want_tokens, want_logits), BF16_LOGITS), True
            except AssertionError as exc:
                diff, agrees = float("inf"), False
                self.first_errors.setdefault("near_tie", repr(exc))
            self.counts["near_tie_partings"] += int((tokens != want_tokens).any(1).sum())
        self.max_diff = max(self.max_diff, diff)
        if not agrees:
            self._unexpected("mismatches", ("tokens", tokens.tolist(), want_tokens.tolist(), diff))
        self.counts["new_tokens"] += tokens.numel() - input_ids.numel()
        return tokens.tolist()

    def generate(self, plan: dict) -> None:
        input_ids, mask = _batch(plan["prompts"])
        self._served(input_ids, plan["new_tokens"], mask)

    def own_cache(self, plan: dict) -> None:
        input_ids, _ = _batch(plan["prompts"])
        cache = self.model.new_cache(input_ids.shape[0], input_ids.shape[1] + plan["new_tokens"] + plan["spare"])
        self._served(input_ids, plan["new_tokens"], cache=cache)
        if plan["release"]:
            cache.release()

    def turn(self, plan: dict) -> None:
        """A turn of a conversation: its tokens so far and new ones, over its cache (the history's
        KV cached by the turns before); a conversation that would outgrow its cache ends (released)
        and a new one starts."""
        number = plan["conversation"]
        conversation = self.conversations.get(number)
        if conversation is not None and len(conversation.tokens) + len(plan["tokens"]) + plan["new_tokens"] > \
                CONVERSATION_WIDTH:
            self.release({"conversation": number})
            conversation = None
        if conversation is None:
            conversation = self.conversations[number] = Conversation(self.model.new_cache(1, CONVERSATION_WIDTH), [])
            self.counts["conversations"] += 1
        input_ids = torch.tensor([conversation.tokens + plan["tokens"]])
        tokens = self._served(input_ids, plan["new_tokens"], cache=conversation.cache)
        if tokens is None:
            del self.conversations[number]
        else:
            conversation.tokens = tokens[0]

    def release(self, plan: dict) -> None:
        self.conversations.pop(plan["conversation"]).cache.release()

    def collect(self, plan: dict) -> None:
        """A conversation's cache (a new cache where none is live) dropped inside a reference
        cycle, and one rank's garbage collector run: that rank gets its locations back, its peer
        not until it collects too."""
        number = plan["conversation"]
        cycle = [self.conversations.pop(number).cache if number is not None else
                 self.model.new_cache(1, CONVERSATION_WIDTH)]
        cycle.append(cycle)
        del cycle
        if self.rank == plan["rank"]:
            gc.collect()

    def refusal(self, plan: dict) -> None:
        """An input every rank refuses (a ValueError on every rank; the operations after it find
        the model serving)."""
        model, prompt = self.model, plan["prompt"]
        input_ids = torch.tensor([prompt])
        kind = plan["refusal"]
        if kind == "mask_with_holes":
            mask = torch.ones_like(input_ids)
            mask[0, plan["at"]] = 0
            call = lambda: self._generate(model, input_ids, plan["new_tokens"], mask)  # noqa: E731
        elif kind.startswith("out_of_vocabulary"):
            if kind == "out_of_vocabulary" or self.rank == plan["rank"]:
                input_ids[0, plan["at"]] = self.reference.config.vocab_size
            call = lambda: self._generate(model, input_ids, plan["new_tokens"])  # noqa: E731
        elif kind == "float_ids":
            cache = model.new_cache(1, len(prompt))
            call = lambda: model(input_ids.float().to(self.device), **{model.cache_kwarg: cache})  # noqa: E731
        else:
            cache = model.new_cache(1, len(prompt) + plan["new_tokens"])
            cache.release()
            call = lambda: self._generate(model, input_ids, plan["new_tokens"], cache=cache)  # noqa: E731
        outcome = _outcome(call)
        self.counts[f"refused_{kind}"] += outcome[0] == "ValueError"
        if outcome[0] != "ValueError":
            self._unexpected("refusal_mismatches", (kind, *outcome[:1], str(outcome[1])[:200]))

    def failure(self, plan: dict) -> None:
        """Rank plan["rank"] fails the plan["at"]-th step of a generate() after the step's
        collectives (its cache's advance raises). That rank raises the error, its peer a
        PeerFailedError (told at its next agreement); then a generate() and a step raise the
        latch's error on both. The model is then built anew (a restart)."""
        from dcp_compile.hf.cache import DCPCache

        input_ids = torch.tensor([plan["prompt"]])
        advance, steps = DCPCache.advance, iter(range(1, MAX_NEW_TOKENS + 1))
        failing = self.rank == plan["rank"]

        def failing_advance(cache, tokens):
            if next(steps, None) == plan["at"]:
                raise RuntimeError(f"{INJECTED} on rank {self.rank}")
            return advance(cache, tokens)

        if failing:
            DCPCache.advance = failing_advance
        try:
            first = _outcome(lambda: self._generate(self.model, input_ids, plan["new_tokens"]))
        finally:
            DCPCache.advance = advance
        later = [_outcome(lambda: self._generate(self.model, input_ids, 1)),
                 _outcome(lambda: self.model(input_ids.to(self.device)))]
        expected = ("RuntimeError", f"{INJECTED} on rank {self.rank}") if failing else ("PeerFailedError",)
        if first[:len(expected)] != expected or any(o[0] != "RuntimeError" or LATCHED not in o[1] for o in later):
            self._unexpected("failure_mismatches", (first[:2], *later))
        self.build()


def run_transformers_on_rank(rank: int, world: int, steps: int, warmup: int, seed: int, device_type: str,
                             graphs: bool, failure_rate: float, restart: str) -> dict:
    device = torch.device("cpu") if device_type == "cpu" else torch.device(device_type, torch.npu.current_device())
    load = TransformersLoad(rank, world, seed, device, graphs, restart)
    # Off the CPU a decode step of generate() agrees on the device (no host sync), so a failure
    # notice there only sets a device flag: the peer goes on into the step's collectives, which the
    # failed rank never joins, and waits out the group's timeout (any collective the failed rank
    # starts meanwhile pairs with the step's). Failures are injected at the last step there, after
    # which the peer's next agreement (generate()'s result) is on the host.
    schedule = TransformersSchedule(seed, load.reference.config.vocab_size, failure_rate,
                                    SIZES if load.model.symbolic_steps() else BUCKETS,
                                    fail_last_steps=device.type != "cpu")
    kinds = collections.Counter()
    memory, start, restarts, compiling = [], time.perf_counter(), [], []
    gc.disable()  # a cache dropped in a cycle comes back when a `collect` step's rank collects, not before
    try:
        for step in range(steps):
            kind, plan = schedule.next(sorted(load.conversations))
            graphs_before = load.graphs_compiled()
            getattr(load, kind)(plan)
            kinds[kind] += 1
            if kind == "failure":
                restarts.append(step)
            if kind == "failure" or load.graphs_compiled() != graphs_before:
                compiling.append(step)
            memory.append(_resident_mib())
    finally:
        gc.enable()
    counts = load.counts
    return {
        "rank": rank, "steps": dict(kinds), "generates": counts["generates"], "new_tokens": counts["new_tokens"],
        "mismatches": counts["mismatches"], "max_abs_diff": load.max_diff,
        "near_tie_partings": counts["near_tie_partings"],
        "refusals": {kind: counts[f"refused_{kind}"] for kind in REFUSALS},
        "refusal_mismatches": counts["refusal_mismatches"], "failure_mismatches": counts["failure_mismatches"],
        "first_errors": {check: repr(outcome)[:400] for check, outcome in load.first_errors.items()},
        "conversations": counts["conversations"], "restarts": len(restarts), "restart_steps": restarts,
        "graphs_compiled": load.graphs_compiled(), "replays": load.replays(),
        "seconds": time.perf_counter() - start,
        "memory_mib": {**_memory_summary(memory, warmup), **_between_compiles(memory, warmup, compiling)},
    }


def _between_compiles(memory: list[float], warmup: int, compiling: list[int]) -> dict:
    """Resident memory after the warm-up at the steps that compiled nothing and restarted nothing:
    the growth of the steps that did (`compiling`) taken out of the series, its growth and slope;
    and what those steps added."""
    compiled = set(compiling)
    level, steady, added = memory[warmup], [memory[warmup]], 0.0
    for step in range(warmup + 1, len(memory)):
        grown = memory[step] - memory[step - 1]
        if step in compiled:
            added += grown
        else:
            level += grown
        steady.append(level)
    return {"compiling_steps_after_warmup": sum(step > warmup for step in compiled),
            "added_by_compiling_steps": added,
            "growth_between_compiles": max(steady) - steady[0], "slope_between_compiles": _slope_per_100(steady)}


OUT = {("canonical", "cpu"): "bench/results/load_test_cpu.json",
       ("transformers", "cpu"): "bench/results/load_test_hf_cpu.json",
       ("transformers", "npu"): "bench/results/load_test_hf_npu_emulator.json"}
"""Where each workload's result goes by default (the npu one: on the emulated device)."""


def _passed(rank: dict, args) -> bool:
    """The rank's comparisons all agree and its memory is flat after the warm-up (for the
    transformers workload: at the steps that compile nothing, whose growth is reported apart)."""
    memory = rank["memory_mib"]
    transformers = args.front_end == "transformers"
    growth, slope = (("growth_between_compiles", "slope_between_compiles") if transformers else
                     ("growth_after_warmup", "slope_per_100_steps"))
    flat = memory[growth] <= args.max_growth_mib and (args.max_slope_mib is None or memory[slope] < args.max_slope_mib)
    if transformers:
        return flat and rank["mismatches"] == rank["refusal_mismatches"] == rank["failure_mismatches"] == 0
    return (flat and rank["mismatches"] == 0 and rank["argmax_flips"] == 0 and rank["isolation_mismatches"] == 0
            and rank["isolation_argmax_flips"] == 0)


def _summary(rank: dict) -> str:
    """One rank's line of the printed report."""
    mem = rank["memory_mib"]
    memory = (f"memory {mem['after_warmup']:.0f} -> {mem['end']:.0f} MiB after warm-up (growth "
              f"{mem['growth_after_warmup']:.1f} MiB, slope {mem['slope_per_100_steps']:.3f} MiB/100 steps")
    if "generates" not in rank:
        return (f"rank {rank['rank']}: {rank['forwards']} forwards ({rank['steps']}), {rank['mismatches']} mismatches, "
                f"{rank['argmax_flips']} argmax flips, max |diff| {rank['max_abs_diff']:.2e}, graphs {rank['graphs']} "
                f"(the last compiled at step {rank['last_compile_step']}); "
                f"against a fresh model per request ({rank['joins_into_a_used_slot']} joins into a used slot): "
                f"{rank['isolation_mismatches']} mismatches, {rank['isolation_argmax_flips']} argmax flips, max |diff| "
                f"{rank['isolation_max_abs_diff']:.2e}; {memory}), {rank['seconds']:.0f} s")
    return (f"rank {rank['rank']}: steps {rank['steps']}; {rank['generates']} generate() calls "
            f"({rank['new_tokens']} new tokens), {rank['mismatches']} mismatches against transformers "
            f"({rank['near_tie_partings']} rows parted at a near tie), max |diff| {rank['max_abs_diff']:.2e}; "
            f"refusals {rank['refusals']}, {rank['refusal_mismatches']} not refused alike; {rank['restarts']} restarts, "
            f"{rank['failure_mismatches']} failures not latched alike; {rank['graphs_compiled']} graphs compiled, "
            f"{rank['replays']} replays; {memory}; {mem['added_by_compiling_steps']:.1f} MiB of it at the "
            f"{mem['compiling_steps_after_warmup']} steps that compiled or restarted, between them growth "
            f"{mem['growth_between_compiles']:.1f} MiB, slope {mem['slope_between_compiles']:.3f} MiB/100 steps), "
            f"{rank['seconds']:.0f} s" + (f"; first errors {rank['first_errors']}" if rank["first_errors"] else ""))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--front-end", choices=("canonical", "transformers"), default="canonical",
                        help="the canonical-op model against dcp_size=1, or a transformers model against transformers")
    parser.add_argument("--device", choices=("cpu", "npu"), default="cpu",
                        help="npu: the transformers front end on the npu device (the emulated one without torch_npu)")
    parser.add_argument("--graphs", action="store_true", help="replay generate()'s decode steps from NPU graphs")
    parser.add_argument("--failure-rate", type=float, default=None,
                        help=f"the transformers workload's share of steps that inject a failure on one rank, each "
                             f"followed by a restart (default {FAILURE_RATE})")
    parser.add_argument("--restart", choices=tuple(RESTARTS), default=None,
                        help="what a restart after an injected failure does (transformers workload): "
                             + "; ".join(f"{name}: {text}" for name, text in RESTARTS.items()) + " (default fresh)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds a collective waits for a peer (the process group's timeout)")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=100, help="steps before memory must stay flat")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-growth-mib", type=float, default=32.0, help="most RSS growth after the warm-up")
    parser.add_argument("--max-slope-mib", type=float, default=None,
                        help="largest least-squares RSS slope after the warm-up, in MiB per 100 steps (checked only "
                             "when given: over a few hundred steps the slope is noise, up to 0.9 either way)")
    parser.add_argument("--out", default=None, help="the result's path (default: by workload, under bench/results)")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup} (>= 0): memory is checked over the steps "
                     "after the warm-up")
    if args.device == "npu" and args.front_end != "transformers":
        parser.error("--device npu runs the transformers front end: add --front-end transformers")
    if args.graphs and args.device != "npu":
        parser.error("--graphs replays NPU graphs: add --device npu")
    for name in ("failure_rate", "restart"):
        if getattr(args, name) is not None and args.front_end != "transformers":
            parser.error(f"--{name.replace('_', '-')} is the transformers workload's: add --front-end transformers")
    if args.failure_rate is not None and not 0 <= args.failure_rate <= 1:
        parser.error(f"--failure-rate {args.failure_rate} is a share of the steps, in [0, 1]")
    if args.front_end == "transformers":
        args.failure_rate = FAILURE_RATE if args.failure_rate is None else args.failure_rate
        args.restart = args.restart or "fresh"
    args.out = args.out or OUT[(args.front_end, args.device)]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    if args.front_end == "transformers":
        if args.device == "npu":
            if not devices.torch_npu_installed():
                os.environ[devices.EMULATOR_ENV] = "1"  # the ranks inherit it
            devices.require_torch_npu("bench.load_test --device npu")
        ranks = spawn(run_transformers_on_rank, 2, args.steps, args.warmup, args.seed, args.device, args.graphs,
                      args.failure_rate, args.restart, backend="hccl" if args.device == "npu" else "gloo", timeout=args.timeout)
    else:
        ranks = spawn(run_on_rank, 2, args.steps, args.warmup, args.seed, timeout=args.timeout)
    ok = all(_passed(rank, args) for rank in ranks)
    result = results.start("load_test", argv)
    if args.device == "npu":
        result["machine"]["device"] = ("emulated npu (stand-ins)" if devices.emulated_npu()
                                       else torch.npu.get_device_name(0))
    result["run"].update(front_end=args.front_end, device=args.device, graphs=args.graphs, steps=args.steps,
                         warmup=args.warmup, seed=args.seed, tolerance=TOLERANCE, max_growth_mib=args.max_growth_mib,
                         max_slope_mib=args.max_slope_mib, passed=ok, seconds=time.perf_counter() - start)
    if args.front_end == "transformers":
        result["run"].update(failure_rate=args.failure_rate, restart=args.restart)
    results.add(result, "ranks", *ranks)
    for rank in ranks:
        print(_summary(rank))
    print("PASS" if ok else "FAIL")
    if not args.no_save:
        results.write(result, args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
