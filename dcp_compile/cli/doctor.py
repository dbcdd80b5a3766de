"""`dcp-compile doctor --device npu`: the first command on a new Ascend machine. It checks every
assumption the NPU lowering makes on this machine's ops (dcp_compile/doctor/npu), prints
each check's verdict (PASS, FAIL, SKIP) with its source and measured values and which options are
safe here, and writes the report as JSON (--out) to attach to a bug report.

Exit codes: 0 every check PASSes or SKIPs; 1 a check FAILs; 2 bad input or an error (one line).
With DCP_COMPILE_NPU_EMULATOR=1 and no torch_npu it checks the stand-ins on the emulated device
(what CI runs); there --plant NAME (not in --help: a test's switch) makes a stand-in depart from
one fact, which its check must report.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
from pathlib import Path

DEVICES = ("npu",)


def register(sub) -> None:
    p = sub.add_parser("doctor", help="check this machine's ops against every assumption the lowering makes; run "
                                      "it first on a new machine",
                       description="Check, one by one, each fact the device's lowering relies on, on this machine's "
                                   "ops, and say which options are safe here.")
    p.add_argument("--device", required=True, choices=DEVICES,
                   help="the device to check: npu (Ascend, through torch_npu; the emulated device with "
                        "DCP_COMPILE_NPU_EMULATOR=1)")
    p.add_argument("--json", action="store_true", help="end with the report as one JSON line (the tables go to stderr)")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the report's JSON here (attach it to a "
                                                               "bug report)")
    p.add_argument("--only", default=None, metavar="CHECKS", help="comma-separated checks to run (default: all)")
    p.add_argument("--plant", default=None, help=argparse.SUPPRESS)
    p.set_defaults(handler=run)


def _validated(args) -> list[str] | None:
    """The checks --only names, the output file and the plant, refused before anything runs."""
    from dcp_compile.doctor import npu as doctor
    from dcp_compile.runtime import devices

    only = None
    if args.only is not None:
        only = [name.strip() for name in args.only.split(",") if name.strip()]
        unknown = [name for name in only if name not in doctor.names()]
        if unknown or not only:
            found = f"unknown checks {unknown}" if unknown else "no check named"
            raise ValueError(f"--only {args.only!r}: {found}; choose from {doctor.names()}")
    if args.out is not None:
        out = Path(args.out)
        if out.is_dir() or not out.parent.is_dir():
            raise ValueError(f"--out {args.out!r} must name a file in an existing folder")
    if args.plant is not None:
        from dcp_compile.testing import npu_standin

        if not devices.emulated_npu():
            raise ValueError(f"--plant makes a stand-in depart from a fact: it needs the emulated device "
                             f"({devices.EMULATOR_ENV}=1, without torch_npu)")
        if args.plant not in npu_standin.PLANTS:
            raise ValueError(f"--plant {args.plant!r}: choose one of {sorted(npu_standin.PLANTS)}")
    return only


@contextlib.contextmanager
def _planted(name: str | None):
    """The stand-ins depart from `name`'s fact for the run (spawned ranks inherit it), and from no
    fact without one; the previous setting is restored after."""
    from dcp_compile.testing.npu_standin import PLANT_ENV

    previous = os.environ.pop(PLANT_ENV, None)
    if name is not None:
        os.environ[PLANT_ENV] = name
    try:
        yield
    finally:
        os.environ.pop(PLANT_ENV, None)
        if previous is not None:
            os.environ[PLANT_ENV] = previous


def _command(args) -> str:
    parts = ["dcp-compile", "doctor", "--device", args.device]
    for flag in ("only", "plant", "out"):
        if getattr(args, flag) is not None:
            parts += [f"--{flag}", getattr(args, flag)]
    settings = [f"{name}={value}" for name, value in sorted(os.environ.items()) if name.startswith("DCP_COMPILE_NPU")]
    return shlex.join(settings + parts + (["--json"] if args.json else []))


def run(args) -> int:
    from rich.console import Console

    from dcp_compile.doctor import npu as doctor
    from dcp_compile.doctor.npu import report as tables

    only = _validated(args)
    with _planted(args.plant):
        report = doctor.run(only, command=_command(args), plant=args.plant)
    report["exit_status"] = 1 if report["summary"]["failed"] else 0
    text = json.dumps(report, default=str)
    console = Console(stderr=args.json)
    if not console.is_terminal:  # piped or logged: keep rows whole
        console = Console(stderr=args.json, width=160)
    tables.render(report, console)
    if args.out is not None:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
        console.print(f"written: {args.out} (attach it to a bug report)")
    if args.json:
        print(text)
    return report["exit_status"]
