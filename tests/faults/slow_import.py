"""A rank function whose module takes long to import, as torch does on a loaded machine: the
module writes its process id when its import starts, then sleeps in it."""

import os
import sys
import time
from pathlib import Path

_folder = os.environ["DCP_TEST_SLOW_IMPORT_DIR"]
_partial = Path(_folder, f".pid{os.getpid()}")
_partial.write_text(str(os.getpid()))
_partial.rename(Path(_folder, f"rank{os.getpid()}"))
time.sleep(float(os.environ.get("DCP_TEST_SLOW_IMPORT_S", "60")))
print("imported after its launcher died", file=sys.stderr)


def rank_fn(rank: int, world_size: int) -> None:
    pass
