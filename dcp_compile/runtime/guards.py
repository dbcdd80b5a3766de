"""Device-side error flags: bad batch input that a kernel met, reported without a host sync.

A kernel never acts on input that would make it write or read outside the KV pool (a write
location outside it, a page-table entry outside it, a sequence length wider than the page table,
a row id out of range) and never lets a real token pass for padding. On the CPU the torch
reference raises at once, on every rank (each checks the whole, replicated batch). On a device
it masks the input and sets that error's flag instead; the compiled model copies the flags to
the host without waiting and raises at its next step (dcp_compile.api), on every rank alike.
"""

from __future__ import annotations

import torch

ERRORS = (
    ("write_location", IndexError, "a KV write location outside the pool (the KV writer dropped it)"),
    ("page_table_entry", IndexError, "a page-table entry in use outside the pool (attention read location 0 instead)"),
    ("seq_len", ValueError, "a seq_len outside [0, page-table width] (attention clamped it)"),
    ("row_id", ValueError, "a query's row id (q_seq_ids) outside [0, rows) (attention used the nearest row)"),
    ("padded_row_write", ValueError, "a row of seq_len 0 (a padded row) whose token writes KV: a real row taken "
                                     "for padding (its attention saw no key)"),
    ("peer_step", ValueError, "the DCP ranks ran different decode steps (their shapes, cache position, token ids or "
                              "padding differ; every rank of a DCP group must run the same step with the same batch)"),
)
INDEX = {name: i for i, (name, _, _) in enumerate(ERRORS)}

_FLAGS: dict[torch.device, torch.Tensor] = {}


def error_flags(device: torch.device) -> torch.Tensor:
    """This device's flags, int32 [len(ERRORS)], one per error, set to 1 by a kernel that met it.
    Allocated once and never moved, so captured graphs keep writing the same buffer."""
    device = torch.device(device)
    if device not in _FLAGS:
        _FLAGS[device] = torch.zeros(len(ERRORS), dtype=torch.int32, device=device)
    return _FLAGS[device]


def allocated_flags(device: torch.device) -> torch.Tensor | None:
    """The device's flags if a kernel there ever used them, else None (nothing to read back)."""
    return _FLAGS.get(torch.device(device))


def raise_for(values) -> None:
    """Raise for the set flags among `values` (host ints, in ERRORS order), naming every one."""
    found = [(kind, message) for (_, kind, message), value in zip(ERRORS, values) if value]
    if found:
        kind = IndexError if any(k is IndexError for k, _ in found) else ValueError
        raise kind("bad batch input in this or the previous step: " + "; ".join(m for _, m in found)
                   + ". Run with debug_checks=True to see where")


class ErrorWatcher:
    """Reads a device's error flags back after each step without stalling it, and raises for a
    set flag at the next step (at once on the CPU, where reading costs nothing)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._pending = None
        self._host: torch.Tensor | None = None

    def watch(self) -> None:
        """Start reading the flags this step may have set."""
        flags = allocated_flags(self.device)
        if flags is None:
            return
        if flags.device.type == "cpu":
            self._pending = (flags, None)
            self.raise_if_set(wait=True)
            return
        if self._host is None:  # pinned once: no host allocation per step
            self._host = torch.zeros(flags.shape, dtype=flags.dtype, pin_memory=True)
        self._host.copy_(flags, non_blocking=True)  # the flags are sticky: a newer copy covers older steps
        event = getattr(torch, flags.device.type).Event()
        event.record()
        self._pending = (self._host, event)

    def raise_if_set(self, wait: bool) -> None:
        """Raise for the flags read back (waiting for them if `wait`), and clear them."""
        if self._pending is None:
            return
        host, event = self._pending
        if event is not None and not event.query():  # a finished event needs no wait
            if not wait:
                return  # not read back yet: checked at a later step
            event.synchronize()
        self._pending = None
        values = host.tolist()
        if any(values):
            allocated_flags(self.device).zero_()
            raise_for(values)
