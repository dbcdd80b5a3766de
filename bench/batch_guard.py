"""What the always-on batch guard costs on the GPU, next to what a decode step already does.

    python bench/batch_guard.py --out bench/results/batch_guard_h200.json

`dcp::guard_batch` runs once per graph (not per layer): it reads the page table [B, L] once
with a few elementwise passes (entries in the pool, lengths and row ids in range, no padded row
writing KV) and sets the device's error flags without a host sync. Timed in CUDA graphs, per
(batch, context), beside `dcp::local_metadata` (the Triton kernel that already reads the whole
table once per DCP graph) and the copy time of the table's bytes.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import dcp_compile  # noqa: E402, F401 - registers the dcp:: ops
from kernels import time_graph  # noqa: E402
from dcp_compile.lowering import triton as kernels  # noqa: E402
from dcp_compile.runtime import guards  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/batch_guard.json")
    p.add_argument("--batches", default="4,16,64")
    p.add_argument("--contexts", default="32768,131072")
    p.add_argument("--replays", type=int, default=30)
    args = p.parse_args(argv)
    device = torch.device("cuda")
    rows = []
    for context in [int(c) for c in args.contexts.split(",")]:
        for batch in [int(b) for b in args.batches.split(",")]:
            capacity = batch * context + 2
            table = (torch.arange(batch * context, device=device, dtype=torch.int64).view(batch, context) + 1)
            seq_lens = torch.full((batch,), context, device=device, dtype=torch.int64)
            ids = torch.arange(batch, device=device)
            out_loc = table[:, -1].clone()
            guard = time_graph(torch, lambda i: torch.ops.dcp.guard_batch(table, seq_lens, ids, out_loc, capacity), 10,
                               args.replays)
            metadata = time_graph(torch, lambda i: kernels.local_metadata(table, seq_lens, 0, 2, 1), 10, args.replays)
            copy_dst = torch.empty_like(table)
            copy = time_graph(torch, lambda i: copy_dst.copy_(table), 10, args.replays)
            assert not guards.error_flags(device).any(), "a valid batch set an error flag"
            rows.append({"batch": batch, "context": context, "table_mib": table.numel() * 8 / 2**20,
                         "guard_us": guard * 1e6, "local_metadata_us": metadata * 1e6, "table_copy_us": copy * 1e6})
            print(f"batch {batch:3d} context {context:6d}: guard {guard * 1e6:7.1f} us, local_metadata "
                  f"{metadata * 1e6:7.1f} us, table copy {copy * 1e6:7.1f} us ({table.numel() * 8 / 2**20:.0f} MiB)")
    result = {"benchmark": "batch_guard", "command": " ".join([sys.executable, *sys.argv]),
              "machine": torch.cuda.get_device_name(device), "host": platform.node(), "torch": torch.__version__,
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
