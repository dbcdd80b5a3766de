"""What each NPU verify scheme costs beyond FIA itself, at 128k context x batch 64 x k = 16, DCP 2.

    DCP_COMPILE_NPU_EMULATOR=1 python -m bench.npu_verify_cost --out bench/results/npu_verify_cost.json

Memory is measured on the emulated npu device: the ops each scheme adds run at full size there
(the body of dcp_npu.rank_causal_mask for 'mask'; dcp.window_attention's torch reference for 'split',
whose outputs the Triton kernel also allocates), and a dispatch mode adds up the bytes of every
tensor they allocate and of what outlives them (`kept_bytes`). FLOPs are derived
(2 x T x heads x keys x (R + P + R) per attention), as is the mask's read by FIA, once per layer.
Kimi-K2 shapes: 64 heads in all at TP = DCP = 2 (FIA runs the 64 gathered heads), R = 512, P = 64.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from bench.lib import result as results
from bench.lib.roofline import attention_flops
from dcp_compile.runtime import devices


class Allocations(TorchDispatchMode):
    """Bytes of the fresh tensors every op returns (outputs that alias an input are not new)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.bytes += t.untyped_storage().nbytes()
        return out


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/npu_verify_cost.json")
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--dcp-size", type=int, default=2)
    p.add_argument("--heads", type=int, default=64, help="FIA's query heads (gathered)")
    p.add_argument("--layers", type=int, default=61)
    args = p.parse_args(argv)
    os.environ.setdefault(devices.EMULATOR_ENV, "1")
    devices.require_torch_npu("bench.npu_verify_cost")
    import dcp_compile.ops.targets  # noqa: F401 - registers dcp::
    from dcp_compile.lowering.npu import ops as npu_ops
    from dcp_compile.ops import reference

    device = torch.device("npu", 0)
    rank_dim, rope_dim, block = 512, 64, 128
    local = args.context // args.dcp_size  # keys a row holds on one rank
    width = -(-local // block) * block
    tokens = args.batch * args.k
    rank = 1
    key_positions = (torch.arange(width, device=device) * args.dcp_size + rank).expand(args.batch, width).contiguous()
    local_lens = torch.full((args.batch,), local, device=device)
    first = args.context - args.k
    q_positions = (torch.arange(args.k, device=device) + first).repeat(args.batch)

    with Allocations() as mask_alloc:
        mask, visible = npu_ops.rank_causal_mask(key_positions, local_lens, q_positions, width)  # dcp_npu.rank_causal_mask
    mask_kept = nbytes(mask, visible)

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, args.heads, rank_dim, generator=gen).bfloat16().to(device)
    q_rope = torch.randn(tokens, args.heads, rope_dim, generator=gen).bfloat16().to(device)
    window = args.k
    rows = args.batch * width  # the window reads only the last `window` entries of each row
    latent = torch.zeros(rows, rank_dim, dtype=torch.bfloat16, device=device)
    rope = torch.zeros(rows, rope_dim, dtype=torch.bfloat16, device=device)
    page_table = (torch.arange(width, device=device)[None, :] + width * torch.arange(args.batch, device=device)[:, None])
    q_seq_ids = torch.arange(args.batch, device=device).repeat_interleave(args.k)
    out_prefix = torch.zeros_like(q)
    lse_prefix = torch.zeros(tokens, args.heads, dtype=torch.float32, device=device)
    with Allocations() as split_alloc:
        out, lse = reference.window_attention(out_prefix, lse_prefix, q, q_rope, latent, page_table, local_lens,
                                              key_positions, q_seq_ids, q_positions, 1.0, window, rope)
    split_kept = nbytes(out, lse)

    fia_flops = attention_flops(args.heads, tokens * local, rank_dim, rope_dim)  # every query over every local key
    window_keys = -(-args.k // args.dcp_size)
    result = results.start("npu_verify_cost", argv)
    result["machine"]["device"] = "emulated npu (host memory)"
    result["run"].update({
        "shapes": {"context": args.context, "batch": args.batch, "k": args.k, "dcp_size": args.dcp_size,
                   "heads": args.heads, "kv_lora_rank": rank_dim, "rope_dim": rope_dim, "block_size": block,
                   "local_keys_per_row": local, "mask_width": width, "layers": args.layers},
        "mask": {
            "kept_bytes_per_step": mask_kept, "allocated_bytes_per_step": mask_alloc.bytes,
            "mask_read_bytes_per_step": nbytes(mask) * args.layers,
            "flops_per_layer": fia_flops,
            "note": "one mask per step (every layer reads it); one FIA call per layer",
        },
        "split": {
            "kept_bytes_per_layer": split_kept,
            "allocated_bytes_per_layer_by_the_torch_reference": split_alloc.bytes,
            "flops_per_layer": attention_flops(args.heads, tokens * (local - window_keys + window), rank_dim, rope_dim),
            "window_flops_fraction": window / local,
            "note": "FIA over the keys before each row's first query, plus the window kernel's out and lse per layer "
                    "(the Triton kernel, which the NPU lowering runs, allocates only those; the torch reference's "
                    "temporaries are shown apart)",
        },
        "kv_read_bytes_per_layer": args.batch * local * (rank_dim + rope_dim) * 2,
    })
    results.write(result, args.out)
    run = result["run"]
    mib = 2 ** 20
    print(f"mask : {mask_kept / mib:.1f} MiB kept ({mask_alloc.bytes / mib:.1f} MiB allocated) per step; FIA reads it "
          f"in each of {args.layers} layers: {nbytes(mask) * args.layers / 2**30:.2f} GiB a step")
    print(f"split: {split_kept / mib:.1f} MiB of window output per layer (reused; the torch reference allocates "
          f"{split_alloc.bytes / mib:.0f} MiB of temporaries the Triton kernel does not)")
    print(f"FLOPs per layer: mask {run['mask']['flops_per_layer'] / 1e12:.3f} T, split "
          f"{run['split']['flops_per_layer'] / 1e12:.3f} T; KV read per layer "
          f"{run['kv_read_bytes_per_layer'] / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
