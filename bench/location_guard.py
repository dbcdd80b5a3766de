"""What the KV writer's location guard costs on a decode step (issue: no KV write outside the pool).

    python -m bench.location_guard --out bench/results/location_guard_h200.json

The Triton writer checks every location against the pool (a negative one, or one past the last
row, is never written). The guard is two integer comparisons per token inside the writer, so the
whole writer's time bounds its cost from above. Measured on one GPU, in CUDA graphs, at batch 64:
  - the writer alone (64 tokens, R = 512, P = 64, bf16), guarded as shipped;
  - one MLA decode attention layer at DCP = 1 (KV write, attention over 32 heads) at 8k and 32k.
The JSON records writer / layer: the guard's share of a decode step is below that.
"""

from __future__ import annotations

import argparse

import torch

import dcp_compile
from bench.lib import result as results
from bench.lib.cases import AttentionLayer, decode_page_table, fill_random
from bench.lib.timing import require_cuda, time_graph
from dcp_compile.lowering import triton as kernels
from dcp_compile.runtime import parallel


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/location_guard.json")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--contexts", default="8192,32768")
    p.add_argument("--replays", type=int, default=30)
    args = p.parse_args(argv)
    require_cuda("bench.location_guard")
    device = torch.device("cuda")
    result = results.start("location_guard", argv, device)
    batch, heads, rank_dim, rope_dim = args.batch, 32, 512, 64
    gen = torch.Generator(device=device).manual_seed(0)
    for context in [int(c) for c in args.contexts.split(",")]:
        capacity = batch * context + 2
        layer = AttentionLayer(heads, rank_dim, rope_dim, capacity, torch.bfloat16, device, parallel.ParallelState())
        model = dcp_compile.apply(layer, 1, attention_strategy="gather-q")
        fill_random(layer.kv_pool.cache(0))
        table = decode_page_table(batch, context, context, device)

        def rand(*shape):
            return torch.randn(*shape, generator=gen, device=device).to(torch.bfloat16)

        inputs = (rand(batch, heads, rank_dim), rand(batch, heads, rope_dim), rand(batch, rank_dim), rand(batch, rope_dim),
                  table[:, context - 1].clone(), table, torch.full((batch,), context, device=device),
                  torch.arange(batch, device=device), torch.full((batch,), context - 1, device=device))
        step = model.compiled("gather-q")
        layer_seconds = time_graph(lambda i: step(*inputs), 10, args.replays)
        cache = layer.kv_pool.cache(0)
        writer_seconds = time_graph(lambda i: kernels.kv_write(cache, inputs[2], inputs[3], inputs[4]), 10, args.replays)
        results.add(result, results.MAIN, {"context": context, "batch": batch, "layer_seconds": layer_seconds,
                                           "writer_seconds": writer_seconds,
                                           "writer_share_of_layer": writer_seconds / layer_seconds})
        print(f"context {context:>6} batch {batch}: layer {layer_seconds * 1e6:8.1f} us, writer {writer_seconds * 1e6:6.2f} us "
              f"({100 * writer_seconds / layer_seconds:.2f}% of the layer; the guard is a part of that)")
        del model, layer, cache
    results.write(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
