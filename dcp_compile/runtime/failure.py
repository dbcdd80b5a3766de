"""The failure rule: which errors stop a model on every rank, and which leave it serving.

- **Agreed errors leave the model serving.** An error every rank of the group raises alike before
  any collective of the step (an input check whose outcome the ranks agree on, a failed agreement,
  a refusal decided at compile time from agreed shapes) is raised on every rank, and the next call
  runs. Such an error is marked `agreed(exc)` where it is raised.
- **Any other error in a step latches.** A rank that goes on after it would pair its next
  collectives with its peers' pending ones of the failed step (finite, wrong results). Every later
  call of the model on that rank raises instead, through every entry point: the model's steps,
  its compiled steps, graph replays and generate().
- **Peers learn of it.** Where the failure came after the step's collectives had all run (the
  peers are out of the step too), the latched rank tells its peers at its next agreement, and
  every rank raises the latch's error there and from then on. Where it came inside the step, the
  latched rank joins no more collectives (its peers may be inside one of the failed step's) and a
  peer blocked in a collective fails at the process group's timeout, which latches it.

docs/failures.md states the rule for users, with what to do after each kind of error.
"""

from __future__ import annotations

import contextlib

_AGREED = "_dcp_agreed"


def agreed(exc: BaseException) -> BaseException:
    """Mark `exc` as raised alike on every rank before any collective of the step: it does not latch."""
    setattr(exc, _AGREED, True)
    return exc


def is_agreed(exc: BaseException) -> bool:
    return getattr(exc, _AGREED, False)


@contextlib.contextmanager
def agreeing():
    """Errors raised inside the block are agreed (every rank raises them alike: the block is an
    agreement, or runs only on agreed values)."""
    try:
        yield
    except BaseException as exc:
        agreed(exc)
        raise


class PeerFailedError(RuntimeError):
    """A DCP peer told the group, at an agreement, that a step of its failed: this rank latches too."""

    def __init__(self, rank: int):
        self.rank = rank
        super().__init__(f"DCP rank {rank} failed a step after its collectives ran (its own error names the cause); "
                         "this model runs no more steps on any rank of the group: restart the ranks")


class FailureLatch:
    """One model's latch. `has_peers`: the model runs collectives (TP or DCP peers); without
    peers nothing latches (no collective can be paired wrong)."""

    def __init__(self, has_peers: bool):
        self.has_peers = has_peers
        self.failure: str | None = None
        """The first line of the error that latched, or None."""
        self.where = "on this rank"
        self.notice_pending = False
        """Whether the peers are still to be told (the failure came after the step's collectives)."""

    def check(self, notify=None) -> None:
        """Raise the latch's error if a step failed. notify(failure): the front end's agreement,
        called once with the failure when the peers are still to be told (they raise there too)."""
        if self.failure is None:
            return
        if self.notice_pending and notify is not None:
            self.notice_pending = False
            notify(self.failure)
        raise RuntimeError(
            f"an earlier step failed {self.where} ({self.failure}); the TP/DCP peers may be out of step with this "
            "rank, so this model runs no more steps: restart the ranks"
        )

    def record(self, exc: BaseException, collectives_done: bool = False) -> None:
        """Latch on `exc` unless it is agreed (or the model has no peers). collectives_done: the
        step's collectives had all run on this rank when it failed (its peers get a notice)."""
        if not self.has_peers or is_agreed(exc) or self.failure is not None:
            return
        self.failure = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        if isinstance(exc, PeerFailedError):
            self.where = f"on DCP rank {exc.rank}"
        else:
            self.notice_pending = collectives_done
