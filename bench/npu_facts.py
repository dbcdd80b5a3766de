"""The facts probe is now `dcp-compile doctor --device npu` (dcp_compile/doctor/npu/,
installed with the package); this keeps the old command:

    python -m bench.npu_facts [--standin] [doctor flags]
    == [DCP_COMPILE_NPU_EMULATOR=1] dcp-compile doctor --device npu [doctor flags]

--standin runs the checks on the stand-ins of the emulated npu device.
"""

from __future__ import annotations

import os
import sys

from dcp_compile.runtime.devices import EMULATOR_ENV


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--standin" in argv:
        argv.remove("--standin")
        os.environ[EMULATOR_ENV] = "1"
    from dcp_compile.cli.main import main as cli

    return cli(["doctor", "--device", "npu", *argv])


if __name__ == "__main__":
    raise SystemExit(main())
