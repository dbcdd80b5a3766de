"""An `hccl` process-group backend for the emulated device: collectives of npu tensors (and of
CPU tensors) run through a gloo process group on their host views: the same bytes, no copy.
Functional collectives (`_c10d_functional.*`, what the DCP graphs call) reach it through the
process group's methods; so do collectives replayed from an NPU graph.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceOptions, AllToAllOptions, BarrierOptions,
                                        BroadcastOptions, ProcessGroupGloo, ReduceScatterOptions,
                                        _create_work_from_future)
from torch.futures import Future

from dcp_compile.testing.npu_emulator import graphs

NAME = "hccl"
_alltoallv_calls = 0
"""all_to_all_single calls with explicit split lists since the last reset (npu_emulator.alltoallv_calls())."""


def alltoallv_calls() -> int:
    return _alltoallv_calls


def reset_alltoallv_calls() -> None:
    global _alltoallv_calls
    _alltoallv_calls = 0


def _host(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type == "npu":
        return torch.ops.dcp_npu_emulator.host_view(tensor)
    return tensor


def _hosts(tensors):
    return [_host(t) for t in tensors]


def _done(result) -> object:
    future = Future()
    future.set_result(result)
    return _create_work_from_future(future)


class EmulatedHCCL(dist.ProcessGroup):
    """The process group itself (torch takes a Python ProcessGroup a backend creator returns as
    the group): every collective waits on gloo's, on host views."""

    def __init__(self, store, rank: int, size: int, timeout):
        super().__init__(rank, size)
        self._gloo = ProcessGroupGloo(store, rank, size, timeout)
        self._rank, self._size = rank, size

    def _run(self, start, result):
        """Run the gloo collective `start()` starts and wait for it; inside an NPU graph capture,
        record it instead, as the capture of an HCCL call records its task on the stream: a
        collective called through the process group (dist.all_to_all_single, not a functional
        collective, which the capture records as an op) then runs at every replay."""
        graph = graphs.capturing_graph()
        if graph is not None:
            graph.record_collective(lambda: start().wait())
        else:
            start().wait()
        return _done(result)

    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:
        return NAME

    @property
    def group_name(self) -> str:
        return dist.distributed_c10d._world.pg_names[self]

    def allreduce(self, tensors, opts=AllreduceOptions()):
        return self._run(lambda: self._gloo.allreduce(_hosts(tensors), opts), tensors)

    def allreduce_coalesced(self, tensors, opts=AllreduceOptions()):
        return self.allreduce(tensors, opts)

    def allgather(self, output_tensors, input_tensors, opts=AllgatherOptions()):
        outputs = [_hosts(group) for group in output_tensors]
        return self._run(lambda: self._gloo.allgather(outputs, _hosts(input_tensors), opts), output_tensors)

    def _allgather_base(self, output, input, opts=AllgatherOptions()):
        return self._run(lambda: self._gloo._allgather_base(_host(output), _host(input), opts), output)

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=AllgatherOptions()):
        for output, input in zip(outputs, inputs):
            self._gloo._allgather_base(_host(output), _host(input), opts).wait()
        return _done(outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def alltoall_base(self, output, input, output_splits, input_splits, opts=AllToAllOptions()):
        # torch_npu ProcessGroupHCCL::alltoall_base (Ascend/pytorch ProcessGroupHCCL.cpp:7014 @
        # 9e73e708): both split lists empty take hcclAlltoAll (equal blocks, :7067); otherwise
        # hcclAlltoAllV (:7183) with per-rank counts and displacements built on the host.
        if output_splits or input_splits:
            global _alltoallv_calls
            _alltoallv_calls += 1
        return self._run(lambda: self._gloo.alltoall_base(_host(output), _host(input), output_splits, input_splits, opts),
                         output)

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=AllToAllOptions()):
        return self.alltoall_base(output, input, output_splits, input_splits, opts)

    def alltoall(self, output_tensors, input_tensors, opts=AllToAllOptions()):
        return self._run(lambda: self._gloo.alltoall(_hosts(output_tensors), _hosts(input_tensors), opts), output_tensors)

    def broadcast(self, tensors, opts=BroadcastOptions()):
        return self._run(lambda: self._gloo.broadcast(_hosts(tensors), opts), tensors)

    def barrier(self, opts=BarrierOptions()):
        return self._run(lambda: self._gloo.barrier(opts), [])

    def reduce_scatter(self, output_tensors, input_tensors, opts=ReduceScatterOptions()):
        inputs = [_hosts(group) for group in input_tensors]
        return self._run(lambda: self._gloo.reduce_scatter(_hosts(output_tensors), inputs, opts), output_tensors)

    def _reduce_scatter_base(self, output, input, opts=ReduceScatterOptions()):
        return self._run(lambda: self._gloo._reduce_scatter_base(_host(output), _host(input), opts), output)

    reduce_scatter_single = _reduce_scatter_base


def _create(store, rank: int, size: int, timeout) -> EmulatedHCCL:
    return EmulatedHCCL(store, rank, size, timeout)


def register() -> None:
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, _create, devices=["npu", "cpu"])
