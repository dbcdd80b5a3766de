"""End-to-end comparison of a DCP model against the same model at dcp_size=1.

Used by `dcp-compile demo` and the distributed tests. On every rank: build the reference model
twice with one seed (dcp_size=1 and dcp_size=N, same TP), prefill B requests of mixed lengths
(whole, or in chunks of C tokens: extend over a sharded prefix), then run decode or verify steps on
both in lockstep. Every batch carries padded rows that write to location 0.

With `checkpoint`, both models are load_pretrained() from that folder (a DeepSeek-V2/V3 or
Kimi-K2 checkpoint) instead of random presets, and `prompt_ids` can fix every request's prompt.

Verify uses a scripted draft model: the drafts and how many of them are accepted are drawn from
the seed, identically for both models, so accept/reject and the truncation that follows are
exercised with every length from 0 to k-1 accepted drafts; each model then commits the kept
tokens to its recurrent state (MLAModel.commit_verify).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dcp_compile import api
from dcp_compile.config import option_values
from dcp_compile.lowering import registry
from dcp_compile.models import hf_config
from dcp_compile.models.config import allowed_tp_sizes
from dcp_compile.models.mla import MLAModel
from dcp_compile.models.pretrained import load_pretrained
from dcp_compile.models.safetensors_reader import SafetensorsReader
from dcp_compile.runtime import layout, parallel
from dcp_compile.ops.targets import WINDOW_QUERIES
from dcp_compile.runtime.batch import RequestTable
from dcp_compile.runtime.graph_runner import GraphRunner, device_graphs
from dcp_compile.runtime.devices import emulated_npu, require_torch_npu
from dcp_compile.runtime.kv_pool import PoolSpec
from dcp_compile.runtime.launch import DEFAULT_TIMEOUT_S, check_timeout, spawn
from dcp_compile.workload import DTYPES, MODES, Workload

__all__ = ["MODES", "Scenario", "compare", "compare_torchrun", "half_precision_tolerance"]
TOLERANCE = 1e-5
"""fp32: the largest |logits(DCP) - logits(dcp_size=1)| that counts as a match."""
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11}


def half_precision_tolerance(dtype: str, mla_layers: int, logits_scale: float) -> float:
    """The match tolerance of a bf16/fp16 model, derived from where DCP rounds differently.

    DCP rounds each shard's partial attention output to the model dtype and rounds again after
    the merge, where dcp_size=1 rounds once: up to 2 unit roundoffs u per attention output. Each
    MLA layer adds its output to the residual stream, so a layer passes on up to 2u of the
    stream's scale, and the final norm and projection round once more each. Hence
    (2 * mla_layers + 2) * u * max|logits|: rounding, not a bug, below it.
    """
    return (2 * mla_layers + 2) * UNIT_ROUNDOFF[dtype] * logits_scale


@dataclass(frozen=True)
class Scenario(Workload):
    """A workload (dcp_compile.workload.Workload) run end to end on ranks, with its schedule."""

    contexts: tuple[int, ...] = (1, 3, 17, 64)
    steps: int = 8
    seed: int = 0
    pad_rows: int = 1
    kv_rows: int = 4096
    debug_checks: bool = True
    shared_prefix: int = 0
    """Request 1 shares request 0's first tokens (their page-table rows share locations)."""
    device: str = "cpu"
    """'cpu' (gloo ranks), 'cuda' (one GPU per rank, NCCL) or 'npu' (one Ascend NPU per rank, HCCL)."""
    timeout: float = DEFAULT_TIMEOUT_S
    """Seconds a collective waits for a stalled rank before the run fails."""
    checkpoint: str | None = None
    """A checkpoint folder (config.json + safetensors) whose weights both models load; `model`
    and `num_heads` are then unused, and `layers` loads the first layers only."""
    prompt_ids: tuple[int, ...] | None = None
    """Every request's prompt (token ids); None: random prompts of the `contexts` lengths."""
    graphs: bool = False
    """Replay every decode and verify step from captured device graphs (GraphRunner: CUDA graphs,
    NPU graphs); prefill and extend chunks run eagerly."""
    regions: bool = False
    """The DCP model's decoder layers are compile regions (MLAModel(regions=True)): its passes and
    inner compile run once per kind of layer. The dcp_size 1 baseline has none."""
    layer_types: tuple[str, ...] | None = None
    """The model's layer kinds ('mla' or 'linear', one per layer) in place of the preset's, e.g.
    ('mla', 'mla') for uniform MLA layers (not with `layers`); None keeps the preset's."""
    configured_at_dcp_size_one: bool = False
    """At dcp_size 1, the model under test takes the scenario's kernels, options, regions and inner
    compiler, against the baseline (its back end's defaults, no regions, eager); off, a dcp_size 1
    scenario builds both models alike (a check of TP alone)."""

    @property
    def device_type(self) -> str:
        return self.device

    def __post_init__(self):
        """Everything checkable is checked here, in the parent, before any rank starts."""
        if self.device not in ("cpu", "cuda", "npu"):
            raise ValueError(f"unknown device {self.device!r}; choose cpu, cuda or npu")
        if self.checkpoint is not None:
            object.__setattr__(self, "model", Path(self.checkpoint).name)
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if self.layers is not None or self.checkpoint is not None or not self.layer_types \
                    or not set(self.layer_types) <= {"mla", "linear"}:
                raise ValueError(f"layer_types must be a non-empty list of 'mla' and 'linear', given without layers "
                                 f"or a checkpoint; got {self.layer_types}")
        if self.configured_at_dcp_size_one and self.dcp_size != 1:
            raise ValueError("configured_at_dcp_size_one is for dcp_size 1 (a DCP model always takes the scenario's "
                             f"settings); got dcp_size {self.dcp_size}")
        super().__post_init__()
        check_timeout(self.timeout)
        for name in ("tp_size", "steps", "pad_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
        cfg = self.model_config()
        if self.prompt_ids is not None:
            ids = self.prompt_ids
            if not ids or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < cfg.vocab_size for t in ids):
                raise ValueError(f"prompt ids must be a non-empty list of token ids in [0, {cfg.vocab_size}) (the "
                                 f"model's vocab_size); got {list(ids)}")
        if self.checkpoint is not None:
            self._check_checkpoint()
        elif self.tp_size not in allowed_tp_sizes(cfg):
            raise ValueError(f"tp_size {self.tp_size} does not split model {self.model} ({cfg.num_heads} heads); "
                             f"allowed: {allowed_tp_sizes(cfg)}")
        if self.device == "npu":
            require_torch_npu("device='npu'")
        if self.steps < 0 or self.pad_rows < 0:
            raise ValueError("steps and pad_rows must be >= 0")
        if not self.contexts or min(self.contexts) < 1:
            raise ValueError(f"every context length must be >= 1, got {self.contexts}")
        self.check_layout()
        self._check_pages()
        self._check_capacity()
        if self.shared_prefix:
            lengths = self.lengths
            if self.batch < 2 or min(lengths[:2]) < self.shared_prefix or self.shared_prefix % self.pages:
                raise ValueError("shared_prefix needs 2 requests at least that long, and whole pages")
        parallel.validate_sizes(self.tp_size, self.dcp_size, self.tp_size)
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda needs a CUDA GPU, and torch finds none here "
                             "(torch.cuda.is_available() is False)")
        if self.graphs and self.device == "cpu":
            raise ValueError("--graphs replays device graphs: it needs --device cuda or npu")
        self._check_back_end()

    def _check_back_end(self) -> None:
        """The back end serves this device, widths, dtype and inner compiler ('auto' is resolved on
        the ranks where the device has several back ends), and the baseline's back end its pages."""
        self._check_baseline()
        if self.kernels == registry.AUTO and len(registry.auto_choices(self.device)) > 1:
            return
        cfg = self.model_config()
        pool = PoolSpec(torch.device(self.device), cfg.kv_lora_rank, cfg.qk_rope_head_dim, DTYPES[self.dtype], self.pages)
        lowering = self.lowering()
        reasons = lowering.unsupported_reasons(pool, self.config())
        if reasons:
            raise ValueError(f"--kernels {lowering.name}: {'; '.join(reasons)}")

    def _check_baseline(self) -> None:
        """The dcp_size=1 baseline's back end, with its options, reads the baseline's pages."""
        if self.baseline_kernels == registry.AUTO:
            return
        baseline = self.baseline_lowering()
        try:
            baseline.check_layout(self.pages_for(1), 1, 1)
        except ValueError as exc:
            raise ValueError(f"--block-size {self.block_size} does not suit the dcp_size=1 baseline "
                             f"(kernels={baseline.name!r}): {exc}") from None

    def _check_pages(self) -> None:
        """Both models' pages tile the pool (the KV pool and the request table need it)."""
        sets_pages = self.lowering().page_size(self.dcp_size, self.interleave, self.block_size) is not None
        for dcp_size in sorted({self.dcp_size, 1}, reverse=True):
            pages = self.pages_for(dcp_size)
            if self.kv_rows % pages == 0:
                continue
            if sets_pages:
                raise ValueError(f"block_size (--block-size) {self.block_size} makes pages of {pages} locations at "
                                 f"dcp_size {dcp_size}, which must divide the KV pool's {self.kv_rows} rows (kv_rows)")
            raise ValueError(f"page_size (--page-size, default the interleave) {pages} must divide the KV pool's "
                             f"{self.kv_rows} rows (kv_rows) and be a multiple of the interleave {self.interleave}")

    def _check_checkpoint(self) -> None:
        ckpt = hf_config.read_config(self.checkpoint)
        if self.num_heads is not None:
            raise ValueError("num_heads cannot be overridden for a checkpoint (its weights fix the heads)")
        if self.layers is not None and self.layers > ckpt.model.num_layers:
            raise ValueError(f"layers {self.layers} exceeds the checkpoint's num_hidden_layers {ckpt.model.num_layers}")
        hf_config.check_tp_size(ckpt, self.tp_size)
        try:
            with SafetensorsReader(ckpt.folder, ckpt.fp8_block):  # the weight files are all there
                pass
        except ImportError as exc:
            raise ValueError(str(exc)) from None

    def _check_capacity(self) -> None:
        """The dcp_size=1 baseline's pool (the smaller) must hold every request's whole context."""
        pages = self.pages_for(1)
        longest = self.max_context
        needed = self.batch * -(-longest // pages) * pages
        usable = self.kv_rows - pages
        if needed > usable:
            raise ValueError(f"the contexts need up to {needed} KV locations ({self.batch} requests of up to {longest} "
                             f"tokens); the pool holds {usable} (kv_rows {self.kv_rows})")

    @property
    def max_context(self) -> int:
        """The most tokens a request holds: its prompt, then 1 token a decode step, or k a verify
        step (the drafts a step rejects are released before the next)."""
        return max(self.lengths) + self.steps * (self.draft_len if self.mode == "verify" else 1)

    def tolerance(self, logits_scale: float) -> float:
        if self.dtype == "float32":
            return TOLERANCE
        return half_precision_tolerance(self.dtype, self.model_config().num_mla_layers, logits_scale)

    @property
    def lengths(self) -> list[int]:
        if self.prompt_ids is not None:
            return [len(self.prompt_ids)] * self.batch
        return [self.contexts[i % len(self.contexts)] for i in range(self.batch)]

    @property
    def model_name(self) -> str:
        return self.model

    @property
    def baseline_kernels(self) -> str:
        """The dcp_size=1 baseline's back end: the DCP model's own where its numerics differ from the
        reference's (Lowering.baseline), else the torch reference on the CPU and 'auto' on a device."""
        return self.lowering().baseline or ("torch" if self.device == "cpu" else registry.AUTO)

    @property
    def baseline_options(self) -> tuple:
        """The option values the baseline takes of `options`: those its back end's Options mark as
        facts of the deployment (Options.baseline_values; the NPU back end's fia_block_sizes, which
        its pages need). The options under test keep their defaults there: the baseline is the
        reference they are checked against."""
        return option_values(self.baseline_lowering().Options.baseline_values(self.options))

    def baseline_lowering(self):
        """The baseline's back end with its options (for 'auto', the one it falls back to here)."""
        name = self.baseline_kernels
        lowering = registry.get(name if name != registry.AUTO else registry.auto_choices(self.device)[-1])
        return lowering.configured(registry.options_for(lowering, lowering.Options.baseline_values(self.options)))

    def model_config(self):
        if self.checkpoint is not None:
            cfg = hf_config.read_config(self.checkpoint).model
            return cfg.with_layers(self.layers) if self.layers else cfg
        cfg = super().model_config()
        return cfg if self.layer_types is None else cfg.replace(layer_types=self.layer_types)


def request_prompts(scenario: Scenario, vocab: int) -> list[list[int]]:
    """Each request's prompt: the scenario's prompt_ids, or random ids of its context lengths."""
    if scenario.prompt_ids is not None:
        return [list(scenario.prompt_ids) for _ in range(scenario.batch)]
    gen = torch.Generator().manual_seed(scenario.seed)
    prompts = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in scenario.lengths]
    if scenario.shared_prefix:
        prompts[1][: scenario.shared_prefix] = prompts[0][: scenario.shared_prefix]
    return prompts


class Driver:
    """Feeds one model the scenario's schedule; records every logits tensor and generated token.

    A driver with a `leader` feeds its model the leader's greedy tokens (run the leader's step
    first): the two models then see the same inputs at every step, so a near-tie that rounding
    flips (bf16) is reported where it happens instead of changing every later step.
    """

    def __init__(self, model, scenario: Scenario, vocab: int, leader: "Driver | None" = None):
        self.model, self.scenario, self.vocab, self.leader = model, scenario, vocab, leader
        config = api.state(model).config
        self.table = RequestTable(scenario.batch, scenario.max_context, scenario.kv_rows,
                                  scenario.pages_for(config.dcp_size), dcp_size=config.dcp_size,
                                  interleave=config.interleave, vocab_size=vocab)
        self.logits: list[torch.Tensor] = []
        self.fed: list[list[int]] = [[] for _ in range(scenario.batch)]
        """The tokens fed back: the leader's where there is one."""
        self.generated: list[list[int]] = [[] for _ in range(scenario.batch)]
        """This model's own greedy tokens (and the accepted drafts), for the same inputs."""
        self.graph_keys: set[tuple] = set()
        """Distinct (tokens, rows, page-table width, strategy) of the steps run: one graph each."""
        self.runners: dict[str, GraphRunner] | None = {} if scenario.graphs else None
        """Per strategy, the graph runner that replays this model's decode and verify steps."""
        self.replays = 0
        self.replay_host_syncs: list[int] = []
        """Per replay of an already captured graph, the host syncs it made (where the back end's device counts them)."""
        self.replay_h2d_bytes: list[int] = []
        """Per such replay, the bytes the runner copied host-to-device."""

    def _step(self, requests, tokens, all_logits=False):
        if self.runners is not None and len({len(t) for t in tokens}) == 1 and len(tokens[0]) <= WINDOW_QUERIES:
            return self._replay(requests, tokens, all_logits)
        batch = self.table.extend_batch(requests, tokens, pad_rows=self.scenario.pad_rows, all_logits=all_logits)
        out = self.model(*batch.to(self.scenario.device).args(), host_metadata=batch.host)
        strategy = api.state(self.model).last_decision.strategy
        self.graph_keys.add((batch.input_ids.shape[0], *batch.req_to_token.shape, strategy))
        self.logits.append(out)
        return out

    def _replay(self, requests, tokens, all_logits):
        """One decode or verify step from a captured device graph; the runner pads the batch to its
        bucket with padded rows of its own."""
        batch = self.table.extend_batch(requests, tokens, all_logits=all_logits)
        decision = self.model.decide(*batch.to(self.scenario.device).args(), host_metadata=batch.host)
        if decision.strategy not in self.runners:
            state = api.state(self.model)
            self.runners[decision.strategy] = GraphRunner(
                self.model.compiled(decision.strategy), buckets=(1, 2, 4, 8, 16), debug=True,
                graphs=device_graphs(torch.device(self.scenario.device, 0)), host_slot=state.host_slot,
                watched=state.kv_pool.storage())
        runner = self.runners[decision.strategy]
        replaying = (runner.bucket_for(batch.rows), len(tokens[0]), batch.req_to_token.shape[1]) in runner.captured
        lowering = api.state(self.model).lowering
        syncs = _host_syncs(lowering)
        out = runner(batch, tokens_per_row=len(tokens[0]))
        if replaying:
            if syncs is not None:
                self.replay_host_syncs.append(_host_syncs(lowering) - syncs)
            self.replay_h2d_bytes.append(runner.h2d_bytes_last_step)
        self.model.check_errors()
        self.replays += 1
        state = api.state(self.model)
        state.strategy_counts[decision.strategy] += 1
        state.last_decision = decision
        self.graph_keys.add((batch.input_ids.shape[0], *batch.req_to_token.shape, decision.strategy))
        self.logits.append(out)
        return out

    def prefill(self, prompts):
        s = self.scenario
        pending = {b: list(p) for b, p in enumerate(prompts)}
        if s.shared_prefix:
            held = pending.pop(1)
        chunk = s.chunk if s.mode == "extend" and s.chunk else max(s.lengths)
        while pending:
            requests = sorted(pending)
            feed = [pending[b][:chunk] for b in requests]
            out = self._step(requests, feed)
            for row, b in enumerate(requests):
                pending[b] = pending[b][chunk:]
                if not pending[b]:
                    del pending[b]
                    self._generate(b, int(out[row].argmax()))
            if s.shared_prefix and 0 not in pending and 1 not in pending and held is not None:
                self.table.fork(0, 1, s.shared_prefix)
                pending[1], held = held[s.shared_prefix :], None

    def decode(self, step: int):
        requests = list(range(self.scenario.batch))
        out = self._step(requests, [[seq[-1]] for seq in self.fed])
        for b in requests:
            self._generate(b, int(out[b].argmax()))

    def verify(self, step: int):
        """k tokens per request: the last token and k-1 drafts; keep the scripted accepted ones."""
        s, k = self.scenario, self.scenario.draft_len
        gen = torch.Generator().manual_seed(s.seed * 7919 + step)
        drafts = torch.randint(1, self.vocab, (s.batch, k - 1), generator=gen).tolist()
        accepted = torch.randint(0, k, (s.batch,), generator=gen).tolist()
        requests = list(range(s.batch))
        out = self._step(requests, [[seq[-1]] + d for seq, d in zip(self.fed, drafts)], all_logits=True)
        kept = torch.tensor(accepted, dtype=torch.int64) + 1  # the last token and the accepted drafts
        self.model.model.commit_verify(self.table.state_slots(requests).to(out.device), kept.to(out.device))
        for b in requests:
            m = accepted[b]
            kept_len = int(self.table.seq_lens[b]) - k + 1 + m
            self.table.truncate(b, kept_len)
            self.fed[b].extend(drafts[b][:m])
            self.generated[b].extend(drafts[b][:m])
            self._generate(b, int(out[b * k + m].argmax()))

    def _generate(self, request: int, token: int) -> None:
        self.generated[request].append(token)
        if self.leader is not None:
            token = self.leader.fed[request][len(self.fed[request])]
        self.fed[request].append(token)


def run_on_rank(rank: int, world_size: int, scenario: Scenario) -> dict:
    torch.manual_seed(scenario.seed)
    device = torch.device(scenario.device, rank) if scenario.device != "cpu" else torch.device("cpu")
    cfg = scenario.model_config()
    tp = parallel.build(scenario.tp_size, 1)
    prompts = request_prompts(scenario, cfg.vocab_size)

    def make(dcp_size: int, under_test: bool):
        common = dict(kv_capacity=scenario.kv_rows, max_requests=scenario.batch, par=tp, device=device,
                      page_size=scenario.pages_for(dcp_size), dtype=getattr(torch, scenario.dtype))
        if scenario.checkpoint is not None:
            model = load_pretrained(scenario.checkpoint, num_layers=scenario.layers, **common)
        else:
            model = MLAModel(cfg, seed=scenario.seed, **common)
        configured = under_test and (dcp_size > 1 or scenario.configured_at_dcp_size_one)
        model.regions = scenario.regions and configured
        options = dict(scenario.options if configured else scenario.baseline_options)
        return api.apply(model, dcp_size, interleave=scenario.interleave if dcp_size > 1 else 1, **options,
                         debug_checks=scenario.debug_checks, attention_strategy=scenario.attention_strategy,
                         kernels=scenario.kernels if configured else scenario.baseline_kernels,
                         inner_compile=scenario.inner_compile if configured else "eager")

    start = time.perf_counter()
    base_driver = Driver(make(1, under_test=False), scenario, cfg.vocab_size)
    under_test = make(scenario.dcp_size, under_test=True)
    drivers = [base_driver, Driver(under_test, scenario, cfg.vocab_size, leader=base_driver)]
    for driver in drivers:
        driver.prefill(prompts)
    for step in range(scenario.steps):
        for driver in drivers:
            getattr(driver, "verify" if scenario.mode == "verify" else "decode")(step)
    base, dcp = drivers
    state = api.state(dcp.model)
    used = dcp.table.req_to_token[dcp.table.req_to_token != layout.PADDING_LOC].unique()
    owners = layout.owner(used, scenario.dcp_size, scenario.interleave)
    decision = state.last_decision
    counters = state.lowering.device_counters()
    return {
        "rank": rank,
        "argmax_flips": argmax_flips(base.logits, dcp.logits),
        "max_abs_diff": max((a - b).abs().max().item() for a, b in zip(base.logits, dcp.logits)),
        "max_rel_diff": max(((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(base.logits, dcp.logits)),
        "logits_scale": max(b.abs().max().item() for b in base.logits),
        "finite": all(bool(torch.isfinite(x).all()) for x in base.logits + dcp.logits),
        "tokens_stored": int((owners == state.parallel.dcp_rank).sum()),
        "tokens_total": int(used.numel()),
        "capacity": state.capacity.as_dict(),
        "inner_compile": state.config.inner_compile,
        "kv_layout": state.kv_pool.layout.name,
        "pass_summary": state.pass_summary(),
        "graphs": len(state.reports),
        "graph_replays": dcp.replays,
        "host_syncs_per_step": max(dcp.replay_host_syncs) if dcp.replay_host_syncs else None,
        "h2d_bytes_per_step": max(dcp.replay_h2d_bytes) if dcp.replay_h2d_bytes else None,
        "ops_off_device": None if counters is None else sorted(counters["ops_off_device"]),
        "collective_works_unwaited": torch._C._distributed_c10d._get_work_registry_size(),
        "backend_options": state.lowering.options_report(),
        "device_graphs": sum(len(runner.captured) for runner in (dcp.runners or {}).values()),
        "graph_keys": len(dcp.graph_keys),
        "strategy_counts": dict(state.strategy_counts),
        "last_strategy_reason": decision.reason if decision else None,
        "tokens": dcp.fed,
        "generated": dcp.generated,
        "seconds": time.perf_counter() - start,
    }


def _host_syncs(lowering) -> int | None:
    counters = lowering.device_counters()
    return None if counters is None else counters["host_syncs"]


def argmax_flips(base_logits: list[torch.Tensor], dcp_logits: list[torch.Tensor]) -> list[float]:
    """For every logits row whose greedy token differs between the two models: the baseline's
    margin between its token and the DCP model's (0 for a tie)."""
    margins = []
    for base, dcp in zip(base_logits, dcp_logits):
        base_top, dcp_top = base.argmax(dim=-1), dcp.argmax(dim=-1)
        for row in (base_top != dcp_top).nonzero().flatten().tolist():
            margins.append(float(base[row, base_top[row]] - base[row, dcp_top[row]]))
    return margins


def compare(scenario: Scenario) -> dict:
    """Spawn tp_size ranks (gloo on CPU, NCCL on CUDA, HCCL on NPUs), run the comparison, and
    summarise all ranks."""
    if scenario.device == "cuda" and torch.cuda.device_count() < scenario.tp_size:
        raise ValueError(f"--device cuda spawns one rank per GPU: --tp-size {scenario.tp_size} needs {scenario.tp_size} "
                         f"GPUs, this host has {torch.cuda.device_count()}")
    ranks = spawn(run_on_rank, scenario.tp_size, scenario, backend={"cuda": "nccl", "npu": "hccl"}.get(scenario.device, "gloo"),
                  timeout=scenario.timeout)
    return summarize(scenario, ranks)


def _run_all_on_rank(rank: int, world_size: int, scenarios: list[Scenario]) -> list[dict]:
    return [run_on_rank(rank, world_size, scenario) for scenario in scenarios]


def compare_all(scenarios: list[Scenario]) -> list[dict]:
    """compare() of each scenario, in order, with one spawn per (TP size, device): the ranks, their
    imports and warm-up are shared by the scenarios of a spawn (each still builds its own models
    and process groups). One failing scenario fails its whole spawn."""
    results: dict[int, dict] = {}
    groups: dict[tuple, list[int]] = {}
    for i, scenario in enumerate(scenarios):
        groups.setdefault((scenario.tp_size, scenario.device), []).append(i)
    for (tp_size, device), members in groups.items():
        group = [scenarios[i] for i in members]
        if device == "cuda" and torch.cuda.device_count() < tp_size:
            raise ValueError(f"--device cuda spawns one rank per GPU: tp_size {tp_size} needs {tp_size} GPUs")
        ranks = spawn(_run_all_on_rank, tp_size, group, backend={"cuda": "nccl", "npu": "hccl"}.get(device, "gloo"),
                      timeout=max(s.timeout for s in group))
        for j, i in enumerate(members):
            results[i] = summarize(scenarios[i], [per_rank[j] for per_rank in ranks])
    return [results[i] for i in range(len(scenarios))]


def compare_torchrun(scenario: Scenario) -> tuple[dict, int]:
    """The comparison on ranks a torchrun launch started (one node or several); every TP group
    of the world runs it. Returns (the summary of every rank, this rank)."""
    import torch.distributed as dist

    from dcp_compile.runtime.launch import init_from_env

    backend = {"cuda": "nccl", "npu": "hccl"}.get(scenario.device, "gloo")
    rank, world = init_from_env(backend, timeout=scenario.timeout)
    try:
        if world % scenario.tp_size:
            raise ValueError(f"the launch has {world} ranks, which tp_size {scenario.tp_size} does not divide")
        result = run_on_rank(int(os.environ.get("LOCAL_RANK", rank)) if scenario.device != "cpu" else rank, world, scenario)
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        # No rank tears its connections down while a peer may still be receiving: a gloo peer
        # that sees a connection reset mid-collective aborts its process.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return summarize(scenario, gathered), rank


def summarize(scenario: Scenario, ranks: list[dict]) -> dict:
    """One verdict from every rank's run_on_rank result."""
    head = ranks[0]
    max_abs_diff = max(r["max_abs_diff"] for r in ranks)
    tolerance = scenario.tolerance(max(r["logits_scale"] for r in ranks))
    flips = [margin for r in ranks for margin in r["argmax_flips"]]
    # Logits within `tolerance` of each other can swap two tokens only if the baseline's margin
    # between them is at most 2 x tolerance: such a flip is a near-tie, any other is a mismatch.
    return {
        "mode": scenario.mode,
        "dcp_size": scenario.dcp_size,
        "tp_size": scenario.tp_size,
        "interleave": scenario.interleave,
        "batch": scenario.batch,
        "contexts": scenario.lengths,
        "steps": scenario.steps,
        "tokens_match": all(margin <= 2 * tolerance for margin in flips),
        "near_tie_flips": len(head["argmax_flips"]),  # TP ranks share the logits: count one rank's
        "outputs_match": max_abs_diff < tolerance,
        "tolerance": tolerance,
        "kernels": scenario.kernels,
        "inner_compile": head["inner_compile"],
        "kv_layout": head["kv_layout"],
        "dtype": scenario.dtype,
        "max_abs_diff": max_abs_diff,
        "max_rel_diff": max(r["max_rel_diff"] for r in ranks),
        "finite": all(r["finite"] for r in ranks),
        "kv_capacity_ratio": head["capacity"]["capacity_ratio"],
        "kv_rows_per_rank": head["capacity"]["rows_per_rank"],
        "kv_rows_lost": head["capacity"]["rows_lost"],
        "tokens_stored_per_dcp_rank": [r["tokens_stored"] for r in ranks[: scenario.dcp_size]],
        "tokens_total": head["tokens_total"],
        "pass_summary": head["pass_summary"],
        "graphs_captured": head["graphs"],
        "device": scenario.device,
        "emulated": scenario.device == "npu" and emulated_npu(),
        "graph_replays": head["graph_replays"],
        **head["backend_options"],
        "host_syncs_per_step": max((r["host_syncs_per_step"] for r in ranks if r["host_syncs_per_step"] is not None),
                                   default=None),
        "ops_off_device": sorted({op for r in ranks for op in (r["ops_off_device"] or ())})
        if head["ops_off_device"] is not None else None,
        "h2d_bytes_per_step": head["h2d_bytes_per_step"],
        "collective_works_unwaited": max(r["collective_works_unwaited"] for r in ranks),
        "device_graphs_captured": head["device_graphs"],
        "graph_keys": head["graph_keys"],
        "strategy_counts": head["strategy_counts"],
        "last_strategy_reason": head["last_strategy_reason"],
        "tokens": head["tokens"],
        "generated": head["generated"],
        "seconds": max(r["seconds"] for r in ranks),
        "scenario": asdict(scenario),
    }
