"""NPU graphs of the emulated device, with the semantics a graph runner must respect on hardware.

- **Capture records the device work and runs none of it.** Every op that touches an npu tensor
  (or makes one) is recorded with its arguments; its outputs are fresh npu tensors of the shapes
  the op's meta kernel gives. Views run at once (they are metadata). Host-only ops run at once:
  they are not device work.
- **Replay runs exactly the recorded ops, on the same tensors, with the host values of the
  capture** (lengths, shapes, scalars): a host value changed since is not seen, unless the graph
  is told with `update`.
- **Host traffic in a capture is an error**, as it would serialise or fail there: a copy from
  pageable host memory to the device, and any device-to-host read (`.item()`, `.tolist()`,
  `.cpu()`, `nonzero`, printing), and an aten op that torch_npu runs on the host (op_coverage.py:
  no NPU kernel, or its kernel's CPU fallback). A copy from pinned host memory is recorded:
  replay reads the host buffer as it is then.
- **`update(cpu_update_input=[{...}, ...])`** rewrites the host lengths of the recorded FIA
  calls, one dict per call in capture order, by argument name (`actual_seq_lengths`,
  `actual_seq_lengths_kv` for FIA v1, `actual_seq_qlen`, `actual_seq_kvlen` for v2), as torch_npu
  does; another name is an error. Updating a graph whose
  last replay the host has not waited for is an error too: on hardware it races that replay.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from dcp_compile.testing.npu_emulator import op_coverage

aten = torch.ops.aten
UPDATABLE = {"npu_fused_infer_attention_score": ("actual_seq_lengths", "actual_seq_lengths_kv"),
             "npu_fused_infer_attention_score_v2": ("actual_seq_qlen", "actual_seq_kvlen")}
"""Ops whose host lengths NPUGraph.update rewrites, and the argument names it takes (FIA v1, v2:
torch_npu's npugraph handlers, docs/ascend.md §9.3)."""
KERNEL_NAMESPACES = {"aten", "prims", "npu", "dcp_triton", "_c10d_functional", "c10d", "dcp_npu_emulator"}
"""Ops recorded as one unit of device work (a kernel, a collective); other ops' npu kernels are
Python over these, and run at capture."""
_NPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)
DEVICE_TO_HOST = {aten._local_scalar_dense.default, aten.nonzero.default, aten.nonzero_static.default}

_capturing = threading.local()
_pool_handles = itertools.count(1)


def is_current_stream_capturing() -> bool:
    return getattr(_capturing, "graph", None) is not None


def graph_pool_handle() -> int:
    return next(_pool_handles)


class CaptureError(RuntimeError):
    """An op that a device-graph capture cannot record (host traffic)."""


class _InFlight:
    """Replays the host has not waited for: (graph, stream)."""

    def __init__(self):
        self._replays: list[tuple["NPUGraph", object]] = []

    def add(self, graph: "NPUGraph", stream) -> None:
        self._replays.append((graph, stream))

    def pending(self, stream) -> list:
        return [entry for entry in self._replays if entry[1] == stream]

    def complete(self, stream) -> None:
        self._replays = [entry for entry in self._replays if stream is not None and entry[1] != stream]

    def complete_these(self, entries: list) -> None:
        self._replays = [entry for entry in self._replays if entry not in entries]

    def running(self, graph: "NPUGraph") -> bool:
        return any(entry[0] is graph for entry in self._replays)


in_flight = _InFlight()


def _on_device(value) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "npu"


def _is_view(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _names_npu_device(value) -> bool:
    return isinstance(value, torch.device) and value.type == "npu" or isinstance(value, str) and value.startswith("npu")


def _check_host_traffic(func, args, kwargs) -> None:
    if func in DEVICE_TO_HOST:
        raise CaptureError(f"{func} reads the device on the host, which an NPU graph capture cannot record")
    if func is aten._to_copy.default:
        source, target = args[0], kwargs.get("device")
        if _on_device(source) and target is not None and not _names_npu_device(target):
            raise CaptureError("a device-to-host copy (.cpu(), .to('cpu')) inside an NPU graph capture")
        if not _on_device(source) and _names_npu_device(target) and not source.is_pinned():
            raise CaptureError("a host-to-device copy from pageable memory inside an NPU graph capture (pin it)")
    if func in (aten.copy_.default, aten._copy_from.default):
        target, source = (args[0], args[1]) if func is aten.copy_.default else (args[1], args[0])
        if _on_device(source) and not _on_device(target):
            raise CaptureError("a device-to-host copy inside an NPU graph capture")
        if _on_device(target) and not _on_device(source) and isinstance(source, torch.Tensor) and not source.is_pinned():
            raise CaptureError("a host-to-device copy from pageable memory inside an NPU graph capture (pin it)")
    if op_coverage.off_device(func, args, kwargs):
        raise CaptureError(f"{func} runs on the host under torch_npu (no NPU kernel, or its kernel's CPU fallback for "
                           f"these arguments: npu_emulator/op_coverage.py), which an NPU graph capture cannot record; "
                           f"issued at {op_coverage.issuing_source()}")


def _meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if _names_npu_device(value):
        return torch.device("meta")
    return value


def _placeholders(func, args, kwargs):
    """The outputs a capture hands back: the mutated arguments themselves, fresh npu tensors of
    the meta kernel's shapes for the rest."""
    flat_args, spec = pytree.tree_flatten((args, kwargs))
    metas = [_meta(a) for a in flat_args]
    originals = {id(m): a for m, a in zip(metas, flat_args) if isinstance(a, torch.Tensor)}
    meta_args, meta_kwargs = pytree.tree_unflatten(metas, spec)
    result = func(*meta_args, **meta_kwargs)

    def materialise(meta):
        if not isinstance(meta, torch.Tensor):
            return meta
        if id(meta) in originals:
            return originals[id(meta)]
        return torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype, device="npu")

    return pytree.tree_map(materialise, result)


@dataclass
class _Recorded:
    func: object
    args: tuple
    kwargs: dict
    outputs: object


class _Recorder(TorchDispatchMode):
    """Records the device work a capture issues. Under torch.compile it sees the compiled
    artifact's ops, not the tracing (`ignore_compile_internals`), as a capture on hardware sees
    the kernels the compiled graph launches."""

    def __init__(self, graph: "NPUGraph"):
        super().__init__()
        self.graph = graph

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = pytree.tree_leaves((args, kwargs))
        device_work = any(_on_device(a) or _names_npu_device(a) for a in flat)
        if not device_work:
            return func(*args, **kwargs)
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            # Reached here only where autograd is off (inside a custom op's kernel): a
            # composite such as `to` runs as the ops it is made of, each seen here.
            with self:
                return func.decompose(*args, **kwargs)
        if _is_view(func):
            return func(*args, **kwargs)
        if func.namespace not in KERNEL_NAMESPACES:
            # A custom op whose npu kernel is Python over other ops: its Python runs now, at
            # capture, as it would on hardware (its host decisions freeze), and the ops it issues
            # are recorded.
            with self:
                return func.redispatch(_NPU_KEYS, *args, **kwargs)
        _check_host_traffic(func, args, kwargs)
        outputs = _placeholders(func, args, kwargs)
        self.graph._records.append(_Recorded(func, args, dict(kwargs), outputs))
        return outputs


class NPUGraph:
    def __init__(self):
        self._records: list[_Recorded] = []
        self._captured = False

    def capture_begin(self, pool=None, capture_error_mode: str = "global") -> None:
        if is_current_stream_capturing():
            raise RuntimeError("an NPU graph capture is already running on this thread")
        self._records = []
        self._mode = _Recorder(self)
        self._mode.__enter__()
        _capturing.graph = self

    def capture_end(self) -> None:
        _capturing.graph = None
        self._mode.__exit__(None, None, None)
        self._captured = True

    def replay(self) -> None:
        if not self._captured:
            raise RuntimeError("NPUGraph.replay() before a capture")
        for record in self._records:
            result = record.func(*record.args, **record.kwargs)
            for placeholder, value in zip(pytree.tree_leaves(record.outputs), pytree.tree_leaves(result)):
                if isinstance(placeholder, torch.Tensor) and placeholder is not value:
                    placeholder.copy_(value)
        in_flight.add(self, torch.npu.current_stream())

    def update(self, cpu_update_input: list[dict]) -> None:
        if in_flight.running(self):
            raise RuntimeError("NPUGraph.update while the graph's last replay may still run: wait for it first "
                               "(an event recorded after the replay, or a stream synchronize); on hardware the "
                               "update races the replay")
        calls = [r for r in self._records if getattr(r.func, "_opname", "") in UPDATABLE
                 and r.func.namespace == "npu"]
        if len(cpu_update_input) > len(calls):
            raise ValueError(f"cpu_update_input has {len(cpu_update_input)} entries, the graph recorded {len(calls)} "
                             "updatable calls")
        for record, update in zip(calls, cpu_update_input):
            allowed = UPDATABLE[record.func._opname]
            for name, value in update.items():
                if name not in allowed:
                    raise ValueError(f"NPUGraph.update: {record.func._opname} takes no update of {name!r} "
                                     f"(it updates {list(allowed)})")
                record.kwargs[name] = list(value)

    @property
    def recorded_ops(self) -> list[str]:
        return [str(r.func) for r in self._records]


@contextlib.contextmanager
def graph(npu_graph: NPUGraph, pool=None, stream=None, auto_dispatch_capture: bool = False,
          capture_error_mode: str = "global"):
    with torch.npu.stream(stream):
        npu_graph.capture_begin(pool)
        try:
            yield npu_graph
        finally:
            npu_graph.capture_end()
