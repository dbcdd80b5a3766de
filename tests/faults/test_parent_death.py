"""Ranks die with their launcher: a launcher killed by SIGKILL, which runs none of its cleanup,
leaves no rank computing; also where the launcher died before the rank could ask to be told,
and where the parent-death signal is not available (the watchdog thread)."""

from __future__ import annotations

import multiprocessing.context
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dcp_compile.runtime import launch

REPO = Path(__file__).resolve().parents[2]
RANKS = 2
GONE_WITHIN_S = 5.0

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads process states from /proc")


def _write_pid_and_sleep(rank: int, world_size: int, folder: str) -> None:
    partial = Path(folder, f".rank{rank}")
    partial.write_text(str(os.getpid()))
    partial.rename(Path(folder, f"rank{rank}"))
    time.sleep(600)


def _alive(pid: int) -> bool:
    """Whether `pid` runs; a zombie (dead, not yet reaped by whoever inherited it) does not."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _pids(folder: Path, count: int, timeout_s: float = 60.0) -> list[int]:
    deadline = time.time() + timeout_s
    while len(list(folder.glob("rank*"))) < count and time.time() < deadline:
        time.sleep(0.1)
    return [int(path.read_text()) for path in sorted(folder.glob("rank*"))]


def _assert_gone(pids: list[int]) -> None:
    deadline = time.time() + GONE_WITHIN_S
    while any(map(_alive, pids)) and time.time() < deadline:
        time.sleep(0.05)
    left = [pid for pid in pids if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"still running {GONE_WITHIN_S} s after their parent was killed"


def _python(code: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, env=env)


def test_ranks_die_when_their_launcher_is_killed(tmp_path):
    launcher = _python("import sys; from dcp_compile.runtime.launch import spawn; "
                       "from tests.faults.test_parent_death import _write_pid_and_sleep; "
                       f"spawn(_write_pid_and_sleep, {RANKS}, sys.argv[1])", str(tmp_path))
    try:
        pids = _pids(tmp_path, RANKS)
        assert len(pids) == RANKS and all(map(_alive, pids))
    finally:
        launcher.kill()
        launcher.wait()
    _assert_gone(pids)


def test_ranks_still_importing_die_when_their_launcher_is_killed(tmp_path):
    """A rank asks for the parent-death signal before it imports its function's module (torch,
    in a real run: seconds, tens of seconds on a loaded machine); here the module sleeps in its
    import (tests/faults/slow_import.py), and the launcher is killed then."""
    launcher = _python("import os, sys; os.environ.update(DCP_TEST_SLOW_IMPORT_DIR=sys.argv[1], DCP_TEST_SLOW_IMPORT_S='0'); "
                       "from tests.faults import slow_import; os.environ['DCP_TEST_SLOW_IMPORT_S'] = '60'; "
                       f"from dcp_compile.runtime.launch import spawn; spawn(slow_import.rank_fn, {RANKS})", str(tmp_path))
    try:
        pids = [pid for pid in _pids(tmp_path, RANKS + 1) if pid != launcher.pid]  # the launcher's own import too
        assert len(pids) == RANKS and all(map(_alive, pids))
    finally:
        launcher.kill()
        launcher.wait()
    _assert_gone(pids)


def test_a_rank_whose_launcher_died_before_it_started_kills_itself():
    """The parent-death signal is asked for after the parent may already be gone: the rank
    compares its parent with the launcher's pid it was given."""
    rank = subprocess.run([sys.executable, "-c", "import os; from dcp_compile.runtime import parent_death; "
                           "parent_death.die_with_parent(os.getppid() + 1); print('still running')"],
                          cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert rank.returncode == -signal.SIGKILL and rank.stdout == ""


def test_without_the_parent_death_signal_a_watchdog_thread_kills_the_rank(tmp_path):
    rank = ("import os, sys, time; from pathlib import Path; from dcp_compile.runtime import parent_death; "
            "parent_death.set_parent_death_signal = lambda: False; parent_death.die_with_parent(os.getppid()); "
            "from tests.faults.test_parent_death import _write_pid_and_sleep; _write_pid_and_sleep(0, 1, sys.argv[1])")
    parent = _python("import subprocess, sys; subprocess.run([sys.executable, '-c', sys.argv[1], sys.argv[2]])",
                     rank, str(tmp_path))
    try:
        pids = _pids(tmp_path, 1)
        assert len(pids) == 1 and _alive(pids[0])
    finally:
        parent.kill()
        parent.wait()
    _assert_gone(pids)


def test_a_ctrl_c_between_two_rank_starts_stops_the_started_rank(monkeypatch):
    """spawn() starts its ranks inside its cleanup's try: a KeyboardInterrupt after the first
    start kills and reaps that rank instead of leaving it running."""
    started = []
    real_start = multiprocessing.context.SpawnProcess.start

    def start_then_interrupt(process):
        if started:
            raise KeyboardInterrupt
        real_start(process)
        started.append(process)

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", start_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        launch.spawn(_write_pid_and_sleep, RANKS, "/nonexistent")
    assert len(started) == 1 and started[0].exitcode is not None and not _alive(started[0].pid)


def test_the_rank_entry_and_the_cli_entry_import_no_torch():
    """What a spawned rank runs before its parent-death signal is set, and what the CLI runs
    before its SIGINT handler, are quick to import: no torch."""
    code = ("import sys; import dcp_compile.runtime.parent_death, dcp_compile.cli.main; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr
