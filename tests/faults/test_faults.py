"""Faults injected into real gloo ranks, each bounded by its own timeout: a killed rank, a
stalled rank, an error on one rank in a serving loop that logs and goes on, a port in use, and
a process group destroyed and made again. No process may be left behind."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import signal
import socket
import time

import pytest
import torch
import torch.distributed as dist

import dcp_compile
from dcp_compile.cli import main as cli_main
from dcp_compile.runtime import launch, parallel
from dcp_compile.runtime.batch import RequestTable
from dcp_compile.runtime.launch import CollectiveTimeoutError, RankDiedError, spawn
from tests.contract.model import ContractModel, step_args

TIMEOUT_S = 3.0
MARGIN_S = 25.0  # process start-up and imports on a loaded 2-core machine
COMPILING_TIMEOUT_S = 15.0
"""For runs that compile: one rank may finish its compile seconds before its peer reaches the
first collective, which a 3 s timeout on a loaded machine would take for a stall."""


def _children() -> list:
    return multiprocessing.active_children()


@pytest.fixture(autouse=True)
def no_process_left_behind():
    yield
    deadline = time.time() + 10
    while _children() and time.time() < deadline:
        time.sleep(0.1)
    assert not _children(), f"left behind: {_children()}"


def _killed(rank, world):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))


def _stalled(rank, world):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(torch.ones(1))


def test_a_killed_rank_is_named_with_its_signal():
    start = time.time()
    with pytest.raises(RankDiedError, match="rank 1 was killed by SIGKILL"):
        spawn(_killed, 2, timeout=TIMEOUT_S)
    assert time.time() - start < TIMEOUT_S + MARGIN_S


def test_a_stalled_rank_fails_its_peers_within_the_timeout():
    start = time.time()
    with pytest.raises(CollectiveTimeoutError, match=r"rank 0 timed out in dist.all_reduce.*never reached it: \[1\]"):
        spawn(_stalled, 2, timeout=TIMEOUT_S)
    assert time.time() - start < TIMEOUT_S + MARGIN_S


def _serving_loop(rank, world, bad_ranks):
    """Three steps of a DCP 2 model; step 2 has location -1 on `bad_ranks`; every error is
    logged and the loop goes on, as a careless server would."""
    model = dcp_compile.apply(ContractModel(tp_size=2), 2)
    table = RequestTable(2, 32, 512)
    outcomes = []
    for step in range(3):
        batch = table.extend_batch([0, 1], [[1, 2, 3], [4]] if step == 0 else [[5], [6]])
        if step == 1 and rank in bad_ranks:
            batch.out_loc[0] = -1
        try:
            logits = model(*step_args(batch))
            outcomes.append(("ok", bool(torch.isfinite(logits).all())))
        except Exception as exc:
            outcomes.append((type(exc).__name__, str(exc)[:200]))
    return outcomes


@pytest.mark.parametrize("bad_ranks", [(0, 1), (0,)], ids=["bad-batch-on-every-rank", "bad-batch-on-one-rank"])
def test_after_a_caught_error_the_next_step_is_an_error_on_every_rank(bad_ranks):
    start = time.time()
    ranks = spawn(_serving_loop, 2, bad_ranks, timeout=COMPILING_TIMEOUT_S)
    for rank, outcomes in enumerate(ranks):
        assert outcomes[0] == ("ok", True)
        # The bad location fails its own rank's step; a peer that was not given it times out
        # in the step's first collective instead of pairing it with a later step's.
        expected = "IndexError" if rank in bad_ranks else "DistBackendError"
        assert outcomes[1][0] in (expected, "RuntimeError"), outcomes[1]
        assert "location -1 is outside the pool" in outcomes[1][1] or rank not in bad_ranks
        assert outcomes[2][0] == "RuntimeError" and "earlier step failed" in outcomes[2][1]
    assert time.time() - start < 2 * COMPILING_TIMEOUT_S + MARGIN_S


def _hold_until(done_path: str) -> None:
    """A failed rank that stays up, as a server that logs and goes on would, until its peer is done
    (at most 120 s: the old 30-minute subgroup timeout would hold it that long)."""
    deadline = time.time() + 120
    while not os.path.exists(done_path) and time.time() < deadline:
        time.sleep(0.1)


def _timed_step(model, batch, done_path: str):
    """The step's outcome (the error's type and first line) and how long it took; then releases the peer."""
    start = time.time()
    try:
        model(*step_args(batch))
        outcome = ("ok", "")
    except Exception as exc:  # the collective's timeout, asserted by the tests
        outcome = (type(exc).__name__, str(exc).splitlines()[0])
    elapsed = time.time() - start
    open(done_path, "w").close()
    return outcome, elapsed


def _stall_in_forward(rank, world, dcp_size, done_path):
    """Rank 1 fails its step before the step's first collective and stays up, logging, as a
    server would; rank 0 is left inside that collective: the TP all-reduce at dcp_size 1, the
    DCP group's Q all-gather at dcp_size 2. Returns rank 0's error and how long its step took."""
    model = dcp_compile.apply(ContractModel(tp_size=2), dcp_size)
    batch = RequestTable(2, 32, 512).extend_batch([0, 1], [[1, 2, 3], [4]])
    if rank == 1:
        batch.out_loc[0] = -1
        with pytest.raises(IndexError):
            model(*step_args(batch))
        return _hold_until(done_path)
    return _timed_step(model, batch, done_path)


@pytest.mark.parametrize("dcp_size", [1, 2], ids=["tp-group-all-reduce", "dcp-group-all-gather"])
def test_a_peer_stalled_inside_the_models_collectives_fails_within_the_timeout(dcp_size, tmp_path):
    start = time.time()
    (outcome, elapsed), _ = spawn(_stall_in_forward, 2, dcp_size, str(tmp_path / "done"), timeout=TIMEOUT_S)
    assert outcome[0] in ("DistBackendError", "RuntimeError") and "timed out" in outcome[1].lower(), outcome
    assert elapsed < TIMEOUT_S + 10
    assert time.time() - start < TIMEOUT_S + MARGIN_S


def _stall_in_the_tp_all_reduce_at_dcp_two(rank, world, done_path):
    """At DCP 2 and TP 2, rank 1 fails its step after the step's DCP collectives (its LSE merge
    raises) and stays up; rank 0 goes on to the TP group's all-reduce of the output projection and
    waits there. A first step on both ranks compiles, so that neither waits for the other's
    compile inside the failing step."""
    from dcp_compile.ops import internal

    model = dcp_compile.apply(ContractModel(tp_size=2), 2)
    table = RequestTable(2, 32, 512)
    model(*step_args(table.extend_batch([0, 1], [[1, 2, 3], [4]])))
    batch = table.extend_batch([0, 1], [[5], [6]])
    if rank == 1:
        def injected(packed, kv_lora_rank):
            raise RuntimeError("injected failure in the LSE merge")

        internal.merge_partials.register_kernel("cpu")(injected)
        with pytest.raises(RuntimeError, match="injected"):
            model(*step_args(batch))
        return _hold_until(done_path)
    return _timed_step(model, batch, done_path)


def test_a_peer_stalled_inside_the_tp_all_reduce_at_dcp_two_fails_within_the_timeout(tmp_path):
    """The TP group's collective at DCP 2, TP 2 (the DCP group's collectives of the step completed)."""
    start = time.time()
    (outcome, elapsed), _ = spawn(_stall_in_the_tp_all_reduce_at_dcp_two, 2, str(tmp_path / "done"),
                                  timeout=COMPILING_TIMEOUT_S)
    assert outcome[0] in ("DistBackendError", "RuntimeError") and "timed out" in outcome[1].lower(), outcome
    assert elapsed < COMPILING_TIMEOUT_S + 10
    assert time.time() - start < 2 * COMPILING_TIMEOUT_S + MARGIN_S


def test_every_group_takes_the_world_groups_timeout():
    assert spawn(_group_timeouts, 2, timeout=7.0) == [[7.0, 7.0, 2.5]] * 2


def _group_timeouts(rank, world):
    groups = dist.distributed_c10d
    default = parallel.build(2, 2)
    explicit = parallel.build(2, 1, timeout=datetime.timedelta(seconds=2.5))
    return [parallel.group_timeout(groups._resolve_process_group(name)).total_seconds()
            for name in (default.tp_group_name, default.dcp_group_name, explicit.tp_group_name)]


def _all_reduce_sum(rank, world):
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


def test_a_port_in_use_is_a_clear_error(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        monkeypatch.setattr(launch, "free_port", lambda: busy.getsockname()[1])
        start = time.time()
        with pytest.raises((RuntimeError, CollectiveTimeoutError), match="(?i)address already in use|timed out"):
            spawn(_all_reduce_sum, 2, timeout=TIMEOUT_S)
        assert time.time() - start < TIMEOUT_S + MARGIN_S


def _reinit(rank, world, port):
    first = parallel.build(2)
    first_group = dist.distributed_c10d._resolve_process_group(first.tp_group_name)
    dist.all_reduce(torch.ones(1), group=first_group)
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    second_group = dist.distributed_c10d._resolve_process_group(parallel.build(2).tp_group_name)
    t = torch.ones(1)
    dist.all_reduce(t, group=second_group)
    return float(t), second_group is not first_group


def test_groups_are_made_anew_after_the_process_group_is_recreated():
    assert spawn(_reinit, 2, launch.free_port(), timeout=TIMEOUT_S) == [(2.0, True)] * 2


def test_cli_exit_codes_for_a_dead_rank_and_a_timeout(monkeypatch, capsys):
    from dcp_compile.cli import demo

    for error, code in ((RankDiedError("rank 1 was killed by SIGKILL"), 3), (CollectiveTimeoutError("rank 0 timed out"), 4)):
        monkeypatch.setattr(demo, "compare", lambda scenario, error=error: (_ for _ in ()).throw(error))
        assert cli_main.main(["demo"]) == code
        assert capsys.readouterr().err.strip().count("\n") == 0  # one line
