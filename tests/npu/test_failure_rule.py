"""The failure rule on 2 ranks of the emulated npu device (native NPU lowering, DCP 2, emulated
HCCL), for a model written against the canonical ops (docs/failures.md):

- a step that FIA's TND layout cannot take (over 4096 pieces of 16 queries) is refused at compile
  time, alike on every rank, before any collective: the model serves the next step, and its
  logits are dcp_size=1's;
- decode steps replayed from NPU graphs by a GraphRunner: rank 1 fails one replay on the host,
  before the replay; from then on every call of rank 1 raises the latch's error, and rank 0,
  whose replay waits for rank 1 in a collective, fails at the group's timeout and latches too.
  Neither rank replays again: before, rank 1 went on and both ranks' logits were off by 2.6-3.1
  for the next steps, with no error.
"""

from __future__ import annotations

import pytest
import torch

import dcp_compile
from dcp_compile.harness.scenario import half_precision_tolerance
from dcp_compile.models.mla import MLAModel
from dcp_compile.runtime.batch import RequestTable
from dcp_compile.runtime.graph_runner import GraphRunner, device_graphs
from dcp_compile.runtime.launch import spawn
from tests.npu.models import TINY_512

TIMEOUT_S = 30.0
PAGE = 16
"""FIA's block: a page of PAGE rows on each rank."""
CAPACITY = 70_016
"""Logical KV locations: room for a refused prefill of LONG tokens (its pieces are counted at compile time)."""
LONG = 16 * 4097 + 1
"""A prefill of one row that cuts into 4098 pieces of 16 queries: over FIA's 4096."""
LATCHED = "an earlier step failed"


def _outcome(call) -> tuple:
    try:
        return ("ok", call())
    except Exception as exc:  # the error each rank met, asserted by the tests
        return (type(exc).__name__, str(exc).splitlines()[0])


def failure_rule_steps(rank: int, world: int) -> dict:
    device = torch.device("npu", torch.npu.current_device())
    models = {size: dcp_compile.apply(MLAModel(TINY_512, CAPACITY, max_requests=4, dtype=torch.bfloat16,
                                               page_size=PAGE * size,
                                               device=device), size, kernels="npu")
              for size in (world, 1)}
    tables = {size: RequestTable(4, LONG + 8, CAPACITY, PAGE * size, dcp_size=size) for size in models}
    results = {}

    # A step refused at compile time, then the advised retry (a smaller prefill).
    long = tables[world].extend_batch([3], [[5] * LONG])
    results["refused"] = _outcome(lambda: models[world](*long.to(device).args(), host_metadata=long.host))
    tables[world].truncate(3, 0)
    prompts = [[1, 2, 3, 4, 5], list(range(1, 21)), [7, 8]]
    logits = {}
    for size, model in models.items():
        batch = tables[size].extend_batch([0, 1, 2], prompts)
        logits[size] = model(*batch.to(device).args(), host_metadata=batch.host).cpu()
    results["retry_worst"] = float((logits[world] - logits[1]).abs().max())
    results["tolerance"] = half_precision_tolerance("bfloat16", TINY_512.num_mla_layers, float(logits[1].abs().max()))

    # Decode steps replayed from NPU graphs; rank 1 fails the second replay before it replays.
    runners = {size: GraphRunner(model.compiled(next(iter(dcp_compile.state(model).backends))), buckets=(4,),
                                 graphs=device_graphs(device), host_slot=dcp_compile.state(model).host_slot)
               for size, model in models.items()}
    copy_inputs = runners[world]._copy_inputs
    calls = [0]

    def failing_copy(captured, fresh):
        calls[0] += 1
        if rank == 1 and calls[0] == 2:
            raise RuntimeError("injected host failure on rank 1")
        return copy_inputs(captured, fresh)

    runners[world]._copy_inputs = failing_copy
    tokens = [[int(row.argmax())] for row in logits[1]]
    results["replays"] = []
    for _ in range(4):
        want = runners[1](tables[1].extend_batch([0, 1, 2], tokens)).cpu()
        got = _outcome(lambda: runners[world](tables[world].extend_batch([0, 1, 2], tokens)).cpu())
        results["replays"].append(got if got[0] != "ok" else ("ok", float((got[1] - want).abs().max())))
        tokens = [[int(row.argmax())] for row in want]
    return results


@pytest.fixture(scope="module")
def ranks(npu_emulator):
    return spawn(failure_rule_steps, 2, backend="hccl", timeout=TIMEOUT_S)


def test_a_refusal_at_compile_time_leaves_the_model_serving(ranks):
    """Before, the retry raised "an earlier step failed on this rank ... restart the ranks"."""
    for result in ranks:
        assert result["refused"][0] == "ValueError" and "prefill in chunks" in result["refused"][1]
        assert result["retry_worst"] < result["tolerance"]


def test_a_replay_that_fails_on_one_rank_latches_every_rank(ranks):
    failed, peer = ranks[1]["replays"], ranks[0]["replays"]
    tolerance = ranks[0]["tolerance"]
    assert failed[0][0] == "ok" and failed[0][1] < tolerance and peer[0][0] == "ok" and peer[0][1] < tolerance
    assert failed[1] == ("RuntimeError", "injected host failure on rank 1")
    assert peer[1][0] != "ok"  # its replay waited for rank 1 in a collective: the timeout, or rank 1 exiting
    for outcome in failed[2:] + peer[2:]:
        assert outcome[0] == "RuntimeError" and LATCHED in outcome[1], outcome
