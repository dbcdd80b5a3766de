"""The emulated npu device keeps the semantics the NPU tests rely on, as hardware does: tensors
live on the device and copy to and from the host; an op with no npu kernel fails; an NPU graph
capture records device work and runs none of it, and refuses host traffic; replay runs the
recorded work on the current contents of its tensors; update() rewrites FIA's host lengths by
name and refuses other names, and refuses to race the graph's last replay."""

from __future__ import annotations

import pytest
import torch

from dcp_compile.lowering import npu as npu_lowering
from dcp_compile.testing.npu_emulator.graphs import CaptureError

NPU = "npu"


@torch.library.custom_op("dcp_test_emulator::cpu_only", mutates_args=(), device_types="cpu")
def cpu_only(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def test_tensors_live_on_the_device_and_ops_run_there():
    x = torch.arange(6, dtype=torch.float32).to(NPU)
    assert x.device.type == NPU and torch.equal(x.cpu(), torch.arange(6, dtype=torch.float32))
    y = (x * 2 + 1).view(2, 3).sum(0)
    assert y.device.type == NPU and y.cpu().tolist() == [8.0, 12.0, 16.0]


def test_an_op_without_an_npu_kernel_fails_as_on_hardware():
    assert torch.equal(cpu_only(torch.zeros(2)), torch.ones(2))
    with pytest.raises(NotImplementedError, match="npu|PrivateUse1"):
        cpu_only(torch.zeros(2, device=NPU))


def test_a_capture_records_device_work_runs_none_of_it_and_replays_it():
    x = torch.zeros(4, device=NPU)
    out = torch.empty(4, device=NPU)
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        out.copy_(x * 3 + 1)
    assert graph.recorded_ops and not out.cpu().eq(1).all()  # nothing ran at capture ...
    x.copy_(torch.arange(4.0).to(NPU))
    graph.replay()
    torch.npu.synchronize()
    assert out.cpu().tolist() == [1.0, 4.0, 7.0, 10.0]  # ... replay reads x as it is now


@pytest.mark.parametrize("host_traffic", ["item", "cpu", "pageable upload"])
def test_host_traffic_inside_a_capture_is_an_error(host_traffic):
    x = torch.ones(4, device=NPU)
    graph = torch.npu.NPUGraph()
    with pytest.raises(CaptureError):
        with torch.npu.graph(graph):
            if host_traffic == "item":
                x.sum().item()
            elif host_traffic == "cpu":
                x.cpu()
            else:
                x.copy_(torch.ones(4))  # pageable host memory


def _fia_graph(lengths):
    """A captured decode FIA call (the stand-in: tests/npu/test_standin.py's call) writing into `out`,
    and a function that runs the same call eagerly with other lengths."""
    from tests.npu.test_standin import fia_call, make_cache, make_queries

    npu_lowering.ensure_ops()
    cache, (query, query_rope) = make_cache(lengths), make_queries(len(lengths))
    fia = torch.ops.npu.npu_fused_infer_attention_score

    def run(kv_lengths):
        args, keyword_args = fia_call(cache, query, query_rope, "BSND", [1] * len(lengths),
                                      actual_seq_lengths_kv=list(kv_lengths))
        return fia(*args, **keyword_args)[0]

    out = torch.empty_like(run(lengths))
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph, auto_dispatch_capture=True):
        out.copy_(run(lengths))
    return graph, out, run


def test_update_rewrites_fias_host_lengths_by_name_and_refuses_other_names():
    graph, out, run = _fia_graph([20, 3, 40])
    graph.update(cpu_update_input=[{"actual_seq_lengths_kv": [20, 3, 40]}])  # before every replay
    graph.replay()
    torch.npu.synchronize()
    assert torch.equal(out.cpu(), run([20, 3, 40]).cpu())
    graph.update(cpu_update_input=[{"actual_seq_lengths_kv": [33, 1, 17]}])
    graph.replay()
    torch.npu.synchronize()
    assert torch.equal(out.cpu(), run([33, 1, 17]).cpu()) and not torch.equal(out.cpu(), run([20, 3, 40]).cpu())
    with pytest.raises(ValueError, match="takes no update of 'seq_lens'"):
        graph.update(cpu_update_input=[{"seq_lens": [1, 1, 1]}])


def test_an_update_while_the_last_replay_may_still_run_is_an_error():
    graph, _, _ = _fia_graph([5, 7])
    graph.update(cpu_update_input=[{"actual_seq_lengths_kv": [5, 7]}])
    graph.replay()  # not waited for
    with pytest.raises(RuntimeError, match="last replay may still run"):
        graph.update(cpu_update_input=[{"actual_seq_lengths_kv": [6, 8]}])
    torch.npu.synchronize()
    graph.update(cpu_update_input=[{"actual_seq_lengths_kv": [6, 8]}])  # after a wait it is fine
