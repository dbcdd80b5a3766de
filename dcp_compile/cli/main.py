"""`dcp-compile` entry point. Each subcommand module has `register(subparsers)` and `run(args)`.

Exit codes: 0 success; 1 the DCP run does not match dcp_size=1 (demo); 2 bad input or an error
(one line on stderr); 3 a rank died (killed, or exited without a result); 4 a collective timed
out waiting for a stalled rank; 130 interrupted (Ctrl-C); 143 terminated (SIGTERM). Ranks are
stopped in every case.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys

from dcp_compile.runtime.launch import CollectiveTimeoutError, RankDiedError

EXIT_MISMATCH, EXIT_ERROR, EXIT_RANK_DIED, EXIT_TIMEOUT = 1, 2, 3, 4

SUBCOMMANDS = ("demo", "dump")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dcp-compile", description="Decode context parallelism for MLA models")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="log passes (-v) or everything and an error's whole text, rank tracebacks included (-vv)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"dcp_compile.cli.{name}").register(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("dcp_compile").setLevel(level)
    # SIGTERM unwinds like Ctrl-C, so the launcher's cleanup stops the ranks.
    previous = signal.signal(signal.SIGTERM, _terminate)
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
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


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


def _terminate(signum, frame):
    raise SystemExit(143)


if __name__ == "__main__":
    sys.exit(main())
