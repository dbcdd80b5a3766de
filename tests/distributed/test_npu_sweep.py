"""A combination sweep of the NPU lowering (kernels='npu') on the emulated npu device, in bf16: every
case against the same model at dcp_size 1 under the back end's defaults, without regions.

The sweep is data: AXES, the cross product of their values less EXCLUSIONS (each with its reason),
is CASES. The default run takes SAMPLE, a greedy pairwise cover of CASES (every pair of values of
two axes that some case has, in at least one sampled case; deterministic: the case that covers the
most uncovered pairs, the cheapest of those, the earliest); the rest are `matrix` cases
(tests/conftest.py; README "Test tiers" gives both runs' cases and times).

Front ends and their comparisons:
- canonical: MLAModel through the harness (dcp_compile/harness/scenario.py): the Scenario's
  dcp_size 1 baseline (default options, no regions; with graphs, replayed too) and the model under
  test fed the same tokens; logits within half_precision_tolerance, greedy tokens equal but at
  near-ties; with graphs, every decode or verify step replayed. DCP 2 on 2 ranks (the sampled cases
  in the shared npu spawn), dcp_size 1 in this process (Scenario.configured_at_dcp_size_one).
- transformers: a tiny transformers model with FIA's widths (R 512, P 64) through apply() and
  generate(), against the same model applied at dcp_size 1 with the defaults, eager (no regions,
  no graphs): tokens equal, logits within half_precision_tolerance. Graphs replay generate()'s
  decode steps (capture_decode_graphs); its prompt of 2 rows of 5 tokens is a step of equal short
  rows, which npu_verify='mask' serves with the masked FIA. DCP 2 on 2 ranks of a spawn of its own,
  dcp_size 1 in this process.

Model shapes: uniform MLA layers (2); dense then MoE, two kinds of layer (tiny-512-moe: 3 layers;
DeepSeek-V3 tiny with first_k_dense_replace=1, 3 layers); hybrid KDA + MLA (tiny-512's linear
layer: mla, linear, mla; transformers' Kimi-Linear tiny: 2 KDA and 2 MLA layers, dense MLPs since
its MoE routing counts with an integer histc the emulator's CPU kernels lack).

The block size is not an axis: NZ needs FIA blocks of 128, and ND runs blocks of 16 so that short
rows cross blocks (ND at 128: test_npu_a5_options.py). Canonical rows: 1, 3 (empty shards) and 40
(blocks of 16) or 300 (blocks of 128: over a block on each rank at DCP 2), and a padded row.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import asdict, dataclass

import pytest
import torch

from dcp_compile.harness.scenario import Scenario, half_precision_tolerance, run_on_rank, summarize
from dcp_compile.runtime.launch import spawn

pytestmark = pytest.mark.usefixtures("npu_emulator")  # tests/conftest.py: the ranks inherit it


@dataclass(frozen=True)
class Case:
    front_end: str
    model: str
    step: str
    regions: bool
    graphs: bool
    kv_format: str
    fia_version: int
    verify: str
    dcp_size: int

    @property
    def id(self) -> str:
        return "-".join([self.front_end, self.model, self.step, "regions" if self.regions else "layers",
                         "graphs" if self.graphs else "eager", self.kv_format, f"v{self.fia_version}", self.verify,
                         f"dcp{self.dcp_size}"])

    @property
    def defaults(self) -> bool:
        """The back end's default options, no regions: the baseline's own settings."""
        return (self.kv_format, self.fia_version, self.verify, self.regions) == ("nd", 1, "split", False)

    @property
    def block_size(self) -> int:
        return 128 if self.kv_format == "nz" else 16

    @property
    def options(self) -> dict:
        return dict(npu_kv_format=self.kv_format, fia_version=self.fia_version, npu_verify=self.verify)


AXES = dict(front_end=("canonical", "transformers"), model=("uniform", "dense-then-moe", "hybrid"),
            step=("decode", "verify"), regions=(False, True), graphs=(False, True), kv_format=("nd", "nz"),
            fia_version=(1, 2), verify=("split", "mask"), dcp_size=(1, 2))
EXCLUSIONS = [
    (lambda c: c.front_end == "transformers" and c.step == "verify",
     "the transformers front end runs generate(): a prefill, then decode steps (its graphs replay those)"),
    (lambda c: c.front_end == "canonical" and c.step == "decode" and c.verify == "mask",
     "a decode step reads no verify scheme, and the canonical prefill's rows are of unequal lengths, which "
     "npu_verify='mask' runs under the split (the transformers prompt's equal rows keep it)"),
    (lambda c: c.front_end == "canonical" and c.dcp_size == 1 and c.defaults,
     "the baseline itself (with graphs, the baseline replays them too)"),
    (lambda c: c.front_end == "transformers" and c.dcp_size == 1 and c.defaults and not c.graphs,
     "the baseline itself"),
]
CASES = [case for case in itertools.starmap(Case, itertools.product(*AXES.values()))
         if not any(excluded(case) for excluded, _ in EXCLUSIONS)]


def cost(case: Case) -> float:
    """A case's rough cost, relative to a canonical one in this process (the transformers front end
    compiles a prefill and a decode graph per model, Kimi-Linear's KDA layers more; DCP 2 runs 2 ranks
    on the machine's 2 cores)."""
    if case.front_end == "canonical":
        return 1.5 if case.dcp_size == 2 else 1.0
    return (3.0 if case.model == "hybrid" else 2.0) * (2 if case.dcp_size == 2 else 1)


def pairwise_sample(cases: list[Case]) -> list[Case]:
    """A greedy pairwise cover of `cases`, deterministic: the case that covers the most uncovered
    pairs, of those the cheapest, of those the earliest."""
    def pairs(case: Case) -> set:
        values = asdict(case)
        return {((a, values[a]), (b, values[b])) for a, b in itertools.combinations(AXES, 2)}

    uncovered = set().union(*map(pairs, cases))
    sample = []
    while uncovered:
        best = max(cases, key=lambda case: (len(pairs(case) & uncovered), -cost(case)))
        sample.append(best)
        uncovered -= pairs(best)
    return sample


SAMPLE = pairwise_sample(CASES)


def params(front_end: str, dcp_size: int) -> list:
    """pytest params of the cases of one front end and DCP size: the sampled ones, then `matrix`."""
    chosen = [case for case in CASES if (case.front_end, case.dcp_size) == (front_end, dcp_size)]
    return [pytest.param(case, id=case.id, marks=() if case in SAMPLE else pytest.mark.matrix)
            for case in sorted(chosen, key=lambda case: case not in SAMPLE)]


# --- The canonical-op model (the harness's Scenario) -----------------------------------------------

CANONICAL_MODELS = {"uniform": dict(model="tiny-512", layer_types=("mla", "mla")),
                    "dense-then-moe": dict(model="tiny-512-moe"), "hybrid": dict(model="tiny-512", layers=3)}


def scenario_arguments(case: Case) -> dict:
    step = dict(mode="verify", draft_len=4) if case.step == "verify" else {}
    at_dcp1 = dict(configured_at_dcp_size_one=True) if case.dcp_size == 1 else {}
    return dict(kernels="npu", dtype="bfloat16", device="npu", batch=3, steps=2, seed=31,
                contexts=(1, 3, 300 if case.block_size == 128 else 40), block_size=case.block_size,
                dcp_size=case.dcp_size, tp_size=case.dcp_size, regions=case.regions, graphs=case.graphs,
                options=tuple(sorted(case.options.items())), **CANONICAL_MODELS[case.model], **step, **at_dcp1)


NPU_SCENARIOS = [scenario_arguments(case) for case in SAMPLE if case.front_end == "canonical" and case.dcp_size == 2]
"""Run by tests/conftest.py, in one spawn per TP size with the other modules' cases."""


def check_canonical(case: Case, result: dict) -> None:
    scenario = Scenario(**scenario_arguments(case))
    assert result["emulated"] and result["device"] == "npu" and result["finite"]
    assert result["outputs_match"] and result["max_abs_diff"] < result["tolerance"], result["max_abs_diff"]
    assert result["tokens_match"]
    assert sum(result["tokens_stored_per_dcp_rank"]) == result["tokens_total"]
    assert result["kv_layout"] == ("nz" if case.kv_format == "nz" else "split")
    summary, graphs = result["pass_summary"], result["graphs_captured"]
    assert summary["lower_native_kernels"] > 0
    # Per graph, an FIA site (and at DCP 2 a merge) per MLA layer, or with regions per kind of MLA
    # layer (one or two), fewer than its MLA layers.
    per_layer = graphs * scenario.model_config().num_mla_layers * (2 if case.dcp_size > 1 else 1)
    assert summary["lower_npu_attention"] < per_layer if case.regions else \
        summary["lower_npu_attention"] == per_layer, (summary["lower_npu_attention"], per_layer)
    if case.graphs:
        assert result["graph_replays"] == scenario.steps and result["device_graphs_captured"] == 1
        assert result["host_syncs_per_step"] == 0 and result["ops_off_device"] == []
    else:
        assert result["graph_replays"] == 0


@pytest.mark.parametrize("arguments", [pytest.param(scenario_arguments(case), id=case.id) for case in SAMPLE
                                       if case.front_end == "canonical" and case.dcp_size == 2])
def test_sampled_canonical_case_at_dcp_two_matches_dcp_size_one(arguments, npu_scenario_results):
    (case,) = [case for case in SAMPLE if scenario_arguments(case) == arguments]
    check_canonical(case, npu_scenario_results[Scenario(**arguments)])


@pytest.mark.parametrize("case", [param for param in params("canonical", 2) if param.values[0] not in SAMPLE])
def test_canonical_case_at_dcp_two_matches_dcp_size_one(case, spawned):
    check_canonical(case, spawned[case])


@pytest.mark.parametrize("case", params("canonical", 1))
def test_canonical_case_at_dcp_size_one_matches_the_defaults(case):
    scenario = Scenario(**scenario_arguments(case))
    check_canonical(case, summarize(scenario, [run_on_rank(0, 1, scenario)]))


# --- The transformers front end ------------------------------------------------------------------

FIA_WIDTHS = dict(kv_lora_rank=512, qk_rope_head_dim=64)
TRANSFORMERS_MODELS = {
    "uniform": dict(num_hidden_layers=2, first_k_dense_replace=2),
    "dense-then-moe": dict(num_hidden_layers=3, first_k_dense_replace=1, experts_implementation="batched_mm"),
    "hybrid": dict(family="kimi-linear", mlp_layer_types=["dense"] * 4),
}
TRANSFORMERS_MLA_LAYERS = {"uniform": 2, "dense-then-moe": 3, "hybrid": 2}
NEW_TOKENS = 4
"""A prefill and 3 decode steps: with graphs, the first captures and the next two replay."""


def transformers_model(name: str):
    from tests.hf.models import tiny_model

    return tiny_model(**TRANSFORMERS_MODELS[name], **FIA_WIDTHS).to(torch.bfloat16)


def _generate(model, device, input_ids) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = model.generate(input_ids.to(device), max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences.cpu(), torch.stack(out.logits, 1).float().cpu()


_BASELINES: dict[str, tuple] = {}
"""Per model shape, the dcp_size 1 baseline's generate() in this process."""


def run_transformers(case: Case) -> dict:
    """generate() of the case's model applied as the case says, and of its dcp_size 1 baseline (plain values)."""
    import dcp_compile
    from tests.hf.models import available, prompt

    if case.model == "hybrid" and not available("kimi-linear"):
        return dict(skipped="kimi_linear is not in this transformers")
    device = torch.device("npu", torch.npu.current_device())
    reference = transformers_model(case.model)
    input_ids = prompt(vocab=reference.config.vocab_size)
    if case.model not in _BASELINES:
        baseline = dcp_compile.apply(copy.deepcopy(reference).to(device), dcp_size=1, kernels="npu", block_size=16,
                                     kv_capacity=1024)
        _BASELINES[case.model] = _generate(baseline, device, input_ids)
    model = dcp_compile.apply(copy.deepcopy(reference).to(device), dcp_size=case.dcp_size, kernels="npu",
                              block_size=case.block_size, kv_capacity=1024, regions=case.regions, **case.options)
    if case.graphs:
        model.capture_decode_graphs(batch_sizes=(input_ids.shape[0],), max_length=64)
    (want_tokens, want_logits), (got_tokens, got_logits) = _BASELINES[case.model], _generate(model, device, input_ids)
    state = dcp_compile.state(model)
    return dict(tokens_equal=bool(torch.equal(got_tokens, want_tokens)), finite=bool(torch.isfinite(got_logits).all()),
                max_logit_diff=float((got_logits - want_logits).abs().max()),
                logits_scale=float(want_logits.abs().max()), lowering=state.lowering.name,
                kv_layout=state.kv_pool.layout.name, replays=model.decode_graphs.replays if case.graphs else 0)


def check_transformers(case: Case, result: dict) -> None:
    if "skipped" in result:
        pytest.skip(result["skipped"])
    assert result["lowering"] == "npu" and result["finite"]
    assert result["kv_layout"] == ("nz" if case.kv_format == "nz" else "split")
    tolerance = half_precision_tolerance("bfloat16", TRANSFORMERS_MLA_LAYERS[case.model], result["logits_scale"])
    assert result["tokens_equal"], result
    assert result["max_logit_diff"] < tolerance, (result, tolerance)
    assert result["replays"] == (NEW_TOKENS - 1 if case.graphs else 0)


@pytest.mark.parametrize("case", params("transformers", 1))
def test_transformers_case_at_dcp_size_one_matches_the_defaults(case):
    check_transformers(case, run_transformers(case))


@pytest.mark.parametrize("case", params("transformers", 2))
def test_transformers_case_at_dcp_two_matches_dcp_size_one(case, spawned):
    check_transformers(case, spawned[case])


# --- The spawns of this module's own cases ----------------------------------------------------------

CHUNK = 12
"""Cases a spawn runs: the matrix runs its DCP 2 cases over several spawns, each reporting as it ends."""


def rank_runs(rank: int, world: int, cases: list[Case]) -> list[dict]:
    """Each case on this rank; an error is that case's result, not its spawn's (a peer that raised
    later or not at all meets it as a collective's timeout, and the next case starts afresh)."""
    results = []
    for case in cases:
        try:
            if case.front_end == "canonical":
                results.append(dict(result=run_on_rank(rank, world, Scenario(**scenario_arguments(case)))))
            else:
                results.append(dict(result=run_transformers(case)))
        except Exception as exc:  # noqa: BLE001 - reported as the case's failure
            results.append(dict(error=f"{type(exc).__name__}: {exc}"[:4000]))
    return results


class Spawned:
    """The selected DCP 2 cases of this module's own spawns, run CHUNK at a time as tests ask."""

    def __init__(self, cases: list[Case]):
        self.pending, self.results = list(cases), {}

    def __getitem__(self, case: Case) -> dict:
        if case not in self.results:
            chunk = [case] + [other for other in self.pending if other != case and other.front_end == case.front_end]
            chunk = chunk[:CHUNK]
            ranks = spawn(rank_runs, 2, chunk, backend="hccl")
            for i, ran in enumerate(chunk):
                self.pending.remove(ran)
                self.results[ran] = [per_rank[i] for per_rank in ranks]
        per_rank = self.results[case]
        errors = [ran["error"] for ran in per_rank if "error" in ran]
        if errors:
            pytest.fail(f"{case.id} raised: {errors[0]}", pytrace=False)
        if case.front_end == "canonical":
            return summarize(Scenario(**scenario_arguments(case)), [ran["result"] for ran in per_rank])
        for ran in per_rank[1:]:
            check_transformers(case, ran["result"])
        return per_rank[0]["result"]


@pytest.fixture(scope="module")
def spawned(request) -> Spawned:
    selected = [item.callspec.params["case"] for item in request.session.items
                if item.module is request.module and "spawned" in item.fixturenames]
    return Spawned(selected)
