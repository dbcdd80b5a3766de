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

An op on the device may still be one an NPU graph cannot capture: only aclnn (op-plugin `op_api`)
kernels enter a graph (npu_aten_ops.CAPTURE_RULE), and npu_aten_ops.ACL_OP_ONLY lists the ops with an
acl_op kernel only on some supported torch_npu (`capturable`). Eager runs them on the device.
"""

from __future__ import annotations

import functools
import traceback
from pathlib import Path

import torch

from dcp_compile.testing.npu_emulator.npu_aten_ops import CAPTURABLE, OPS

ON_DEVICE, OFF_DEVICE, CONDITIONAL, SYNCS_STREAM = 0, 1, 2, 3
_COMPOSITE_KEYS = ("CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional", "CompositeImplicitAutograd")


def _scatter_reduce_falls_back(self, dim, index, src, reduce, include_self=True, *_) -> bool:
    """op-plugin ScatterReduceKernelNpuOpApi.cpp @ 517f2e7d, scatter_reduce (lines 107-126) and
    scatter_reduce_ (144-160): only include_self with reduce "sum"/"add" on fp32, on a SoC older
    than Ascend950, reaches aclnnScatterReduce; everything else goes to scatter_reduce_cpu_fallback
    (lines 61-71: self.cpu(), index.cpu(), src.cpu(), then .to(self.options())). The SoC is
    $DCP_COMPILE_NPU_EMULATOR_SOC (torch.npu.get_soc_version(); Ascend950 is 260)."""
    older_than_950 = torch.npu.get_soc_version() < 260
    return not (older_than_950 and include_self and reduce in ("sum", "add") and self.dtype == torch.float32)


FALLBACKS = {
    "scatter_reduce.two": _scatter_reduce_falls_back,
    "scatter_reduce_.two": _scatter_reduce_falls_back,
}
"""NPU kernels that run some of their calls on the host, by table name: the condition, over the
op's arguments in schema order. Read in op-plugin @ 517f2e7d for every aten op of the project's
NPU graphs (docs/ascend.md §16): no other kernel of theirs leaves the device (the `.item()`
calls of the binary ops' kernels read 0-dim *host* tensors, as Python scalars)."""


OWN_KERNELS = ("convolution",)
"""Ops torch_npu registers a kernel of its own for (npu_aten_ops) where torch's PrivateUse1 path is
an op no CPU kernel serves (convolution -> convolution_overrideable): the emulator runs them whole
(a linear-attention layer's short causal conv1d, Kimi-Linear's KDA)."""


def _always(*_) -> bool:
    return True


def _has_bool_index(self, indices, *_) -> bool:
    """op-plugin AdvancedIndex.cpp:302-330 @ 517f2e7d: npu_expand_tensors replaces a bool/uint8
    index by its nonzero(), whose aclnnNonzeroV2 runs with EXEC_NPU_CMD_SYNC (line 87); called by
    index.Tensor (IndexKernelNpuOpApi.cpp:48)."""
    return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _no_output_size(*arguments) -> bool:
    """repeat_interleave without output_size reads the repeats' sum on the host: .item() in
    RepeatInterLeaveKernelNpuOpApi.cpp:238-239 (repeats only) and KernelNpuOutputSize.cpp:1909,
    1919 (self_Tensor, via repeat_interleave_npu_output_size_opapi) @ 517f2e7d."""
    return arguments[-1] is None


SYNCS = {
    # EXEC_NPU_CMD_SYNC (op_api_common.h:744-812) ends in OpCommand::RunOpApiV2(..., sync=true),
    # which calls aclrtSynchronizeStream (Ascend/pytorch OpCommand.cpp:279-281 @ 9e73e708); the
    # kernel then reads the output's real shape (aclGetViewShape) and resizes it.
    "nonzero": _always,  # NonzeroKernelNpuOpApi.cpp:32 (nonzero :62, nonzero_out :50)
    "nonzero.out": _always,
    "masked_select": _always,  # MaskedSelectKernelNpuOpApi.cpp:51 (masked_select :73)
    "masked_select.out": _always,  # :85
    "index.Tensor": _has_bool_index,
    "_unique": _always,  # _UniqueKernelNpuOpApi.cpp:101-102
    "_unique2": _always,  # Unique2KernelNpuOpApi.cpp:85-86
    "unique_dim": _always,  # UniqueDimKernelNpuOpApi.cpp:63
    "unique_consecutive": _always,  # UniqueConsecutiveKernelNpuOpApi.cpp:66
    "repeat_interleave.Tensor": _no_output_size,
    "repeat_interleave.self_Tensor": _no_output_size,
}
"""NPU kernels that synchronise the stream to learn their output's size (data-dependent shapes),
by table name: the condition over the op's arguments in schema order. A host sync in eager, an
error in a capture (the kernel's output shape would be the capture's)."""


def table_name(name: str, overload: str) -> str:
    """`name.overload` as the yaml files write it ("name" for the default overload)."""
    return name if overload in ("", "default") else f"{name}.{overload}"


def verdict(name: str, overload: str) -> int:
    """ON_DEVICE, OFF_DEVICE or CONDITIONAL (see falls_back) for an aten op that reaches the
    device's kernels (the emulator's C++ fallback asks once per op)."""
    key = table_name(name, overload)
    if key in FALLBACKS or key in SYNCS and SYNCS[key] is not _always:
        return CONDITIONAL
    if key in SYNCS:
        return SYNCS_STREAM
    return ON_DEVICE if key in OPS or _functional_form(name, overload) in OPS else OFF_DEVICE


def _functional_form(name: str, overload: str) -> str:
    """The functional op of an out= overload (`index.Tensor_out` -> `index.Tensor`, `mm.out` ->
    `mm`). torch_npu registers a structured op's functional form itself; the emulator reaches it
    through torch's composite, which calls the out= form, so that form counts as the functional
    one (an out= call of its own with no NPU kernel is missed: a limit of the emulator)."""
    if overload == "out":
        return name
    return table_name(name, overload[:-4]) if overload.endswith("_out") else ""


def decide(name: str, overload: str, arguments) -> int:
    """ON_DEVICE, OFF_DEVICE or SYNCS_STREAM for a call of a CONDITIONAL op with these arguments
    (in schema order)."""
    key = table_name(name, overload)
    if key in FALLBACKS and FALLBACKS[key](*arguments):
        return OFF_DEVICE
    if key in SYNCS and SYNCS[key](*arguments):
        return SYNCS_STREAM
    return ON_DEVICE


@functools.lru_cache(maxsize=None)
def _verdict_of(func) -> int:
    if func.namespace != "aten":
        return ON_DEVICE
    key = table_name(func._schema.name.split("::")[-1], func._overloadname)
    if key in FALLBACKS or key in SYNCS:
        return verdict(func._schema.name.split("::")[-1], func._overloadname)
    if any(torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), k) for k in _COMPOSITE_KEYS):
        return ON_DEVICE
    return verdict(func._schema.name.split("::")[-1], func._overloadname)


def call_verdict(func, args, kwargs) -> int:
    """ON_DEVICE, OFF_DEVICE or SYNCS_STREAM for this call of `func` (an OpOverload seen above the
    dispatcher, as in a capture)."""
    decided = _verdict_of(func)
    if decided != CONDITIONAL:
        return decided
    arguments = [kwargs[a.name] if a.name in kwargs else args[i] if i < len(args) else a.default_value
                 for i, a in enumerate(func._schema.arguments)]
    return decide(func._schema.name.split("::")[-1], func._overloadname, arguments)


@functools.lru_cache(maxsize=None)
def capturable(func) -> bool:
    """Whether an NPU graph can capture `func`'s NPU kernel (an aten op's entry in npu_aten_ops, its
    own or, for an out= overload, its functional form's, as `verdict` reads them). An op the table
    does not list is not judged here: a composite runs as ops each judged where they reach the
    device, an op without a kernel is off the device (`call_verdict`)."""
    if func.namespace != "aten":
        return True
    name = func._schema.name.split("::")[-1]
    for key in (table_name(name, func._overloadname), _functional_form(name, func._overloadname)):
        if key in OPS:
            return key in CAPTURABLE
    return True


def off_device(func, args, kwargs) -> bool:
    """Whether torch_npu runs this call of `func` on the host."""
    return call_verdict(func, args, kwargs) == OFF_DEVICE


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
