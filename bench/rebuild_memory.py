"""Resident memory of a process that builds a model, runs a generate() and drops it, again and again
(as bench/load_test.py's restarts do), with torch._dynamo.reset() and a collection after each:
transformers eager, under a plain torch.compile, and under dcp_compile.apply at dcp_size 1.

Each variant runs in a fresh process; `per_rebuild_mib` is the least-squares slope of its resident
memory over the rebuilds after the first, and `models_alive` counts the dropped models that a weak
reference still reaches (0: nothing of dcp_compile keeps a dropped model).

    python -m bench.rebuild_memory                      # bench/results/rebuild_memory_cpu.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import weakref

import torch

from bench.lib import result as results
from bench.load_test import _resident_mib, _slope_per_100
from dcp_compile.runtime.launch import spawn

VARIANTS = ("eager", "torch.compile", "dcp_compile")


def _build(variant: str, reference):
    import dcp_compile

    model = copy.deepcopy(reference)
    if variant == "torch.compile":
        model.forward = torch.compile(model.forward, backend="eager", dynamic=True)
    elif variant == "dcp_compile":
        model = dcp_compile.apply(model, dcp_size=1, kv_capacity=256)
    return model


def run_variant(rank: int, world: int, variant: str, rebuilds: int) -> dict:
    from tests.hf.models import tiny_model

    reference, input_ids = tiny_model(0), torch.tensor([[5, 6, 7, 8, 9]])
    memory, alive = [], []
    for _ in range(rebuilds):
        model = _build(variant, reference)
        with torch.no_grad():
            model.generate(input_ids, max_new_tokens=3, do_sample=False)
        alive.append(weakref.ref(model))
        del model
        gc.collect()
        torch._dynamo.reset()
        gc.collect()
        memory.append(_resident_mib())
    return {"variant": variant, "rebuilds": rebuilds, "memory_mib": memory,
            "per_rebuild_mib": _slope_per_100(memory[1:]) / 100, "models_alive": sum(r() is not None for r in alive)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rebuilds", type=int, default=12)
    parser.add_argument("--out", default="bench/results/rebuild_memory_cpu.json")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    if args.rebuilds < 3:
        parser.error(f"--rebuilds {args.rebuilds}: at least 3 (a slope over the rebuilds after the first)")
    result = results.start("rebuild_memory", argv)
    for variant in VARIANTS:
        (row,) = spawn(run_variant, 1, variant, args.rebuilds)
        results.add(result, "cases", row)
        print(f"{variant:14s} {row['per_rebuild_mib']:.2f} MiB per rebuild, {row['memory_mib'][0]:.0f} -> "
              f"{row['memory_mib'][-1]:.0f} MiB over {row['rebuilds']}, dropped models alive: {row['models_alive']}")
    if not args.no_save:
        results.write(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
