"""`dcp-compile dump`: placeholder until the graph-dump CLI lands."""

from __future__ import annotations


def register(sub) -> None:
    parser = sub.add_parser("dump", help="dump each pass's graph before and after (not built yet)")
    parser.set_defaults(handler=run)


def run(args) -> int:
    raise RuntimeError("dcp-compile dump is not built yet; set DCP_COMPILE_DUMP=DIR on any apply() run instead")
