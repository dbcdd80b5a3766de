"""DCP peers agree on each batch shape: ranks given different batches get a clear error instead
of a hang or garbage from collectives paired with the wrong peer's."""

from __future__ import annotations

import torch
import torch.distributed as dist

MAX_AGREED_SHAPES = 4096
"""Batch shapes whose agreement is remembered (then checked anew): bounded memory for a
scheduler that never pads."""


class ShapeAgreement:
    def __init__(self, dcp_size: int, dcp_rank: int, group_name: str | None):
        self.dcp_size, self.dcp_rank, self.group_name = dcp_size, dcp_rank, group_name
        self._agreed: set[tuple] = set()

    def check(self, args, kwargs, variant: int) -> None:
        """At the first step of each (shapes, variant), one all-gather of one int over the DCP group."""
        if self.dcp_size == 1:
            return
        tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
        key = (tuple(tuple(t.shape) for t in tensors), variant)
        if key in self._agreed:
            return
        if len(self._agreed) >= MAX_AGREED_SHAPES:
            self._agreed.clear()
        signature = torch.tensor([hash(key) & ((1 << 62) - 1)], dtype=torch.int64, device=tensors[0].device)
        group = dist.distributed_c10d._resolve_process_group(self.group_name)
        gathered = torch.empty(self.dcp_size, dtype=torch.int64, device=signature.device)
        dist.all_gather_into_tensor(gathered, signature, group=group)
        if bool((gathered != signature).any()):
            raise ValueError(
                f"DCP rank {self.dcp_rank} was given a batch of shapes {list(key[0])}, and a DCP peer a different one: "
                "every rank of a DCP group must run the same step with the same batch"
            )
        self._agreed.add(key)
