"""What the KV writer's location guard costs on a decode step (issue: no KV write outside the pool).

    python bench/location_guard.py --out bench/results/location_guard_h200.json

The Triton writer checks every location against the pool (a negative one, or one past the last
row, is never written). The guard is two integer comparisons per token inside the writer, so the
whole writer's time bounds its cost from above. Measured on one GPU, in CUDA graphs, at batch 64:
  - the writer alone (64 tokens, R = 512, P = 64, bf16), guarded as shipped;
  - one MLA decode attention layer at DCP = 1 (KV write, attention over 32 heads) at 8k and 32k.
The JSON records writer / layer: the guard's share of a decode step is below that.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import dcp_compile  # noqa: E402
from decode import AttentionLayer, decode_page_table, fill_random  # noqa: E402
from kernels import time_graph  # noqa: E402
from dcp_compile.lowering import triton as kernels  # noqa: E402
from dcp_compile.runtime import parallel  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/location_guard.json")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--contexts", default="8192,32768")
    p.add_argument("--replays", type=int, default=30)
    args = p.parse_args(argv)
    device = torch.device("cuda")
    batch, heads, rank_dim, rope_dim = args.batch, 32, 512, 64
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
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
        layer_seconds = time_graph(torch, lambda i: step(*inputs), 10, args.replays)
        cache = layer.kv_pool.cache(0)
        writer_seconds = time_graph(torch, lambda i: kernels.kv_write(cache, inputs[2], inputs[3], inputs[4]), 10, args.replays)
        rows.append({"context": context, "batch": batch, "layer_seconds": layer_seconds, "writer_seconds": writer_seconds,
                     "writer_share_of_layer": writer_seconds / layer_seconds})
        print(f"context {context:>6} batch {batch}: layer {layer_seconds * 1e6:8.1f} us, writer {writer_seconds * 1e6:6.2f} us "
              f"({100 * writer_seconds / layer_seconds:.2f}% of the layer; the guard is a part of that)")
        del model, layer, cache
    result = {"command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": {"platform": platform.platform(), "gpu": torch.cuda.get_device_name(device)},
              "versions": {"torch": torch.__version__, "triton": __import__("triton").__version__, "cuda": torch.version.cuda},
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
