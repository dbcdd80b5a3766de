"""The model contract holds for a model of the tests' own (tests/contract/model.py): an outer
torch.compile keeps DCP on, q_rope in fp32 keeps every dtype, cache access outside the canonical
ops and stale cache tensors are errors that name the op and the line, the original module cannot
run after apply, ranks given different batches get a clear error, and a scheduler that never pads
compiles a few graphs over 500 distinct prefill lengths, equal to dcp_size=1 at every step. DCP 2 runs in one spawn of two gloo ranks."""

from __future__ import annotations

import random

import pytest
import torch

import dcp_compile
from dcp_compile.passes.cache_use import CacheMisuseError
from dcp_compile.runtime.batch import RequestTable
from dcp_compile.runtime.launch import spawn
from tests.contract.model import ContractModel, step_args
from tests.contract.stateful import StatefulModel, expected_state, new_state, observed_state, run_steps

PREFILLS = 500
"""Distinct prefill lengths, 1..PREFILLS: over 150 batch shapes. The reference attention's time grows as
PREFILLS cubed (1,000 lengths cost 8 times as much, in the same few graphs)."""


def one_step(model, table_rows=4, tokens=([1, 2, 3], [4])):
    table = RequestTable(table_rows, 32, 512)
    batch = table.extend_batch(list(range(len(tokens))), [list(t) for t in tokens], pad_rows=1)
    return model(*step_args(batch))


def run_prefills(model, reference, capacity: int, seed: int = 0, bucket: bool = False) -> dict:
    """Prefills of PREFILLS distinct lengths (1..PREFILLS, shuffled) in batches of 1 to 4 rows,
    never padded (or bucketed), on `model` and `reference` in lockstep over one request table;
    each request is freed after its step. Returns the distinct batch shapes run, the largest
    logits difference and whether every logit was finite."""
    rng = random.Random(seed)
    lengths = list(range(1, PREFILLS + 1))
    rng.shuffle(lengths)
    table = RequestTable(4, PREFILLS, capacity)
    shapes, max_diff, finite = set(), 0.0, True
    while lengths:
        rows = min(rng.randint(1, 4), len(lengths))
        batch_lengths, lengths = lengths[:rows], lengths[rows:]
        batch = table.extend_batch(list(range(rows)), [[1 + n % 50] * n for n in batch_lengths], bucket=bucket)
        shapes.add((batch.input_ids.shape[0], batch.rows))
        logits, expected = model(*step_args(batch)), reference(*step_args(batch))
        max_diff = max(max_diff, (logits - expected).abs().max().item())
        finite = finite and bool(torch.isfinite(logits).all())
        for request in range(rows):
            table.truncate(request, 0)
    return {"shapes": len(shapes), "max_diff": max_diff, "finite": finite}


# --- dcp_size 1, in this process -------------------------------------------------------------


def test_outer_torch_compile_runs_dcp_compile():
    reference, model = ContractModel(), dcp_compile.apply(ContractModel(), 1)
    outer = torch.compile(model, backend="eager")
    assert torch.equal(one_step(outer), one_step(reference))
    assert len(dcp_compile.state(model).reports) == 1  # DCP's backend captured the graph


def test_outer_compile_of_a_wrapper_runs_dcp_or_says_why_not():
    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args):
            return self.inner(*args) * 2

    reference, model = ContractModel(), dcp_compile.apply(ContractModel(), 1)
    assert torch.equal(one_step(torch.compile(model, backend="eager", fullgraph=True)), one_step(reference))
    with pytest.raises(Exception, match="dcp_compile runs its own compile"):
        one_step(torch.compile(Wrapper(model), backend="eager", fullgraph=True))
    torch._dynamo.reset()
    assert torch.equal(one_step(torch.compile(Wrapper(model), backend="eager")), 2 * one_step(ContractModel()))


def test_the_original_module_cannot_run_after_apply():
    original = ContractModel()
    model = dcp_compile.apply(original, 1)
    with pytest.raises(RuntimeError, match="call the module apply\\(\\) returned"):
        one_step(original)
    assert torch.isfinite(one_step(model)).all()


def test_apply_twice_and_dcp_without_distributed():
    model = dcp_compile.apply(ContractModel(), 1)
    with pytest.raises(ValueError, match="already applied"):
        dcp_compile.apply(model, 1)
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        dcp_compile.apply(ContractModel(), 2)


@pytest.mark.parametrize("misuse, op", [("read", "getitem"), ("write", "setitem")])
def test_cache_access_outside_the_canonical_ops_is_an_error(misuse, op):
    model = dcp_compile.apply(ContractModel(misuse=misuse), 1)
    with pytest.raises(CacheMisuseError, match=f"used by {op} at File .*contract/model.py\", line \\d+"):
        one_step(model)


def test_cache_tensors_kept_from_before_apply_are_an_error():
    model = dcp_compile.apply(ContractModel(keep_caches=True), 1)
    with pytest.raises(CacheMisuseError, match="not one of the KV pool's current buffers"):
        one_step(model)


def test_out_of_pool_location_names_the_location_and_range():
    model = dcp_compile.apply(ContractModel(capacity=64), 1)
    table = RequestTable(2, 32, 64)
    batch = table.extend_batch([0], [[1, 2]])
    batch.out_loc[1] = 64
    with pytest.raises(IndexError, match="location 64 is outside the pool: valid locations are 1..63"):
        model(*step_args(batch))


MAX_PREFILL_GRAPHS = 8


def test_unpadded_prefills_of_500_lengths_compile_a_few_graphs_at_dcp_size_one():
    """A scheduler that never pads: every prefill a new token count, all served by a few
    symbolic-shape graphs, each output equal to the eager model's."""
    model = dcp_compile.apply(ContractModel(layers=1, capacity=8192, heads=2), 1)
    result = run_prefills(model, ContractModel(layers=1, capacity=8192, heads=2), 8192)
    assert result["shapes"] > 150 and result["finite"]
    assert len(dcp_compile.state(model).reports) <= MAX_PREFILL_GRAPHS
    assert result["max_diff"] < 1e-5


# --- dcp_size 2: one spawn of two gloo ranks --------------------------------------------------


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as exc:  # reported to the test, which asserts on it
        return (type(exc).__name__, str(exc))


def _dcp_two(rank: int, world: int) -> dict:
    results = {}

    def outer_compile():
        reference = dcp_compile.apply(ContractModel(tp_size=2), 1)
        model = dcp_compile.apply(ContractModel(tp_size=2), 2)
        got, expected = one_step(torch.compile(model, backend="eager")), one_step(reference)
        pool = dcp_compile.state(model).kv_pool
        return {"max_diff": (got - expected).abs().max().item(), "dcp_graphs": len(dcp_compile.state(model).reports),
                "rows_per_rank": pool.rows_per_rank, "pass_summary": dcp_compile.state(model).pass_summary()}

    def mixed_dtypes(strategy):
        def run():
            kwargs = dict(tp_size=2, dtype=torch.bfloat16, rope_in_fp32=True)
            reference = dcp_compile.apply(ContractModel(**kwargs), 1)
            model = dcp_compile.apply(ContractModel(**kwargs), 2, attention_strategy=strategy)
            got, expected = one_step(model), one_step(reference)
            return {"dtype": str(got.dtype), "max_diff": (got - expected).abs().max().item(),
                    "scale": expected.abs().max().item()}
        return run

    def different_batches():
        model = dcp_compile.apply(ContractModel(tp_size=2), 2)
        return one_step(model, tokens=([1, 2, 3], [4]) if rank == 0 else ([1, 2], [4], [5]))

    results["outer_compile"] = _outcome(outer_compile)
    results["mixed_gather_q"] = _outcome(mixed_dtypes("gather-q"))
    results["mixed_gather_kv"] = _outcome(mixed_dtypes("gather-kv"))
    results["misuse"] = _outcome(lambda: one_step(dcp_compile.apply(ContractModel(tp_size=2, misuse="read"), 2)))
    def state_updates():
        reference, reference_state = dcp_compile.apply(StatefulModel(tp_size=2), 1), new_state()
        model, state = dcp_compile.apply(StatefulModel(tp_size=2), 2), new_state()
        expected, got = run_steps(reference, reference_state), run_steps(model, state)
        return {"state": observed_state(model, state), "reference_state": observed_state(reference, reference_state),
                "max_diff": max((a - b).abs().max().item() for a, b in zip(got, expected))}

    def entry_outside_the_pool():
        model = dcp_compile.apply(ContractModel(tp_size=2), 2)
        batch = RequestTable(2, 32, 512).extend_batch([0, 1], [[1, 2, 3], [4]])
        batch.req_to_token[0, 1] = 5000  # past the DCP 2 pool's 1024 locations: rank 0 would own it
        return model(*step_args(batch))

    results["different_batches"] = _outcome(different_batches)
    results["entry_outside_the_pool"] = _outcome(entry_outside_the_pool)
    results["state_updates"] = _outcome(state_updates)
    model = dcp_compile.apply(ContractModel(layers=1, tp_size=2, capacity=8192, heads=2), 2)
    reference = dcp_compile.apply(ContractModel(layers=1, tp_size=2, capacity=8192, heads=2), 1)
    prefills = run_prefills(model, reference, 8192)
    results["prefills"] = ("ok", {**prefills, "graphs": len(dcp_compile.state(model).reports),
                                  "reference_graphs": len(dcp_compile.state(reference).reports)})
    return results


@pytest.fixture(scope="module")
def dcp_two():
    return spawn(_dcp_two, 2)


def test_outer_torch_compile_keeps_dcp_on(dcp_two):
    for rank in dcp_two:
        status, result = rank["outer_compile"]
        assert status == "ok", result
        assert result["max_diff"] < 1e-5 and result["dcp_graphs"] == 1
        assert result["pass_summary"]["gather_q_attention"] + result["pass_summary"]["gather_kv_attention"] == 2


def test_fp32_rope_keeps_every_dtype_under_both_strategies(dcp_two):
    for rank in dcp_two:
        for strategy in ("mixed_gather_q", "mixed_gather_kv"):
            status, result = rank[strategy]
            assert status == "ok", result
            assert result["dtype"] == "torch.float32"  # the model's logits, as at dcp_size 1
            assert result["max_diff"] <= 2 ** -8 * 6 * result["scale"]  # bf16 rounding (scenario.half_precision_tolerance)


def test_cache_misuse_is_an_error_at_dcp_two(dcp_two):
    for rank in dcp_two:
        status, message = rank["misuse"]
        assert status == "CacheMisuseError" and "contract/model.py" in message


def test_ranks_given_different_batches_get_a_clear_error(dcp_two):
    for rank in dcp_two:
        status, message = rank["different_batches"]
        assert status == "ValueError" and "same step with the same batch" in message


def test_a_page_table_entry_outside_the_pool_fails_every_rank_at_dcp_two(dcp_two):
    for rank in dcp_two:
        status, message = rank["entry_outside_the_pool"]
        assert status == "IndexError" and r"page-table entry [0, 1] is 5000" in message, message


def test_state_updates_survive_at_dcp_two(dcp_two):
    for rank in dcp_two:
        status, result = rank["state_updates"]
        assert status == "ok", result
        assert result["state"] == result["reference_state"] == expected_state()
        assert result["max_diff"] < 1e-5


def test_unpadded_prefills_of_500_lengths_compile_a_few_graphs_at_dcp_two(dcp_two):
    for rank in dcp_two:
        result = rank["prefills"][1]
        assert result["shapes"] > 150 and result["finite"]
        assert result["graphs"] <= MAX_PREFILL_GRAPHS and result["reference_graphs"] <= MAX_PREFILL_GRAPHS
        assert result["max_diff"] < 1e-5
