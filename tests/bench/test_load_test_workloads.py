"""bench.load_test's workloads: which flags select which (the canonical-op model stays the
default), what each refuses before it spawns a rank, and the transformers workload's schedule
(every rank draws the same operations from one seed; sizes from the buckets where the back end
compiles per shape)."""

from __future__ import annotations

import collections

import pytest
import torch

from bench import load_test


@pytest.mark.parametrize("argv, message", [
    (["--device", "npu"], "--device npu runs the transformers front end"),
    (["--front-end", "transformers", "--graphs"], "--graphs replays NPU graphs"),
    (["--failure-rate", "0.1"], "--failure-rate is the transformers workload's"),
    (["--front-end", "transformers", "--failure-rate", "1.5"], "is a share of the steps"),
])
def test_a_flag_of_another_workload_is_refused_up_front(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_test.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_each_workload_writes_its_own_result_and_the_canonical_one_stays_the_default():
    canonical = load_test.parse_args([])
    assert (canonical.front_end, canonical.device, canonical.graphs, canonical.failure_rate) == ("canonical", "cpu",
                                                                                                 False, None)
    assert canonical.out == "bench/results/load_test_cpu.json"
    hf = load_test.parse_args(["--front-end", "transformers"])
    assert hf.out == "bench/results/load_test_hf_cpu.json" and hf.failure_rate == load_test.FAILURE_RATE
    npu = load_test.parse_args(["--front-end", "transformers", "--device", "npu", "--graphs", "--out", "x.json"])
    assert (npu.device, npu.graphs, npu.out) == ("npu", True, "x.json")
    assert load_test.parse_args(["--front-end", "transformers", "--device", "npu"]).out == \
        "bench/results/load_test_hf_npu_emulator.json"


def _plans(seed: int, steps: int, sizes=load_test.SIZES) -> list[tuple[str, dict]]:
    """A schedule's operations, with the live conversations a run would have."""
    schedule = load_test.TransformersSchedule(seed, 64, 0.05, sizes)
    live, plans = set(), []
    for _ in range(steps):
        kind, plan = schedule.next(sorted(live))
        plans.append((kind, plan))
        if kind == "turn":
            live.add(plan["conversation"])
        elif kind in ("release", "collect") and plan["conversation"] is not None:
            live.discard(plan["conversation"])
        elif kind == "failure":
            live.clear()
    return plans


def test_the_schedule_is_the_same_on_every_rank_and_draws_every_operation():
    plans = _plans(3, 600)
    assert plans == _plans(3, 600) and plans != _plans(4, 600)
    kinds = collections.Counter(kind for kind, _ in plans)
    assert set(kinds) == set(load_test.OPERATIONS) | {"failure"}
    refusals = {plan["refusal"] for kind, plan in plans if kind == "refusal"}
    assert refusals == set(load_test.REFUSALS)
    assert {plan["rank"] for kind, plan in plans if kind == "collect"} == {0, 1}  # each rank collects alone
    for kind, plan in plans:
        if kind == "refusal":
            assert 0 < plan["at"] < len(plan["prompt"]) - 1  # a hole inside the mask, not padding
        if kind == "failure":
            assert 1 <= plan["at"] <= plan["new_tokens"]  # one of the generate()'s steps
        if kind == "release":
            assert plan["conversation"] is not None


def test_sizes_come_from_the_buckets_where_each_shape_compiles_a_graph():
    buckets = load_test.BUCKETS
    for kind, plan in _plans(0, 400, buckets):
        if kind in ("generate", "own_cache"):
            assert {len(prompt) for prompt in plan["prompts"]} <= set(buckets["prompt"])
            assert plan["new_tokens"] in buckets["new_tokens"]
        if kind == "turn":
            assert len(plan["tokens"]) in buckets["turn_tokens"]


def test_prompts_of_different_lengths_are_left_padded_with_their_mask():
    input_ids, mask = load_test._batch([[5, 6, 7], [9]])
    assert input_ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    same, none = load_test._batch([[1, 2], [3, 4]])
    assert torch.equal(same, torch.tensor([[1, 2], [3, 4]])) and none is None
