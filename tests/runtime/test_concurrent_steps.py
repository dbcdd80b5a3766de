"""Steps of one model called from two threads at once run one at a time: under a back end that
feeds host inputs (FlashInfer's CPU stand-in, host-planned), each thread's request gets exactly
the logits a sequential run gives it (issue 36, item 2: before, 8 of 26 steps of such a run
differed, by up to 4.6). A step that calls the model again from inside itself is an error, not a
deadlock."""

from __future__ import annotations

import threading

import pytest
import torch

import dcp_compile
from dcp_compile.models.config import preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.runtime.batch import RequestTable

PAGE = 16
STEPS = 12


def _model():
    # Dynamo counts graphs per code object over every model of a process: start from none, so that
    # the test's own graphs (one per batch shape, host-planned) stay under its recompile limit.
    torch._dynamo.reset()
    return dcp_compile.apply(MLAModel(preset("tiny"), 1024, max_requests=2, page_size=PAGE, seed=4), 1,
                             kernels="flashinfer")


def _batches() -> dict[int, list]:
    """Each request's prefill and decode steps, built ahead from one request table (each
    request's rows and locations are its own)."""
    table = RequestTable(2, 64, 1024, PAGE)
    batches = {request: [table.extend_batch([request], [[5 + request] * (4 + 9 * request)])] for request in (0, 1)}
    for step in range(STEPS):
        for request in (0, 1):
            batches[request].append(table.extend_batch([request], [[10 + step + request]]))
    return batches


def test_two_threads_get_the_logits_of_a_sequential_run():
    batches = _batches()
    sequential, want = _model(), {0: [], 1: []}
    for step in range(STEPS + 1):
        for request in (0, 1):
            batch = batches[request][step]
            want[request].append(sequential(*batch.args(), host_metadata=batch.host))

    concurrent, got = _model(), {0: [], 1: []}
    start = threading.Barrier(2)
    failures = []

    def serve(request: int) -> None:
        try:
            start.wait()
            for batch in batches[request]:
                got[request].append(concurrent(*batch.args(), host_metadata=batch.host))
        except BaseException as exc:  # reported below, not lost in the thread
            failures.append(exc)

    threads = [threading.Thread(target=serve, args=(request,)) for request in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not failures, failures
    for request in (0, 1):
        assert len(got[request]) == STEPS + 1
        for step, (a, b) in enumerate(zip(got[request], want[request])):
            assert torch.equal(a, b), (request, step, (a - b).abs().max().item())


def test_a_re_entrant_step_is_an_error():
    model = _model()
    batch = RequestTable(2, 64, 1024, PAGE).extend_batch([0], [[1, 2, 3]])
    with model._compiled_step.guarded():
        with pytest.raises(RuntimeError, match="re-entrant"):
            model(*batch.args(), host_metadata=batch.host)
