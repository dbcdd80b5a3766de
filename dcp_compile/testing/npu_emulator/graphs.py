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
- **Data-dependent output shapes are host traffic too**: an op whose NPU kernel synchronises the
  stream to learn its output's size (nonzero, masked_select, indexing by a bool mask, unique,
  repeat_interleave without output_size: op_coverage.SYNCS).
- **Only aclnn kernels enter a graph**: an aten op torch_npu runs on the device through an acl_op
  kernel only (op-plugin registers no `op_api` kernel for it on one of the supported torch_npu
  versions: npu_aten_ops.ACL_OP_ONLY) is refused in a capture, as on hardware ("仅支持aclnn算子入图",
  Ascend/pytorch docs/zh/developer_notes/npugraph.md:40); eager runs it on the device.
- **A recorded FIA call must be captured with every KV length >= 1** (`actual_seq_lengths_kv`,
  v2 `actual_seq_kvlen`): FIA's tiling key depends on the length split, and vllm-ascend captures
  with lengths of 1 (its dummy run); a 0 at capture is a CaptureError.
- **Capture and update follow the selected torch_npu release** (`$DCP_COMPILE_NPU_EMULATOR_TORCH_NPU`,
  releases/: its `npu/graphs.py` and `npu/_npugraph_handlers/`, docs/ascend.md §21). Under
  `graph(..., auto_dispatch_capture=True)` each call of an op with an NPU-graph handler (FIA v1,
  v2) is a dispatch record, captured as the handler captures it: `.default` as `.out` with the
  workspace of `_get_max_workspace` and the outputs of `_infer_output`. Without
  `auto_dispatch_capture` nothing is recorded for update, and `update` raises, as torch_npu's does.
- **`update(cpu_update_input=[{...}, ...])`** pairs the dicts with the dispatch records in capture
  order: one dict is copied to every record; otherwise the release's count rule applies (exactly
  one dict per record, RuntimeError else; on a release whose check compared the records with
  themselves, the records past the list are left un-updated). A key replaces the record's
  captured keyword argument of that name, or fills the positional slot of the handler's update
  spec: what torch_npu does. A key that torch_npu would ignore (no such captured argument, no
  spec slot) is a ValueError here: on hardware the call keeps its captured value and nothing
  says so. Like torch_npu, update runs on the update stream shared by all graphs,
  `graph.graph_dispatch_mode.update_stream` (torch_npu/npu/graphs.py:430-435, 554).
- **Every replay of a graph with FIA calls needs an update since its last replay (or capture)**:
  on hardware each recorded FIA task waits on an ExternalEvent that only update records
  (torch_npu/npu/graphs.py:466-469, 587), so the replay would hang; here it raises.
- **An update must not race the graph's last replay**: it is an error unless the host waited for
  that replay (a stream/device synchronize, or an event recorded after it and synchronized or
  queried) or the update stream waited on such an event (`wait_event`, `Event.wait`,
  `wait_stream`), the torchair way (Ascend/torchair acl_graph.py:556-575 @ fced8842).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from dcp_compile.testing.npu_emulator import npu_aten_ops, op_coverage, releases

aten = torch.ops.aten
KERNEL_NAMESPACES = {"aten", "prims", "npu", "dcp_triton", "_c10d_functional", "c10d", "dcp_npu_emulator"}
"""Ops recorded as one unit of device work (a kernel, a collective); other ops' npu kernels are
Python over these, and run at capture."""
_NPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)
KV_LENGTHS = {"npu_fused_infer_attention_score": "actual_seq_lengths_kv", "npu_fused_infer_attention_score_v2": "actual_seq_kvlen"}
"""FIA v1's and v2's KV lengths (a capture with a length of 0 is refused, every overload)."""
DEVICE_TO_HOST = {aten._local_scalar_dense.default}

_capturing = threading.local()
_pool_handles = itertools.count(1)


def is_current_stream_capturing() -> bool:
    return getattr(_capturing, "graph", None) is not None


def graph_pool_handle() -> int:
    return next(_pool_handles)


class CaptureError(RuntimeError):
    """An op that a device-graph capture cannot record (host traffic)."""


class _Replay:
    """One replay the host has not waited for (compared by identity)."""

    def __init__(self, graph: "NPUGraph", stream):
        self.graph, self.stream = graph, stream


class _InFlight:
    """Replays the host has not waited for."""

    def __init__(self):
        self._replays: list[_Replay] = []

    def add(self, graph: "NPUGraph", stream) -> None:
        self._replays.append(_Replay(graph, stream))

    def pending(self, stream) -> list:
        return [entry for entry in self._replays if entry.stream == stream]

    def complete(self, stream) -> None:
        self._replays = [entry for entry in self._replays if stream is not None and entry.stream != stream]

    def complete_these(self, entries: list) -> None:
        self._replays = [entry for entry in self._replays if all(entry is not e for e in entries)]

    def running(self, graph: "NPUGraph") -> list:
        return [entry for entry in self._replays if entry.graph is graph]


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
    where = op_coverage.call_verdict(func, args, kwargs)
    if where == op_coverage.SYNCS_STREAM:
        raise CaptureError(f"{func} synchronises the stream under torch_npu to learn its output's size (a "
                           f"data-dependent shape: npu_emulator/op_coverage.py SYNCS), which an NPU graph capture "
                           f"cannot record; issued at {op_coverage.issuing_source()}")
    if where == op_coverage.OFF_DEVICE:
        raise CaptureError(f"{func} runs on the host under torch_npu (no NPU kernel, or its kernel's CPU fallback for "
                           f"these arguments: npu_emulator/op_coverage.py), which an NPU graph capture cannot record; "
                           f"issued at {op_coverage.issuing_source()}")


def _check_aclnn(func) -> None:
    """Only aclnn (op_api) kernels enter an NPU graph; checked before a composite runs as its parts,
    as torch_npu's own kernel replaces the composite (lstm_cell)."""
    if not op_coverage.capturable(func):
        raise CaptureError(f"{func} runs on the device under torch_npu through an acl_op kernel only (op-plugin "
                           f"registers no op_api kernel for it on one of torch_npu "
                           f"{', '.join(npu_aten_ops.VERSIONS)}: npu_emulator/npu_aten_ops.py ACL_OP_ONLY), and an NPU "
                           f"graph captures aclnn kernels only: {npu_aten_ops.CAPTURE_RULE}. Eager runs it; issued at "
                           f"{op_coverage.issuing_source()}")


def _is_fia(func) -> bool:
    return getattr(func, "namespace", "") == "npu" and getattr(func, "_opname", "") in KV_LENGTHS


def capturing_graph() -> "NPUGraph | None":
    """The NPU graph this thread is capturing, if any."""
    return getattr(_capturing, "graph", None)


class _ProcessGroupCollective:
    """A collective called through the emulated hccl process group during a capture (recorded
    as the HCCL task a capture records on hardware)."""

    def __init__(self, run):
        self.run = run

    def __call__(self):
        self.run()

    def __str__(self) -> str:
        return "hccl.collective"


def _check_fia_capture_lengths(func, args, kwargs) -> None:
    """A recorded FIA call captured with a KV length of 0 is refused: FIA's tiling key depends on
    how the lengths split, so a graph captured on empty rows is not the graph later steps need.
    vllm-ascend captures its dummy run with lengths >= 1 (docs/ascend.md §17)."""
    if not _is_fia(func):
        return
    name = KV_LENGTHS[func._opname]
    position = [a.name for a in func._schema.arguments].index(name)
    lengths = kwargs.get(name, args[position] if position < len(args) else None)
    if lengths is not None and any(int(length) == 0 for length in lengths):
        raise CaptureError(f"{func} captured with {name}={list(lengths)}: capture FIA with every KV length >= 1 "
                           f"(a length of 0 at capture is refused, as vllm-ascend captures with lengths of 1; "
                           f"update() may set 0 later); issued at {op_coverage.issuing_source()}")


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


def _wait_functional_collective(func, result) -> None:
    """A functional collective run again at a replay registers its work under the new output,
    which the recorded wait_tensor (of the captured output) never finds: wait on it here, or the
    process's work registry keeps every replay's work and its tensors (on hardware a replay
    launches the recorded HCCL task; nothing is registered)."""
    if getattr(func, "namespace", None) == "_c10d_functional" and func is not torch.ops._c10d_functional.wait_tensor.default:
        for value in pytree.tree_leaves(result):
            if isinstance(value, torch.Tensor):
                torch.ops._c10d_functional.wait_tensor(value)


@dataclass
class _Recorded:
    func: object
    args: list
    kwargs: dict
    outputs: object
    dispatch: bool = False
    """A dispatch record of torch_npu's NPU-graph mode (auto_dispatch_capture): what update pairs
    its dicts with, and what a replay needs an update of."""


def _prepare_capture(func, args, kwargs, handler: dict):
    """What the release's handler does before recording a call (its prepare_capture): a
    `.default` FIA call becomes `.out` with the workspace of `_get_max_workspace` and the outputs of
    `_infer_output` (run now, as on hardware: they allocate, they launch nothing)."""
    if handler["capture_as"] is None or handler["capture_as"] == releases.overload_name(func):
        return func, args, kwargs
    npu = torch.ops.npu
    workspace = getattr(npu, handler["workspace"])(*args, **kwargs)
    out_args = [args[index] for index in handler["infer_output_args"]]
    out_kwargs = {key: kwargs[key] for key in handler["infer_output_kwargs"] if key in kwargs}
    outputs = list(getattr(npu, handler["infer_output"])(*out_args, **out_kwargs))
    op, overload = handler["capture_as"].split(".")
    return getattr(getattr(npu, op), overload), args, {**kwargs, "workspace": workspace, "out": outputs}


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
        _check_aclnn(func)
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
        _check_fia_capture_lengths(func, args, kwargs)
        handler = releases.active().handler(func.__name__) if self.graph.auto_dispatch_capture else None
        if handler is not None:
            func, args, kwargs = _prepare_capture(func, args, kwargs, handler)
            if "out" in kwargs:  # the handler's postprocess_result: the caller gets kwargs["out"]
                self.graph._records.append(_Recorded(func, list(args), dict(kwargs), kwargs["out"], dispatch=True))
                return kwargs["out"]
        outputs = _placeholders(func, args, kwargs)
        self.graph._records.append(_Recorded(func, list(args), dict(kwargs), outputs, dispatch=handler is not None))
        return outputs


class _GraphDispatchMode:
    """torch_npu's per-graph recorder of updatable calls (`NPUGraph.graph_dispatch_mode`): here
    only its update stream, one for all graphs, created with the first graph, as in
    torch_npu/npu/graphs.py:430-435."""

    update_stream = None

    def __init__(self):
        if _GraphDispatchMode.update_stream is None:
            _GraphDispatchMode.update_stream = torch.npu.Stream()


class NPUGraph:
    def __init__(self):
        self._records: list[_Recorded] = []
        self._captured = False
        self._stale: list[_Recorded] = []
        """Dispatch records not updated since the last replay (or capture)."""
        self.graph_dispatch_mode = _GraphDispatchMode()
        self.auto_dispatch_capture = False

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
        self._stale = self._updatable_calls()

    def _updatable_calls(self) -> list[_Recorded]:
        return [r for r in self._records if r.dispatch]

    def replay(self) -> None:
        if not self._captured:
            raise RuntimeError("NPUGraph.replay() before a capture")
        if self._stale:
            raise RuntimeError(f"NPUGraph.replay() of a graph whose {len(self._stale)} recorded FIA call(s) were not "
                               "updated since its last replay (or capture): on hardware each waits on an event that "
                               "only NPUGraph.update records, and the replay would hang. Call "
                               "update(cpu_update_input=...) before every replay")
        previous = torch.ops.dcp_npu_emulator.set_replaying(True)
        try:
            for record in self._records:
                result = record.func(*record.args, **record.kwargs)
                _wait_functional_collective(record.func, result)
                for placeholder, value in zip(pytree.tree_leaves(record.outputs), pytree.tree_leaves(result)):
                    if isinstance(placeholder, torch.Tensor) and placeholder is not value:
                        placeholder.copy_(value)
        finally:
            torch.ops.dcp_npu_emulator.set_replaying(previous)
        in_flight.add(self, torch.npu.current_stream())
        self._stale = self._updatable_calls()

    def update(self, cpu_update_input: list[dict]) -> None:
        """torch_npu's NPUGraph.update and update_capture_record, by the active release's rules."""
        release = releases.active()
        rule = release.update_rule
        if rule["requires_auto_dispatch_capture"] and not self.auto_dispatch_capture:
            raise RuntimeError(f"The current graph configuration does not support update,Try to capture by setting "
                               f"auto_dispatch_capture=True during capture ({release} NPUGraph.update)")
        calls = self._updatable_calls()
        updates = [dict(update) for update in cpu_update_input]
        broadcast = rule["broadcast_one_dict"] and len(updates) == 1
        if broadcast:
            updates = [dict(updates[0]) for _ in calls]
        if len(updates) != len(calls) and rule["count_check"] == "exact":
            raise RuntimeError(f"cpu_update_input has {len(updates)} entries, the graph recorded {len(calls)} "
                               f"updatable calls: give one dict per call (or one for all). {release}: 'Currently, "
                               f"there are {len(calls)} operators that need to be updated by capture, and there are "
                               f"only {len(updates)} elements in the incoming cpu_update_input list'")
        update_stream = self.graph_dispatch_mode.update_stream
        unordered = [r for r in in_flight.running(self) if r not in update_stream.waited]
        if unordered:
            raise RuntimeError("NPUGraph.update while the graph's last replay may still run: wait for it first, on "
                               "the host (an event recorded after the replay and synchronized, or a stream "
                               "synchronize) or on the device (graph.graph_dispatch_mode.update_stream.wait_event of "
                               "such an event); on hardware the update races the replay")
        pairs = list(zip(calls, updates))
        _refuse_ignored_keys(release, pairs, broadcast)
        for record, update in pairs:
            for key, value in update.items():
                _apply(release, record, key, list(value) if isinstance(value, (list, tuple)) else value)
        # A release whose count check compared the records with themselves leaves the records past
        # the list un-updated: their replay would wait forever (docs/ascend.md §9.3).
        self._stale = calls[len(pairs):]

    def record_collective(self, run) -> None:
        """Record a process-group collective issued during this capture (hccl.py)."""
        self._records.append(_Recorded(_ProcessGroupCollective(run), (), {}, None))

    @property
    def recorded_ops(self) -> list[str]:
        return [str(r.func) for r in self._records]


def _slots(release, record: _Recorded, key: str) -> list[tuple[str, object]]:
    """Where torch_npu's update puts `key` in a record: the captured keyword argument of that name
    (update_capture_record), and the handler's spec slots of that key (update_args: a positional
    slot only where the call passed that many arguments)."""
    rule = release.update_rule
    slots = [("kwarg", key)] if rule["replaces_captured_kwargs"] and key in record.kwargs else []
    handler = release.handler(record.func.__name__) or {"update_specs": []}
    for where, slot, spec_key in handler["update_specs"]:
        if spec_key == key and (where == "kwarg" or len(record.args) > slot):
            slots.append((where, slot))
    return slots


def _apply(release, record: _Recorded, key: str, value) -> None:
    for where, slot in _slots(release, record, key):
        if where == "kwarg":
            record.kwargs[slot] = value
        else:
            record.args[slot] = value


def _refuse_ignored_keys(release, pairs, broadcast: bool) -> None:
    """A key torch_npu would ignore (the call keeps its captured value, silently) is an error here:
    with one dict per record, a key its record does not take; with one dict for all, a key no record
    takes."""
    ignored = {}
    for record, update in pairs:
        for key in update:
            ignored.setdefault(key, []).append(record if not _slots(release, record, key) else None)
    for key, records in ignored.items():
        refused = [r for r in records if r is not None]
        if refused and (not broadcast or len(refused) == len(records)):
            name = refused[0].func.__name__
            raise ValueError(f"NPUGraph.update: {name} takes no update of {key!r}: {release} would ignore it (the "
                             f"call keeps its captured value). It updates {release.update_keys(name)} where they "
                             "were captured, and replaces any other argument captured as a keyword")


@contextlib.contextmanager
def graph(npu_graph: NPUGraph, pool=None, stream=None, auto_dispatch_capture: bool = False,
          capture_error_mode: str = "global"):
    npu_graph.auto_dispatch_capture = auto_dispatch_capture
    with torch.npu.stream(stream):
        npu_graph.capture_begin(pool)
        try:
            yield npu_graph
        finally:
            npu_graph.capture_end()
