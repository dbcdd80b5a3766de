"""`torch.npu` of the emulated device: the part of torch_npu's module the project and torch use.

Work runs when it is issued, so streams are orderings without concurrency, with one exception
that matters to graph runners: a graph replay stays in flight (graphs.py) until the host waits
for it (`synchronize()`, a stream's `synchronize()`, or an event recorded after it), so that
updating a graph's host values under an unfinished replay is caught, as it would race on
hardware; a stream that waits on such an event (`wait_event`, `Event.wait`, `wait_stream`)
remembers the replays it is ordered after. The host waits (`synchronize()`,
`Stream.synchronize()`, `Event.synchronize()`) count as host syncs (npu_emulator.host_syncs()).

The SoC and CANN version: `$DCP_COMPILE_NPU_EMULATOR_SOC` (default Ascend910B3, an Atlas A2) and
`$DCP_COMPILE_NPU_EMULATOR_CANN` (default 9.0.0), read at each call.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref

import torch

from dcp_compile.testing.npu_emulator.graphs import NPUGraph, graph, graph_pool_handle, in_flight, is_current_stream_capturing

__all__ = ["Event", "NPUGraph", "Stream", "current_device", "current_stream", "default_stream", "device_count", "graph",
           "get_device_name", "get_soc_version", "graph_pool_handle", "is_available", "is_current_stream_capturing",
           "set_device", "stream", "synchronize", "utils"]

SOC_ENV, CANN_ENV = "DCP_COMPILE_NPU_EMULATOR_SOC", "DCP_COMPILE_NPU_EMULATOR_CANN"
DEFAULT_SOC, DEFAULT_CANN = "Ascend910B3", "9.0.0"
_SOC_NUMBERS = {name: number for first, names in (
    (100, ["Ascend910PremiumA", "Ascend910ProA", "Ascend910A", "Ascend910ProB", "Ascend910B"]),
    (200, ["Ascend310P1", "Ascend310P2", "Ascend310P3", "Ascend310P4", "Ascend310P5", "Ascend310P7"]),
    (220, ["Ascend910B1", "Ascend910B2", "Ascend910B2C", "Ascend910B3", "Ascend910B4", "Ascend910B4-1"]),
    (240, ["Ascend310B1", "Ascend310B2", "Ascend310B3", "Ascend310B4"]),
    (250, ["Ascend910_9391", "Ascend910_9392", "Ascend910_9381", "Ascend910_9382", "Ascend910_9372",
           "Ascend910_9362", "Ascend910_9363"]),
) for number, name in enumerate(names, first)}
"""torch_npu's SocVersion enum (Ascend/pytorch torch_npu/csrc/core/npu/NpuVariables.h:5-36 and the
name table of NpuVariables.cpp:13-41 @ 9e73e708); a name starting "Ascend950" is 260."""


def get_device_name(device_name=None) -> str:
    """The SoC name, as torch_npu answers it for every device (torch_npu/npu/__init__.py:528-532)."""
    index = _index(device_name)
    if not 0 <= index < device_count():
        raise AssertionError("Invalid device id")
    return os.environ.get(SOC_ENV, DEFAULT_SOC)


def get_soc_version() -> int:
    """torch_npu's SocVersion number of the SoC (torch_npu/npu/_backends.py:96-99); an unknown
    name is an error, as in NpuVariables.cpp:57-60."""
    name = get_device_name()
    if name.startswith("Ascend950"):
        return 260
    if name not in _SOC_NUMBERS:
        raise RuntimeError(f"Unsupported soc version: {name.replace('_', ' ')}")
    return _SOC_NUMBERS[name]


class utils:  # noqa: N801 - torch_npu.npu.utils, the part the project reads
    @staticmethod
    def get_cann_version(module: str = "CANN") -> str:
        """A module's version (torch_npu/npu/utils.py:37-46): $DCP_COMPILE_NPU_EMULATOR_CANN for CANN's
        modules; "" for the driver ("DRIVER"), as torch_npu answers where it cannot read one: the
        emulated device has no Ascend driver."""
        return "" if module == "DRIVER" else os.environ.get(CANN_ENV, DEFAULT_CANN)

    get_soc_version = staticmethod(get_soc_version)


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def _lazy_init() -> None:
    pass


def _is_in_bad_fork() -> bool:
    return False


DEVICE_COUNT = 8
"""The emulated devices (install() sets it)."""


def device_count() -> int:
    return DEVICE_COUNT


def current_device() -> int:
    return int(torch.ops.dcp_npu_emulator.get_device())


def set_device(device) -> None:
    index = device.index if isinstance(device, torch.device) else int(device)
    torch.ops.dcp_npu_emulator.set_device(index)


class device:  # noqa: N801 - torch.cuda.device's name
    def __init__(self, index):
        self.index = index.index if isinstance(index, torch.device) else index

    def __enter__(self):
        self.previous = current_device()
        if self.index is not None:
            set_device(self.index)

    def __exit__(self, *exc):
        set_device(self.previous)


def _index(device) -> int:
    """A device index from None (the current device), an int, 'npu:1' or torch.device."""
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    return torch.device(device).index or 0


class Stream:
    _ids = iter(range(1, 1 << 62))

    def __init__(self, device=None, priority: int = 0):
        self.device = torch.device("npu", _index(device))
        self.stream_id = next(Stream._ids)
        self.waited = weakref.WeakSet()
        """Replays this stream's later work is ordered after (through an event it waited on)."""

    def wait_stream(self, stream: "Stream") -> None:
        self.waited.update(in_flight.pending(stream))

    def wait_event(self, event: "Event") -> None:
        self.waited.update(event._waits_for)

    def record_event(self, event: "Event | None" = None) -> "Event":
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        torch.ops.dcp_npu_emulator.count_host_sync()  # the host blocks until the stream drains
        in_flight.complete(self)

    def __eq__(self, other):
        return isinstance(other, Stream) and other.stream_id == self.stream_id

    def __hash__(self):
        return hash(self.stream_id)


_local = threading.local()
_defaults: dict[int, Stream] = {}


def default_stream(device=None) -> Stream:
    index = _index(device)
    if index not in _defaults:
        _defaults[index] = Stream(index)
    return _defaults[index]


def current_stream(device=None) -> Stream:
    index = _index(device)
    return getattr(_local, "streams", {}).get(index) or default_stream(index)


def set_stream(stream_: Stream) -> None:
    if not hasattr(_local, "streams"):
        _local.streams = {}
    _local.streams[stream_.device.index] = stream_


@contextlib.contextmanager
def stream(stream_: Stream | None):
    if stream_ is None:
        yield
        return
    previous = current_stream(stream_.device)
    set_stream(stream_)
    try:
        yield
    finally:
        set_stream(previous)


def synchronize(device=None) -> None:
    torch.ops.dcp_npu_emulator.count_host_sync()  # the host blocks until the device drains
    in_flight.complete(None)


class Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.time: float | None = None
        self._waits_for: list = []

    def record(self, stream_: Stream | None = None) -> None:
        self.time = time.perf_counter()
        self._waits_for = in_flight.pending(stream_ or current_stream())

    def query(self) -> bool:
        in_flight.complete_these(self._waits_for)
        return True

    def synchronize(self) -> None:
        torch.ops.dcp_npu_emulator.count_host_sync()  # the host blocks until the event completes
        in_flight.complete_these(self._waits_for)

    def wait(self, stream_: Stream | None = None) -> None:
        (stream_ or current_stream()).wait_event(self)

    def elapsed_time(self, end: "Event") -> float:
        return (end.time - self.time) * 1e3


def manual_seed(seed: int) -> None:
    """Random ops on the emulated device draw from the host generator, which torch.manual_seed seeds."""


def manual_seed_all(seed: int) -> None:
    """As manual_seed."""


def get_rng_state(device="npu") -> torch.Tensor:
    return torch.zeros(1, dtype=torch.uint8)


def set_rng_state(state, device="npu") -> None:
    pass
