"""A spawned rank's first code: it asks to die with its launcher before it imports torch.

Importing torch takes seconds (tens on a loaded machine); a rank that asked for the
parent-death signal only afterwards outlived a launcher killed in that window by as long. So
spawn() starts each rank in `rank_main`, from this module, which imports nothing but the
standard library (dcp_compile/__init__.py and dcp_compile/runtime/__init__.py load their names
lazily for it), and unpickles the rank's function and arguments only after the signal is set.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
"""prctl option (linux/prctl.h): the signal this process gets when its parent dies."""
PARENT_POLL_S = 0.5
"""How often the watchdog looks for a dead parent, where the parent-death signal is unavailable."""


def set_parent_death_signal() -> bool:
    """Linux: have the kernel SIGKILL this process when its parent dies; False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):  # no libc to load, or no prctl in it
        return False


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:  # an orphan is adopted by another process
        time.sleep(PARENT_POLL_S)
    os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent(parent_pid: int) -> None:
    """Make this rank die when the launcher `parent_pid` does, however it dies, so that no rank
    of a killed launcher goes on computing (or holding a GPU). The parent-death signal fires
    when the thread that started the rank exits: spawn() waits in it for the ranks' results."""
    if not set_parent_death_signal():
        threading.Thread(target=_watch_parent, args=(parent_pid,), name="dcp-parent-watchdog", daemon=True).start()
    if os.getppid() != parent_pid:  # the launcher died before the signal was asked for
        os.kill(os.getpid(), signal.SIGKILL)


def rank_main(rank: int, parent_pid: int, payload: bytes, results) -> None:
    """spawn()'s process target. `payload` pickles (launch.worker, its other arguments): the
    rank's function among them, whose module may import torch, as launch's does."""
    die_with_parent(parent_pid)
    worker, *arguments = pickle.loads(payload)
    worker(rank, results, *arguments)
