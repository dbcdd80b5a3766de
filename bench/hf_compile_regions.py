"""An unmodified transformers DeepSeek-V3's first generate() against its layer count, with and
without compile regions (apply(..., regions=True), dcp_compile/hf/regions.py), side by side.

    torchrun --nproc-per-node 2 -m bench.hf_compile_regions --out bench/results/hf_compile_regions_cpu.json
    python -m bench.hf_compile_regions --smoke --out /tmp/hf_compile_regions.json    # checks the script

The model: tests' tiny DeepSeek-V3 config (fp32, CPU) at --layers decoder layers, the first one
dense and the rest MoE (Kimi-K2's first_k_dense_replace = 1), at DCP = the world size. Per case:
  - first_generate_seconds: generate() of --new-tokens tokens after a prompt of 5, the first
    call (dynamo, the absorb and DCP passes, the inner compile of the prefill and decode graphs);
  - token_seconds: the median decode token of a second generate() (no compile);
  - absorbed_sites: absorbed attention sites per graph (one per kind of layer with regions);
  - tokens_equal, max_logit_diff: against transformers' own generate().
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist

import dcp_compile
from bench.lib import result as results
from dcp_compile.runtime.launch import init_from_env


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/hf_compile_regions_cpu.json")
    p.add_argument("--layers", default="4,16,61")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--smoke", action="store_true", help="layers 2 and 3, 3 tokens: checks the script")
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.new_tokens = "2,3", 3
    args.layers = [int(v) for v in args.layers.split(",") if v]
    return args


def _generate(model, input_ids, new_tokens: int):
    with torch.no_grad():
        out = model.generate(input_ids, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


class _TokenClock:
    """Times each step of a generate() (forward hooks on the transformers model: its forward's
    signature, which generate() reads, stays as it is)."""

    def __init__(self, model):
        self.seconds, self._start = [], 0.0
        self._hooks = [model.model.register_forward_pre_hook(lambda *_: self._begin()),
                       model.model.register_forward_hook(lambda *_: self._end())]

    def _begin(self):
        self._start = time.perf_counter()

    def _end(self):
        self.seconds.append(time.perf_counter() - self._start)

    def close(self):
        for hook in self._hooks:
            hook.remove()


def run_case(reference, input_ids, want, layers: int, regions: bool, dcp: int, new_tokens: int) -> dict:
    torch._dynamo.reset()
    model = dcp_compile.apply(copy.deepcopy(reference), dcp_size=dcp, regions=regions)
    start = time.perf_counter()
    got = _generate(model, input_ids, new_tokens)
    first = time.perf_counter() - start
    clock = _TokenClock(model)
    _generate(model, input_ids, new_tokens)
    clock.close()
    state = dcp_compile.state(model)
    return dict(layers=layers, regions=regions, first_generate_seconds=first,
                token_seconds=statistics.median(clock.seconds[1:]),
                absorbed_sites=[r.sites("absorb_mla") for r in state.reports],
                tokens_equal=bool(torch.equal(got[0], want[0])), max_logit_diff=float((got[1] - want[1]).abs().max()))


def main(argv=None) -> int:
    from tests.hf.models import prompt, tiny_model

    args = parse_args(argv)
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29543"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)
    init_from_env("gloo")
    dcp, rank = dist.get_world_size(), dist.get_rank()
    torch._inductor.config.force_disable_caches = True
    result = results.start("hf_compile_regions", argv, torch.device("cpu"))
    result["run"].update(model="tests.hf.models.tiny_model deepseek_v3, first_k_dense_replace 1", dcp_size=dcp,
                         new_tokens=args.new_tokens, kernels="torch", inner_compile="eager")
    for layers in args.layers:
        reference = tiny_model(num_hidden_layers=layers, first_k_dense_replace=1)
        input_ids = prompt()
        want = _generate(reference, input_ids, args.new_tokens)
        rows = [run_case(reference, input_ids, want, layers, regions, dcp, args.new_tokens) for regions in (False, True)]
        results.add(result, results.MAIN, *rows)
        if rank == 0:
            plain, regional = rows
            print(f"{layers:>3} layers: first generate {plain['first_generate_seconds']:6.1f} s -> "
                  f"{regional['first_generate_seconds']:6.1f} s with regions, token {plain['token_seconds'] * 1e3:6.1f} -> "
                  f"{regional['token_seconds'] * 1e3:6.1f} ms, absorbed sites a graph {plain['absorbed_sites']} -> "
                  f"{regional['absorbed_sites']}, tokens equal {plain['tokens_equal']}/{regional['tokens_equal']}, "
                  f"logits {plain['max_logit_diff']:.1e}/{regional['max_logit_diff']:.1e}", flush=True)
    if rank == 0:
        results.write(result, args.out)
        print(f"wrote {args.out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
