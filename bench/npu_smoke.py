"""Ascend smoke benchmark, for anyone with an Ascend machine: is DCP right there, and how fast is
one decode attention layer with NPU graphs.

    torchrun --nproc-per-node 2 -m bench.npu_smoke --out bench/results/npu_smoke.json   # 2 NPUs, HCCL
    python -m bench.npu_smoke --standin --out /tmp/npu_smoke.json                      # emulated NPU, stand-ins

On NPUs (torch_npu, CANN >= 8.5):
  - correctness: DCP = 2 against DCP = 1 under the NPU lowering (FIA + npu_attention_update),
    decode and verify with k = 7, the tiny-512 model in bf16 (dcp_compile.harness.scenario);
  - timing: one MLA decode attention layer at Kimi-K2 shapes (64 heads in all, TP = 2, R = 512,
    P = 64, bf16, FIA block size 128), DCP = 1 and DCP = 2 side by side, replayed from NPU graphs
    whose FIA lengths are refreshed before every replay; median step time, slowest rank;
  - both for each of --kernels (npu_kernels: native, the default, and triton, side by side, so
    that a hardware owner sees which is faster) and each of --combos, the lowering's A5 options side by side (KV format nd|nz, FIA
    version 1|2, verify split|mask; docs/ascend.md §15): correctness of verify k = 7 per
    combination, the decode layer's time per (format, version).
Its result (bench.lib.result's schema) holds the shapes, an attention_layer row per timed case
(the part bench.decode writes) and a correctness row per verdict.
`--standin` runs the same script on 2 ranks of the emulated NPU (dcp_compile/testing/npu_emulator:
DCP_COMPILE_NPU_EMULATOR=1, HCCL over gloo, NPU graphs that record and replay) against the
stand-ins, at tiny contexts, to check the script itself; CI runs it. Its times say nothing about
Ascend.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import dcp_compile
from bench.lib import result as results
from bench.lib.cases import AttentionLayer
from bench.lib.timing import slowest
from dcp_compile.harness import scenario as scenarios
from dcp_compile.runtime import devices, parallel
from dcp_compile.runtime.batch import RequestTable
from dcp_compile.runtime.graph_runner import NPUGraphs
from dcp_compile.runtime.launch import init_from_env, spawn

CORRECTNESS = [  # Scenario arguments: made on the ranks, where the npu device is there (on device="npu")
    dict(mode="decode", dcp_size=2, tp_size=2, batch=5, contexts=(1, 3, 130, 300, 17), steps=8,
         kernels="npu", model="tiny-512", dtype="bfloat16", block_size=16),
    dict(mode="verify", draft_len=7, dcp_size=2, tp_size=2, batch=4, contexts=(1, 3, 130, 40), steps=4,
         kernels="npu", model="tiny-512", dtype="bfloat16", block_size=16),
]
VERDICT_KEYS = ("mode", "dcp_size", "tp_size", "tokens_match", "near_tie_flips", "outputs_match", "max_abs_diff",
                "tolerance", "finite", "graphs_captured", "graph_keys", "seconds")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/npu_smoke.json")
    p.add_argument("--contexts", default="8192,32768,131072")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--heads", type=int, default=64, help="query heads in all (Kimi-K2: 64)")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--combos", default="nd:1:split,nd:2:mask,nz:1:split,nz:2:split,nz:2:mask",
                   help="npu_kv_format:fia_version:npu_verify combinations to check and time (apply's options)")
    p.add_argument("--kernels", default="native,triton",
                   help="npu_kernels values to check and time side by side (triton: A2/A3 with a paired "
                        "triton-ascend; --standin: native only unless TRITON_INTERPRET=1)")
    p.add_argument("--standin", action="store_true", help="the emulated NPU and the stand-ins, tiny contexts")
    args = p.parse_args(argv)
    args.kernels = [k for k in args.kernels.split(",") if k]
    if args.standin and os.environ.get("TRITON_INTERPRET") != "1":
        args.kernels = [k for k in args.kernels if k != "triton"]
    args.combos = [dict(zip(("npu_kv_format", "fia_version", "npu_verify"), (f, int(v), m)))
                   for f, v, m in (c.split(":") for c in args.combos.split(",") if c)]
    if args.standin:
        args.contexts, args.batches, args.block_size, args.replays = "300", "4", 128, 2
    args.contexts = [int(v) for v in args.contexts.split(",") if v]
    args.batches = [int(v) for v in args.batches.split(",") if v]
    return args


STANDIN_CORRECTNESS = dict(steps=2, contexts=(1, 40, 17))
"""--standin: fewer and shorter steps, decode only (the script is checked; tests/distributed/
test_npu_lowering.py checks the numbers on the emulator at length)."""


A5_VERIFY = dict(mode="verify", draft_len=7, dcp_size=2, tp_size=2, batch=4, contexts=(1, 3, 130, 40), steps=4,
                 kernels="npu", model="tiny-512", dtype="bfloat16", block_size=128)
"""Verify k = 7 with FIA blocks of 128 (NZ takes no other), run once per --combos entry."""


def correctness(rank: int, world: int, device: str, combos: list[dict], kernels: list[str],
                standin: bool = False) -> list[dict]:
    if standin:  # the script is checked: one short decode case, and the last combination's verify
        combos = combos[-1:]
    cases = [(arguments, {"npu_kernels": k}) for arguments in CORRECTNESS[: 1 if standin else None] for k in kernels]
    cases += [(A5_VERIFY, {**combo, "npu_kernels": k}) for combo in combos for k in kernels]
    verdicts = []
    for arguments, combo in cases:
        if standin:
            arguments = {**arguments, **STANDIN_CORRECTNESS, "batch": len(STANDIN_CORRECTNESS["contexts"])}
        case = scenarios.Scenario(**arguments, options=combo, device=device)
        result = scenarios.run_on_rank(rank, world, case)
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        verdict = scenarios.summarize(case, gathered)
        verdicts.append({**{key: verdict[key] for key in VERDICT_KEYS}, **combo})
    return verdicts


class Stepper:
    """One layer's decode step; replayed from an NPU graph with its FIA lengths refreshed, or eager."""

    def __init__(self, model, inputs, host, device):
        self.model, self.inputs, self.host, self.device = model, inputs, host, device
        self.graph = self.updates = None
        state = dcp_compile.state(model)
        if device.type == "npu":
            self.graphs = NPUGraphs()
            slot = state.host_slot
            slot.begin(host)
            self.graph, _ = self.graphs.capture(lambda: model.compiled("gather-q")(*inputs))
            slot.end()
            self.updates = [update for feed in slot.fed for update in feed.graph_updates(feed.rank_view(host)) or []]

    def __call__(self):
        if self.graph is not None:
            self.graphs.replay(self.graph, self.updates)
        else:
            self.model(*self.inputs, host_metadata=self.host)

    def median_seconds(self, replays: int) -> float:
        self()
        seconds = []
        for _ in range(replays):
            self._sync()
            start = time.perf_counter()
            self()
            self._sync()
            seconds.append(time.perf_counter() - start)
        return statistics.median(seconds)

    def _sync(self):
        if self.device.type == "npu":
            torch.npu.synchronize()


def decode_batch(table: RequestTable, batch: int, context: int, device):
    """Every request holds `context` tokens; the step appends one each."""
    for request in range(batch):
        table.append(request, context - 1)
    step = table.extend_batch(list(range(batch)), [[1]] * batch)
    return step.to(device)


def bench_attention_layer(args, dcp_size: int, device, tp, options: dict | None = None) -> list[dict]:
    options = options or {}
    heads_local = args.heads // 2
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            page_size = args.block_size * dcp_size
            capacity = (batch * (-(-context // page_size)) + 1) * page_size
            layer = AttentionLayer(heads_local, 512, 64, capacity, torch.bfloat16, device, tp, page_size)
            model = dcp_compile.apply(layer, dcp_size, kernels="npu", attention_strategy="gather-q", kv_keep="capacity",
                                      **options)
            table = RequestTable(batch, context, model.dcp_state.kv_pool.capacity, page_size, dcp_size=dcp_size)
            step = decode_batch(table, batch, context, device)
            gen = torch.Generator(device=device).manual_seed(batch * 7 + context)

            def rand(*shape):
                return torch.randn(*shape, generator=gen, device=device).to(torch.bfloat16)

            inputs = (rand(batch, heads_local, 512), rand(batch, heads_local, 64), rand(batch, 512), rand(batch, 64),
                      step.out_loc, step.req_to_token, step.seq_lens, step.q_seq_ids, step.positions)
            stepper = Stepper(model, inputs, step.host, device)
            rows.append({"dcp_size": dcp_size, "context": context, "batch": batch, **options,
                         "step_seconds": slowest(stepper.median_seconds(args.replays), device),
                         "graph": stepper.graph is not None})
            del model, layer, stepper
    return rows


def run(rank: int, world: int, args) -> dict:
    device = torch.device("npu", torch.npu.current_device())
    started = time.time()
    tp = parallel.build(2, 1)
    result = results.start("npu_smoke")
    result["machine"].update(device="emulated npu (stand-ins)" if args.standin else torch.npu.get_device_name(device),
                             ranks=world)
    result["run"]["shapes"] = {"heads_total": args.heads, "tp_size": 2, "kv_lora_rank": 512, "rope_dim": 64,
                               "dtype": "torch.bfloat16", "block_size": args.block_size}
    results.add(result, "correctness", *correctness(rank, world, "npu", args.combos, args.kernels, args.standin))
    results.add(result, "attention_layer", *[row for layout in _layouts(args) for n in (1, 2)
                                             for row in bench_attention_layer(args, n, device, tp, layout)])
    result["run"]["seconds"] = time.time() - started
    return result


def _layouts(args) -> list[dict]:
    """The (KV format, FIA version) pairs of --combos, each timed once (decode has no verify scheme);
    --standin: the last only."""
    pairs = list(dict.fromkeys((c["npu_kv_format"], c["fia_version"]) for c in args.combos)) or [("nd", 1)]
    if args.standin:
        pairs = pairs[-1:]
    return [dict(npu_kv_format=f, fia_version=v, npu_kernels=k) for f, v in pairs for k in args.kernels]


def _spawned(rank: int, world: int, args) -> dict:
    return run(rank, world, args)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.standin:
        os.environ[devices.EMULATOR_ENV] = "1"  # before the ranks start: they inherit it
        result = spawn(_spawned, 2, args, backend="hccl")[0]
    else:
        rank, world = init_from_env("hccl")
        if world != 2:
            raise SystemExit(f"bench.npu_smoke runs on 2 ranks (torchrun --nproc-per-node 2 -m bench.npu_smoke), "
                             f"got {world}")
        result = run(rank, world, args)
        dist.destroy_process_group()
        if rank != 0:
            return 0
    results.write(result, args.out)
    verdicts = results.rows(result, "correctness")
    for verdict in verdicts:
        print(f"{verdict['mode']:>6}: tokens_match {verdict['tokens_match']}, outputs_match {verdict['outputs_match']} "
              f"(max abs diff {verdict['max_abs_diff']:.3g} / {verdict['tolerance']:.3g})")
    for row in results.rows(result, "attention_layer"):
        print(f"DCP {row['dcp_size']}  context {row['context']:>6}  batch {row['batch']:>3}: "
              f"{row['step_seconds'] * 1e6:9.1f} us ({'graph' if row['graph'] else 'eager'})")
    ok = all(v["tokens_match"] and v["outputs_match"] and v["finite"] for v in verdicts)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
