"""The command line's parser: a bad flag is one line on stderr, never the usage block.

argparse prints its whole usage block before an error; here the error is one line that names the
flag and what it allows, then points at --help (`dcp-compile demo: error: argument --tp-size:
must be an int >= 1, got '0' (see dcp-compile demo --help)`), exit 2. An int flag's type states
its bounds, so a value outside them is refused while the arguments are parsed, before anything
is imported, allocated or spawned.
"""

from __future__ import annotations

import argparse


class Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line; its subcommands' parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def allowed_ints(low: int | None = None, high: int | None = None) -> str:
    """'an int', 'an int >= 1' or 'an int in [0, 1024]': the words a flag's errors use."""
    if low is not None and high is not None:
        return f"an int in [{low}, {high}]"
    return f"an int >= {low}" if low is not None else "an int"


def int_in(low: int | None = None, high: int | None = None):
    """An argparse type: the flag's text as an int within [low, high] (no bound where None; a
    high bound comes with a low one)."""
    allowed = allowed_ints(low, high)

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value

    return parse


def number(text: str) -> float:
    """An argparse type: the flag's text as a float."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
