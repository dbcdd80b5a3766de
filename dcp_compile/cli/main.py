"""`dcp-compile` entry point. Each subcommand module has `register(subparsers)` and `run(args)`."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

SUBCOMMANDS = ("demo", "dump")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dcp-compile", description="Decode context parallelism for MLA models")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log passes (-v) or everything (-vv)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"dcp_compile.cli.{name}").register(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("dcp_compile").setLevel(level)
    try:
        return args.handler(args) or 0
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"dcp-compile {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
