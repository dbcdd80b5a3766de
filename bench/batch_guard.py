"""What the always-on batch guard costs on the GPU, next to what a decode step already does.

    python -m bench.batch_guard --out bench/results/batch_guard_h200.json

`dcp::guard_batch` runs once per graph (not per layer): it reads the page table [B, L] once
with a few elementwise passes (entries in the pool, lengths and row ids in range, no padded row
writing KV) and sets the device's error flags without a host sync. Timed in CUDA graphs, per
(batch, context), beside `dcp::local_metadata` (the Triton kernel that already reads the whole
table once per DCP graph) and the copy time of the table's bytes.
"""

from __future__ import annotations

import argparse

import torch

import dcp_compile  # noqa: F401 - registers the dcp:: ops
from bench.lib import result as results
from bench.lib.timing import require_cuda, time_graph
from dcp_compile.lowering import triton as kernels
from dcp_compile.runtime import guards


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/batch_guard.json")
    p.add_argument("--batches", default="4,16,64")
    p.add_argument("--contexts", default="32768,131072")
    p.add_argument("--replays", type=int, default=30)
    args = p.parse_args(argv)
    require_cuda("bench.batch_guard")
    device = torch.device("cuda")
    result = results.start("batch_guard", argv, device)
    for context in [int(c) for c in args.contexts.split(",")]:
        for batch in [int(b) for b in args.batches.split(",")]:
            capacity = batch * context + 2
            table = (torch.arange(batch * context, device=device, dtype=torch.int64).view(batch, context) + 1)
            seq_lens = torch.full((batch,), context, device=device, dtype=torch.int64)
            ids = torch.arange(batch, device=device)
            out_loc = table[:, -1].clone()
            guard = time_graph(lambda i: torch.ops.dcp.guard_batch(table, seq_lens, ids, out_loc, capacity), 10,
                               args.replays)
            metadata = time_graph(lambda i: kernels.local_metadata(table, seq_lens, 0, 2, 1), 10, args.replays)
            copy_dst = torch.empty_like(table)
            copy = time_graph(lambda i: copy_dst.copy_(table), 10, args.replays)
            assert not guards.error_flags(device).any(), "a valid batch set an error flag"
            results.add(result, results.MAIN, {"batch": batch, "context": context, "table_mib": table.numel() * 8 / 2**20,
                                               "guard_us": guard * 1e6, "local_metadata_us": metadata * 1e6,
                                               "table_copy_us": copy * 1e6})
            print(f"batch {batch:3d} context {context:6d}: guard {guard * 1e6:7.1f} us, local_metadata "
                  f"{metadata * 1e6:7.1f} us, table copy {copy * 1e6:7.1f} us ({table.numel() * 8 / 2**20:.0f} MiB)")
    results.write(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
