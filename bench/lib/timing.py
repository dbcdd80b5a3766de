"""How the benches time work, and the two rates they measure it against.

On a GPU a measurement is a median over replays of a CUDA graph that holds `repeats` launches,
divided by `repeats`, so Python's launch overhead is not counted. The copy rate (device-to-device
bytes read + written per second) and the bf16 matmul rate are measured in the same run as the
figures set against them.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist


def require_cuda(script: str) -> None:
    """Exit with a message that says what is missing, before a CUDA-only `script` touches the device."""
    if not torch.cuda.is_available():
        sys.exit(f"{script} needs a CUDA GPU, and torch.cuda.is_available() is False here "
                 f"(torch {torch.__version__}, CUDA build {torch.version.cuda})")
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit(f"{script} times compiled kernels: unset TRITON_INTERPRET")
    if importlib.util.find_spec("triton") is None:
        sys.exit(f"{script} needs triton: pip install -e '.[triton]'")


def time_graph(launch, repeats: int, replays: int) -> float:
    """Median seconds per launch: `launch(i)` for i < repeats is captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(min(repeats, 2)):  # compile and allocate outside the capture
            launch(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(repeats):
            launch(i)
    graph.replay()
    torch.cuda.synchronize()
    seconds = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3 / repeats)
    del graph
    return statistics.median(seconds)


def median_call_seconds(fn, calls: int) -> float:
    """Median of CUDA-event times around single calls, host launch work included."""
    seconds = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    return statistics.median(seconds)


def timed_first_call(fn, device) -> float:
    """Wall seconds of one call (a first call: tracing and compiling included)."""
    started = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def compile_phases(clear: bool = False) -> dict:
    """Seconds per compile phase so far in this process (dynamo's own accounting); with `clear`,
    the account starts anew after it is read."""
    from torch._dynamo.utils import compilation_time_metrics
    phases = {name: sum(values) for name, values in compilation_time_metrics.items()}
    if clear:
        compilation_time_metrics.clear()
    return phases


def slowest(seconds: float, device) -> float:
    """The largest of every rank's `seconds`."""
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


class Timer:
    """Median seconds per call: CUDA-graph replays timed with events, or host time on CPU."""

    def __init__(self, device: torch.device, replays: int, repeats: int = 10):
        self.device, self.replays, self.repeats = device, replays, repeats

    def __call__(self, fn) -> dict:
        """`fn` runs `repeats` times back to back inside one graph, so launch overhead and the
        ranks' skew at the start of a replay are spread over many steps."""
        if self.device.type != "cuda":
            fn()
            seconds = []
            for _ in range(self.replays):
                start = time.perf_counter()
                fn()
                seconds.append(time.perf_counter() - start)
            return {"seconds": statistics.median(seconds), "graph": False}
        dist.barrier()
        try:
            return {"seconds": time_graph(lambda i: fn(), self.repeats, self.replays), "graph": True}
        except Exception as exc:  # a capture that fails is reported, then timed eagerly
            torch.cuda.synchronize()
            return {"seconds": median_call_seconds(fn, self.replays), "graph": False,
                    "capture_error": f"{type(exc).__name__}: {exc}"[:300]}


def copy_bandwidth(gib: float, replays: int) -> dict:
    """Device-to-device copy bandwidth, (bytes read + written) / time: the better of a memcpy and
    an elementwise copy kernel, each replayed from a CUDA graph after ~1 s of warm-up traffic.
    On an H200 the memcpy node of a graph moves ~2.8 TB/s and the kernel ~4.3 TB/s; taking the
    memcpy alone would inflate every fraction measured against it by 1.5x."""
    elements = int(gib * (1 << 30)) // 2
    source = torch.empty(elements, dtype=torch.bfloat16, device="cuda").normal_()
    target = torch.empty_like(source)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        torch.mul(source, 1.0, out=target)
        torch.cuda.synchronize()
    moved = 2 * source.numel() * source.element_size()
    ways = {"memcpy": lambda i: target.copy_(source), "kernel": lambda i: torch.mul(source, 1.0, out=target)}
    seconds = {name: time_graph(fn, 1, max(5, replays // 2)) for name, fn in ways.items()}
    best = min(seconds.values())
    return {"buffer_bytes": moved // 2, "seconds": best, "bytes_per_s": moved / best,
            **{f"{name}_bytes_per_s": moved / t for name, t in seconds.items()}}


def matmul_rate(replays: int) -> float:
    """bf16 FLOP/s of an 8192^3 matmul on random data, replayed from a graph."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    seconds = time_graph(lambda i: torch.matmul(a, b, out=c), 4, replays)
    return 2 * 8192**3 / seconds
