"""Symbolic batch shapes: one compiled graph for every token and row count of a step.

A scheduler that never pads gives every prefill a new token count. Compiled with static shapes,
each would be a new graph (seconds of compile and megabytes of host memory each, and an error
at dynamo's graph limit). The compiled model instead marks the first dimension of each tensor
argument dynamic, so prefill, extend, decode and verify batches share a few graphs: dynamo
specialises sizes 0 and 1, so a batch of one row, or of one token, gets its own graph.

Graphs whose kernels take one host input a row (FIA's lengths) and graphs a graph runner
captures keep static shapes (Lowering.static_shapes).
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx.experimental._config as fx_config

_NO_DUCK_SHAPES = fx_config.patch(use_duck_shape=False)
"""Made once: each patch() object keeps a ContextVar in the thread's context for good (236 bytes a call)."""


def symbolic_batch(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's arguments with every tensor replaced by a new tensor object of the same memory
    and version counter (`detach`), its first dimension marked dynamic.

    The marks go on the new objects: a mark sticks to a tensor, and on a caller's own tensor it
    would make a later static compile of that tensor (a graph capture) symbolic too."""

    def mark(value):
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        marked = value.detach()
        torch._dynamo.maybe_mark_dynamic(marked, 0)
        return marked

    return tuple(mark(a) for a in args), {k: mark(v) for k, v in kwargs.items()}


@contextlib.contextmanager
def distinct_sizes():
    """Dynamo gives dimensions of equal size one symbol (duck sizing) and then guards on the
    equality: a prefill of 4 tokens over 4 rows would make a graph that only serves T == B. Off
    while a symbolic step compiles, every marked dimension gets its own symbol."""
    with _NO_DUCK_SHAPES:
        yield


SIZE_OBLIVIOUS_SUPPORTED = hasattr(fx_config, "backed_size_oblivious")
_SIZE_OBLIVIOUS = fx_config.patch(backed_size_oblivious=True) if SIZE_OBLIVIOUS_SUPPORTED else contextlib.nullcontext()


@contextlib.contextmanager
def size_oblivious():
    """Dynamo specialises a dimension of size 0 or 1 (a graph of its own); under this, a marked
    dimension of size 1 stays symbolic, so a graph runner's bucket of one row is captured from
    the same compile as the others."""
    with _SIZE_OBLIVIOUS:
        yield
