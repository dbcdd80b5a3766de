"""After a failed step, a rank with TP or DCP peers runs no more steps."""

from __future__ import annotations


class FailureLatch:
    """With collectives, a rank that goes on after a failed step would pair its next collectives
    with its peers' pending ones of the failed step: finite, wrong results. It stops instead;
    peers blocked in a collective fail at the process group's timeout."""

    def __init__(self, has_peers: bool):
        self.has_peers = has_peers
        self.failure: str | None = None

    def check(self) -> None:
        if self.failure is not None:
            raise RuntimeError(
                f"an earlier step failed on this rank ({self.failure}); its TP/DCP peers may still be inside that "
                "step's collectives, so this model runs no more steps: restart the ranks"
            )

    def record(self, exc: BaseException) -> None:
        if self.has_peers:
            self.failure = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
