"""Which aten ops torch_npu runs on the device, as the emulated device judges them.

An aten op runs on the host under torch_npu when it has no NPU kernel (torch_npu's PrivateUse1
fallback copies its inputs to the CPU, runs the CPU kernel and copies the result back, with a
warning: Ascend/pytorch torch_npu/csrc/aten/VariableFallbackKernel.cpp:225-242 @ 9e73e708), or
when its NPU kernel sends the arguments it is given to a CPU fallback of its own (FALLBACKS).
Either way the op reads the device on the host: a host sync in eager, and an error in an NPU
graph capture, where only device (aclnn) work can be recorded.

The kernels: npu_aten_ops.OPS (generated from op-plugin's yaml at a named commit), plus every op
with a composite kernel (torch runs those as the ops they are made of, each judged in turn when
it reaches the device). docs/ascend.md §16 lists the sources.
"""

from __future__ import annotations

import functools
import traceback
from pathlib import Path

import torch

from dcp_compile.testing.npu_emulator.npu_aten_ops import OPS

ON_DEVICE, OFF_DEVICE, CONDITIONAL = 0, 1, 2
_COMPOSITE_KEYS = ("CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional", "CompositeImplicitAutograd")


def _scatter_reduce_falls_back(self, dim, index, src, reduce, include_self=True, *_) -> bool:
    """op-plugin ScatterReduceKernelNpuOpApi.cpp @ 517f2e7d, scatter_reduce (lines 107-126) and
    scatter_reduce_ (144-160): only include_self with reduce "sum"/"add" on fp32, on a SoC older
    than Ascend950, reaches aclnnScatterReduce; everything else goes to scatter_reduce_cpu_fallback
    (lines 61-71: self.cpu(), index.cpu(), src.cpu(), then .to(self.options())). The emulated SoC
    is older than Ascend950."""
    return not (include_self and reduce in ("sum", "add") and self.dtype == torch.float32)


FALLBACKS = {
    "scatter_reduce.two": _scatter_reduce_falls_back,
    "scatter_reduce_.two": _scatter_reduce_falls_back,
}
"""NPU kernels that run some of their calls on the host, by table name: the condition, over the
op's arguments in schema order. Read in op-plugin @ 517f2e7d for every aten op of the project's
NPU graphs (docs/ascend.md §16): no other kernel of theirs leaves the device (the `.item()`
calls of the binary ops' kernels read 0-dim *host* tensors, as Python scalars)."""


def table_name(name: str, overload: str) -> str:
    """`name.overload` as the yaml files write it ("name" for the default overload)."""
    return name if overload in ("", "default") else f"{name}.{overload}"


def verdict(name: str, overload: str) -> int:
    """ON_DEVICE, OFF_DEVICE or CONDITIONAL (see falls_back) for an aten op that reaches the
    device's kernels (the emulator's C++ fallback asks once per op)."""
    key = table_name(name, overload)
    if key in FALLBACKS:
        return CONDITIONAL
    return ON_DEVICE if key in OPS or _functional_form(name, overload) in OPS else OFF_DEVICE


def _functional_form(name: str, overload: str) -> str:
    """The functional op of an out= overload (`index.Tensor_out` -> `index.Tensor`, `mm.out` ->
    `mm`). torch_npu registers a structured op's functional form itself; the emulator reaches it
    through torch's composite, which calls the out= form, so that form counts as the functional
    one (an out= call of its own with no NPU kernel is missed: a limit of the emulator)."""
    if overload == "out":
        return name
    return table_name(name, overload[:-4]) if overload.endswith("_out") else ""


def falls_back(name: str, overload: str, arguments) -> bool:
    """Whether a CONDITIONAL op runs these arguments (in schema order) on the host."""
    return FALLBACKS[table_name(name, overload)](*arguments)


@functools.lru_cache(maxsize=None)
def _verdict_of(func) -> int:
    if func.namespace != "aten":
        return ON_DEVICE
    key = table_name(func._schema.name.split("::")[-1], func._overloadname)
    if key in FALLBACKS:
        return CONDITIONAL
    if any(torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), k) for k in _COMPOSITE_KEYS):
        return ON_DEVICE
    return verdict(func._schema.name.split("::")[-1], func._overloadname)


def off_device(func, args, kwargs) -> bool:
    """Whether torch_npu runs this call of `func` (an OpOverload seen above the dispatcher, as in
    a capture) on the host."""
    decided = _verdict_of(func)
    if decided != CONDITIONAL:
        return decided == OFF_DEVICE
    arguments = [kwargs[a.name] if a.name in kwargs else args[i] if i < len(args) else a.default_value
                 for i, a in enumerate(func._schema.arguments)]
    return FALLBACKS[table_name(func._schema.name.split("::")[-1], func._overloadname)](*arguments)


_OWN = Path(__file__).parent
_TORCH = Path(torch.__file__).parent


def issuing_source() -> str:
    """The innermost frame outside torch and this emulator: the model or lowering code (or the
    compiled graph) that issued the op."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename)
        if _OWN not in path.parents and _TORCH not in path.parents and "contextlib" not in frame.filename:
            return f"{frame.filename}:{frame.lineno} ({frame.name}: {(frame.line or '').strip()})"
    return "unknown"
