"""`dcp-compile` entry point. Each subcommand module has `register(subparsers)` and `run(args)`.

Exit codes: 0 success; 1 the DCP run does not match dcp_size=1 (demo), or a check FAILs (doctor);
2 bad input or an error (one line on stderr; a bad flag too, see cli/arguments.py); 3 a rank died
(killed, or exited without a result); 4 a collective timed out waiting for a stalled rank; 130 interrupted (Ctrl-C,
from the first line of main() on: while the subcommands are imported too, and however often it
is pressed); 143 terminated (SIGTERM). Ranks are stopped in every case.

This module imports nothing heavy before main() installs its SIGINT handler (torch comes with
the subcommands' modules, which main() imports; dcp_compile/__init__.py loads its names lazily).
"""

from __future__ import annotations

import importlib
import logging
import signal
import sys

from dcp_compile.cli.arguments import Parser

EXIT_MISMATCH, EXIT_ERROR, EXIT_RANK_DIED, EXIT_TIMEOUT = 1, 2, 3, 4
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143

SUBCOMMANDS = ("demo", "dump", "doctor")


def build_parser() -> Parser:
    parser = Parser(prog="dcp-compile", description="Decode context parallelism for MLA models")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="log passes (-v) or everything and an error's whole text, rank tracebacks included (-vv)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name in SUBCOMMANDS:
        importlib.import_module(f"dcp_compile.cli.{name}").register(sub)
    return parser


def main(argv=None) -> int:
    """Run the command line `argv` (default: this process's own, sys.argv) and return its exit
    code. Without argv, main() is the program: after a Ctrl-C it leaves SIGINT ignored, so that
    the interpreter's exit is not cut short either."""
    previous_interrupt = signal.signal(signal.SIGINT, _interrupt)
    previous_terminate = signal.signal(signal.SIGTERM, _terminate)  # unwinds like Ctrl-C: the ranks are stopped
    command = None
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help (0), or a bad flag (2, its line printed)
            return exc.code
        command = args.command
        return _run(args)
    except KeyboardInterrupt:
        print(f"dcp-compile{f' {command}' if command else ''}: interrupted", file=sys.stderr)
        if argv is None:
            previous_interrupt = signal.SIG_IGN
        return EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous_terminate)
        signal.signal(signal.SIGINT, previous_interrupt)


def _run(args) -> int:
    from dcp_compile.runtime.launch import CollectiveTimeoutError, RankDiedError  # torch: after main()'s handler

    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("dcp_compile").setLevel(level)
    try:
        return args.handler(args) or 0
    except RankDiedError as exc:
        _report(args.command, exc, named=False, whole=args.verbose > 1)
        return EXIT_RANK_DIED
    except CollectiveTimeoutError as exc:
        _report(args.command, exc, named=False, whole=args.verbose > 1)
        return EXIT_TIMEOUT
    except (ValueError, TypeError, RuntimeError, MemoryError) as exc:
        _report(args.command, exc, named=False, whole=args.verbose > 1)
        return EXIT_ERROR
    except Exception as exc:  # anything else is an error too, never a traceback that exits 1 (a mismatch)
        _report(args.command, exc, named=True, whole=args.verbose > 1)
        return EXIT_ERROR


def _report(command: str, exc: Exception, named: bool, whole: bool = False) -> None:
    """One line on stderr: the error's first line, after its type's name where that is not
    already clear from the message (`named`), or where the message is empty; all of it if `whole`."""
    if whole:
        print(f"dcp-compile {command}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return
    lines = str(exc).strip().splitlines()
    message = lines[0] if lines else ""
    if named or not message:
        message = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    print(f"dcp-compile {command}: error: {message}", file=sys.stderr)


def _interrupt(signum, frame):
    """The first Ctrl-C unwinds (the launcher stops the ranks on the way out); a later one is
    ignored, so that it cannot cut that cleanup short or turn exit 130 into a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _terminate(signum, frame):
    raise SystemExit(EXIT_TERMINATED)


if __name__ == "__main__":
    sys.exit(main())
