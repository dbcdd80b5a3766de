"""What a replayed NPU step copies from the host, and how often it waits for the device: decode and
verify (k = 7) steps of tiny-512 under npu_kernels='native', replayed by a GraphRunner at 64 rows
over a page table 128k wide (the issue's target: at most 1 MiB a step, 0 host syncs).

    python -m bench.npu_replay_h2d --out bench/results/npu_replay_h2d_emulated.json   # emulated npu
    python -m bench.npu_replay_h2d --rows 64 --max-context 131072                     # on an NPU

On the emulated device (DCP_COMPILE_NPU_EMULATOR=1, set for you where torch_npu is absent) the host
syncs are counted (dcp_compile.testing.npu_emulator.host_syncs); on hardware only the bytes are.
The bytes are the runner's own count per input (GraphRunner.h2d_last_step), with the page table
the step does not copy listed beside them. One rank (dcp_size 1): a rank of a DCP group copies
its own block table, at most as wide.
"""

from __future__ import annotations

import argparse
import os

import torch

from bench.lib import result as results


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--max-context", type=int, default=131072)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def run(args, argv=None) -> dict:
    from dcp_compile.runtime import devices

    if not devices.torch_npu_installed():
        os.environ[devices.EMULATOR_ENV] = "1"
    devices.require_torch_npu("bench.npu_replay_h2d")
    import dcp_compile
    from dcp_compile.models.config import preset
    from dcp_compile.models.mla import MLAModel
    from dcp_compile.runtime.batch import RequestTable
    from dcp_compile.runtime.graph_runner import GraphRunner, NPUGraphs

    emulated = devices.emulated_npu()
    device = torch.device("npu", 0)
    rows, block = args.rows, 128
    capacity = (rows * 2 + 8) * block  # short contexts: the page table's width is what is measured
    model = dcp_compile.apply(MLAModel(preset("tiny-512").with_layers(1), capacity, max_requests=rows,
                                       dtype=torch.bfloat16, page_size=block, device=device), 1, kernels="npu")
    table = RequestTable(rows, args.max_context, capacity, block)
    requests = list(range(rows))
    prefill = table.extend_batch(requests, [[1 + r % 7] * (1 + r % 16) for r in requests])  # <= 16: FIA
    model(*prefill.to(device).args(), host_metadata=prefill.host)
    state = dcp_compile.state(model)
    runner = GraphRunner(model.compiled("gather-q"), buckets=(rows,), graphs=NPUGraphs(), host_slot=state.host_slot,
                         watched=state.kv_pool.storage())
    result = results.start("npu_replay_h2d", argv)
    result["machine"]["device"] = "emulated npu (stand-ins)" if emulated else torch.npu.get_device_name(device)
    result["run"]["shapes"] = {"rows": rows, "max_context": args.max_context, "block_size": block,
                               "model": "tiny-512", "layers": 1, "npu_kernels": state.lowering.options.npu_kernels}
    for mode, per_row in (("decode", 1), ("verify", 7)):
        for step in range(args.steps + 1):  # the first call captures
            batch = table.extend_batch(requests, [[2 + step] * per_row] * rows, all_logits=per_row > 1)
            syncs = _host_syncs(emulated)
            runner(batch, per_row)
            if step == 0:
                continue
            results.add(result, "cases", {
                "mode": mode, "step": step, "h2d_bytes": runner.h2d_bytes_last_step,
                "h2d_bytes_by_input": dict(runner.h2d_last_step),
                "page_table_bytes_not_copied": batch.req_to_token.numel() * batch.req_to_token.element_size(),
                "host_syncs": None if syncs is None else _host_syncs(emulated) - syncs})
            for request in requests:  # back to the prefix: every step appends to the same contexts
                table.truncate(request, int(table.seq_lens[request]) - per_row)
    cases = results.rows(result)
    result["run"].update(max_h2d_bytes_per_step=max(c["h2d_bytes"] for c in cases),
                         max_host_syncs_per_step=max((c["host_syncs"] for c in cases if c["host_syncs"] is not None),
                                                     default=None))
    return result


def _host_syncs(emulated: bool) -> int | None:
    if not emulated:
        return None
    from dcp_compile.testing import npu_emulator

    return npu_emulator.host_syncs()


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args, argv)
    for case in results.rows(result):
        print(f"{case['mode']:>7} step {case['step']}: {case['h2d_bytes'] / 2**20:.3f} MiB copied, host syncs "
              f"{case['host_syncs']}, page table not copied {case['page_table_bytes_not_copied'] / 2**20:.0f} MiB")
    if args.out:
        results.write(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
