"""What the emulated npu device counts and refuses as torch_npu does on hardware (docs/ascend.md
§17): host-to-device copies that synchronise, host waits, data-dependent output shapes, the NPU
graph rules of FIA updates (an update before every replay, one dict per call, capture lengths
>= 1, updates ordered after the last replay on the host or the device), the SoC and CANN
answers, the HCCL AlltoAllV path, and the npu_scatter_pa_kv_cache stand-in."""

from __future__ import annotations

import pytest
import torch

from dcp_compile.testing import npu_emulator
from dcp_compile.testing.npu_emulator.graphs import CaptureError
from tests.npu.test_emulator import _fia_graph

NPU = "npu"


def test_pageable_and_blocking_uploads_sync_the_host_and_every_upload_counts_its_bytes():
    device = torch.zeros(16, device=NPU)
    pageable, pinned = torch.ones(16), torch.ones(16).pin_memory()
    npu_emulator.reset_host_syncs()
    device.copy_(pinned, non_blocking=True)  # the only upload torch_npu does not synchronise
    assert npu_emulator.host_syncs() == 0 and npu_emulator.h2d_bytes() == 64
    device.copy_(pageable, non_blocking=True)  # pageable: torch_npu synchronises the stream after it
    device.copy_(pinned)  # blocking: synchronised before the copy
    pageable.to(NPU)
    assert npu_emulator.host_syncs() == 3 and npu_emulator.h2d_bytes() == 4 * 64
    npu_emulator.reset_host_syncs()
    assert npu_emulator.host_syncs() == 0 and npu_emulator.h2d_bytes() == 0


def test_host_waits_are_host_syncs():
    npu_emulator.reset_host_syncs()
    torch.npu.synchronize()
    torch.npu.current_stream().synchronize()
    event = torch.npu.Event()
    event.record()
    event.query()  # a query does not block
    event.synchronize()
    assert npu_emulator.host_syncs() == 3


@pytest.mark.parametrize("op", ["nonzero", "masked_select", "bool index", "unique", "repeat_interleave"])
def test_data_dependent_output_shapes_sync_the_host_and_cannot_be_captured(op):
    x = torch.tensor([3, 0, 2, 0, 5], device=NPU)
    mask = x > 0
    counts = torch.tensor([1, 0, 2, 0, 1], device=NPU)
    run = {"nonzero": lambda: x.nonzero(), "masked_select": lambda: x.masked_select(mask),
           "bool index": lambda: x[mask], "unique": lambda: torch.unique(x),
           "repeat_interleave": lambda: x.repeat_interleave(counts)}[op]
    with pytest.raises(CaptureError, match="synchronises the stream"):
        with torch.npu.graph(torch.npu.NPUGraph()):
            run()
    npu_emulator.reset_host_syncs()
    out = run()
    assert npu_emulator.host_syncs() == 1 and npu_emulator.ops_off_device() == {}
    assert sum(npu_emulator.syncing_ops().values()) == 1
    assert out.device.type == NPU


def test_static_shapes_do_not_sync():
    x = torch.tensor([3, 0, 2, 0, 5], device=NPU)
    npu_emulator.reset_host_syncs()
    x.repeat_interleave(torch.tensor([1, 0, 2, 0, 1], device=NPU), output_size=4)
    x[torch.tensor([0, 2], device=NPU)]  # an integer index
    x.repeat_interleave(2)
    assert npu_emulator.syncing_ops() == {}


def test_a_replay_needs_an_update_of_its_fia_calls_since_the_last_replay():
    graph, out, run = _fia_graph([20, 3, 40])
    with pytest.raises(RuntimeError, match="would hang"):
        graph.replay()  # not updated since capture
    graph.update(cpu_update_input=[{"actual_seq_lengths_kv": [33, 1, 17]}])
    graph.replay()
    torch.npu.synchronize()
    assert torch.equal(out.cpu(), run([33, 1, 17]).cpu())
    with pytest.raises(RuntimeError, match="would hang"):
        graph.replay()  # not updated since the last replay


def test_a_graph_without_fia_replays_without_updates():
    x = torch.ones(4, device=NPU)
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        x.mul_(2)
    graph.replay()
    graph.replay()
    assert x.cpu().tolist() == [4.0] * 4


def test_update_takes_one_dict_per_fia_call_or_one_for_all():
    graph, _, _ = _fia_graph([5, 7])
    with pytest.raises(RuntimeError, match="one dict per call"):
        graph.update(cpu_update_input=[])
    with pytest.raises(RuntimeError, match="one dict per call"):
        graph.update(cpu_update_input=[{"actual_seq_lengths_kv": [6, 8]}] * 2)  # one call recorded
    graph.update(cpu_update_input=[{"actual_seq_lengths_kv": [6, 8]}])


def test_a_capture_with_a_kv_length_of_zero_is_refused():
    with pytest.raises(CaptureError, match="capture FIA with every KV length >= 1"):
        _fia_graph([5, 0])


def test_an_update_is_ordered_after_the_last_replay_on_the_device_the_torchair_way():
    graph, out, run = _fia_graph([5, 7])
    graph.update(cpu_update_input=[{"actual_seq_lengths_kv": [6, 8]}])
    graph.replay()
    finished = torch.npu.Event()
    finished.record()
    update_stream = graph.graph_dispatch_mode.update_stream
    with pytest.raises(RuntimeError, match="last replay may still run"):
        with torch.npu.stream(update_stream):  # the caller's stream is not the one update runs on
            torch.npu.current_stream().wait_event(torch.npu.Event())  # an event before the replay: no order
            graph.update(cpu_update_input=[{"actual_seq_lengths_kv": [9, 10]}])
    npu_emulator.reset_host_syncs()
    update_stream.wait_event(finished)
    graph.update(cpu_update_input=[{"actual_seq_lengths_kv": [9, 10]}])
    graph.replay()
    assert npu_emulator.host_syncs() == 0
    torch.npu.synchronize()
    assert torch.equal(out.cpu(), run([9, 10]).cpu())


def test_the_graph_runner_orders_updates_on_the_device_and_replays_without_host_syncs():
    from dcp_compile.runtime.graph_runner import NPUGraphs

    graphs = NPUGraphs()
    graph, out, run = _fia_graph([5, 7])
    graphs.replay(graph, [{"actual_seq_lengths_kv": [6, 8]}])
    npu_emulator.reset_host_syncs()
    for lengths in ([7, 9], [8, 10], [1, 11]):
        graphs.replay(graph, [{"actual_seq_lengths_kv": lengths}])  # the last replay not waited for by the host
    assert npu_emulator.host_syncs() == 0
    torch.npu.synchronize()
    assert torch.equal(out.cpu(), run([1, 11]).cpu())


@pytest.mark.parametrize("soc, number", [(None, 223), ("Ascend910_9391", 250), ("Ascend950PR", 260)])
def test_soc_and_cann_versions_come_from_the_environment(monkeypatch, soc, number):
    if soc is not None:
        monkeypatch.setenv("DCP_COMPILE_NPU_EMULATOR_SOC", soc)
    monkeypatch.setenv("DCP_COMPILE_NPU_EMULATOR_CANN", "8.3.RC1")
    assert torch.npu.get_device_name() == (soc or "Ascend910B3") and torch.npu.get_device_name(0) == (soc or "Ascend910B3")
    assert torch.npu.get_soc_version() == number
    assert torch.npu.utils.get_cann_version(module="CANN") == "8.3.RC1"
    monkeypatch.delenv("DCP_COMPILE_NPU_EMULATOR_CANN")
    assert torch.npu.utils.get_cann_version() == "9.0.0"


def test_scatter_reduce_falls_back_on_ascend950(monkeypatch):
    from dcp_compile.testing.npu_emulator import op_coverage

    values = torch.ones(3, device=NPU)
    args = (torch.zeros(2, device=NPU), 0, torch.tensor([0, 1, 1], device=NPU), values, "sum")
    assert not op_coverage.off_device(torch.ops.aten.scatter_reduce.two, args, {})
    monkeypatch.setenv("DCP_COMPILE_NPU_EMULATOR_SOC", "Ascend950DT")
    assert op_coverage.off_device(torch.ops.aten.scatter_reduce.two, args, {})


def _alltoall_rank(rank, world, port, queue):
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    npu_emulator.install()
    dist.init_process_group("hccl", rank=rank, world_size=world)
    try:
        x = torch.arange(4, dtype=torch.float32, device=NPU) + 10 * rank
        npu_emulator.reset_host_syncs()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)  # equal blocks: AlltoAll
        equal = npu_emulator.alltoallv_calls()
        dist.all_to_all_single(out, x, [2, 2], [2, 2])  # explicit lists: AlltoAllV, even when equal
        queue.put((rank, equal, npu_emulator.alltoallv_calls(), out.cpu().tolist()))
    finally:
        dist.destroy_process_group()


def test_hccl_counts_all_to_all_calls_with_split_lists():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    ranks = [context.Process(target=_alltoall_rank, args=(r, 2, port, queue)) for r in range(2)]
    for p in ranks:
        p.start()
    results = sorted(queue.get(timeout=300) for _ in ranks)
    for p in ranks:
        p.join(timeout=60)
    assert [(equal, split) for _, equal, split, _ in results] == [(0, 1), (0, 1)]
    assert results[0][3] == [0.0, 1.0, 10.0, 11.0] and results[1][3] == [2.0, 3.0, 12.0, 13.0]


# npu_scatter_pa_kv_cache ------------------------------------------------------------------------

def _scatter_inputs(dtype=torch.float16, tokens=4, heads=2, k_size=32, v_size=16):
    key = torch.randn(tokens, heads, k_size).to(dtype)
    value = torch.randn(tokens, heads, v_size).to(dtype)
    return key, value


def _golden(key, value, key_cache, value_cache, slots, block_size, last):
    """The op-plugin test's golden (test/test_custom_ops/test_scatter_pa_kv_cache.py @ 517f2e7d), for
    slots inside the op's contract (its skip of slot < 0 serves a slot the contract excludes)."""
    key_cache, value_cache = key_cache.clone(), value_cache.clone()
    for i, slot in enumerate(slots.tolist()):
        block, offset = slot // block_size, slot % block_size
        if not last:
            key_cache[block][offset], value_cache[block][offset] = key[i], value[i]
            continue
        for source, cache in ((key[i].reshape(-1), key_cache), (value[i].reshape(-1), value_cache)):
            for k in range(source.numel() // last):
                cache[block][k][offset][:] = source[k * last:(k + 1) * last]
    return key_cache, value_cache


@pytest.mark.parametrize("cache_mode", ["Norm", None, "PA_NZ"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_scatter_pa_kv_cache_writes_each_token_to_its_slot(cache_mode, slot_dtype):
    """int64 slots on the emulator's default CANN (9.0.0: the 2026 kernels); the 2025 A2/A3 ND
    kernel's int32 read: tests/npu/test_kv_write_contract.py."""
    from dcp_compile.lowering import npu as npu_lowering

    npu_lowering.ensure_ops()
    key, value = _scatter_inputs()
    blocks, block_size, heads = 3, 16, 2
    last = 16 if cache_mode == "PA_NZ" else 0  # 32 // itemsize of fp16
    if last:
        key_cache = torch.zeros(blocks, heads * 32 // last, block_size, last, dtype=torch.float16)
        value_cache = torch.zeros(blocks, heads * 16 // last, block_size, last, dtype=torch.float16)
    else:
        key_cache = torch.zeros(blocks, block_size, heads, 32, dtype=torch.float16)
        value_cache = torch.zeros(blocks, block_size, heads, 16, dtype=torch.float16)
    slots = torch.tensor([17, 30, 0, 47], dtype=slot_dtype)
    expected = _golden(key, value, key_cache, value_cache, slots, block_size, last)
    on_device = [t.to(NPU) for t in (key, value, key_cache, value_cache, slots)]
    npu_emulator.reset_host_syncs()
    result = torch.ops.npu.npu_scatter_pa_kv_cache(*on_device, cache_mode=cache_mode)
    assert result is None and npu_emulator.host_syncs() == 0
    assert torch.equal(on_device[2].cpu(), expected[0]) and torch.equal(on_device[3].cpu(), expected[1])


def test_scatter_pa_kv_cache_takes_the_5d_nz_cache():
    from dcp_compile.lowering import npu as npu_lowering

    npu_lowering.ensure_ops()
    key, value = _scatter_inputs(torch.bfloat16, tokens=2, k_size=32, v_size=32)
    cache4 = torch.zeros(2, 4, 16, 16, dtype=torch.bfloat16)
    key5, value5 = torch.zeros(2, 2, 2, 16, 16, dtype=torch.bfloat16).to(NPU), torch.zeros(2, 2, 2, 16, 16, dtype=torch.bfloat16).to(NPU)
    slots = torch.tensor([3, 30], dtype=torch.int32)
    expected = _golden(key, value, cache4, cache4, slots, 16, 16)
    torch.ops.npu.npu_scatter_pa_kv_cache(key.to(NPU), value.to(NPU), key5, value5, slots.to(NPU))
    assert torch.equal(key5.cpu().reshape(2, 4, 16, 16), expected[0])
    assert torch.equal(value5.cpu().reshape(2, 4, 16, 16), expected[1])


def test_scatter_pa_kv_cache_leaves_a_slot_several_tokens_write_undefined():
    """The op's result there is undefined (its doc: "重复时不保证正确性"): NaN, so a read of it shows."""
    from dcp_compile.lowering import npu as npu_lowering

    npu_lowering.ensure_ops()
    key, value = _scatter_inputs()
    caches = [torch.zeros(2, 16, 2, size, dtype=torch.float16, device=NPU) for size in (32, 16)]
    torch.ops.npu.npu_scatter_pa_kv_cache(key.to(NPU), value.to(NPU), *caches,
                                          torch.tensor([1, 5, 5, 5], dtype=torch.int32, device=NPU), cache_mode="Norm")
    for cache, source in zip(caches, (key, value)):
        rows = cache.cpu().view(32, 2, -1)
        assert torch.isnan(rows[5]).all() and torch.equal(rows[1], source[0])


@pytest.mark.parametrize("case, error, match", [
    ("negative", ValueError, "slot -1 is negative"),
    ("tokens", ValueError, r"numBlocks \* blockSize should larger than numTokens"),
    ("out of range", ValueError, "out of range"),
    ("slot dtype", ValueError, "int32 or int64"),
    ("cache dtype", ValueError, "share a dtype"),
    ("strided", ValueError, "not contiguous"),
    ("3-D cache", ValueError, "is not a Norm cache"),
    ("compress", NotImplementedError, "compress"),
    ("mode", ValueError, "cache_mode"),
])
def test_scatter_pa_kv_cache_enforces_the_documented_limits(case, error, match):
    from dcp_compile.lowering import npu as npu_lowering

    npu_lowering.ensure_ops()
    key, value = _scatter_inputs()
    key_cache = torch.zeros(2, 16, 2, 32, dtype=torch.float16)
    value_cache = torch.zeros(2, 16, 2, 16, dtype=torch.float16)
    slots = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    kwargs = {"cache_mode": "Norm"}
    if case == "negative":
        slots = torch.tensor([1, 2, 3, -1], dtype=torch.int32)
    elif case == "tokens":
        key_cache, value_cache = key_cache[:, :1].clone(), value_cache[:, :1].clone()  # 2 blocks of 1 slot: 4 tokens
        slots = torch.tensor([0, 1, 0, 1], dtype=torch.int32)
    elif case == "out of range":
        slots = torch.tensor([1, 2, 3, 32], dtype=torch.int32)
    elif case == "slot dtype":
        slots = slots.float()
    elif case == "cache dtype":
        value_cache = value_cache.float()
    elif case == "strided":
        key = torch.randn(2, 4, 32).to(torch.float16).transpose(0, 1)
    elif case == "3-D cache":
        key_cache = key_cache.reshape(32, 2, 32)
    elif case == "compress":
        kwargs["seq_lens"] = torch.ones(1, dtype=torch.int32).to(NPU)
    else:
        kwargs["cache_mode"] = "NZ"
    args = [t.to(NPU) for t in (key, value, key_cache, value_cache, slots)]
    with pytest.raises(error, match=match):
        torch.ops.npu.npu_scatter_pa_kv_cache(*args, **kwargs)


def test_scatter_pa_kv_cache_has_op_plugins_schema_and_traces():
    from dcp_compile.lowering import npu as npu_lowering
    from dcp_compile.testing import npu_standin

    npu_lowering.ensure_ops()
    op = torch.ops.npu.npu_scatter_pa_kv_cache.default
    assert op._schema == torch._C.parse_schema("npu::" + npu_standin.release().schemas["npu_scatter_pa_kv_cache"])
    key, value = _scatter_inputs()
    caches = torch.zeros(2, 4, 16, 16, dtype=torch.float16), torch.zeros(2, 2, 16, 16, dtype=torch.float16)
    real = [t.to(NPU) for t in (key, value, *caches, torch.tensor([0, 1, 2, 3]))]
    with torch._subclasses.FakeTensorMode() as mode:
        key_, value_, key_cache, value_cache, slots = [mode.from_tensor(t) for t in real]
        assert op(key_, value_, key_cache, value_cache, slots) is None
        with pytest.raises(ValueError, match="is not a PA_NZ cache"):  # the fake kernel checks shapes too
            op(key_, value_, value_cache, value_cache, slots)


def test_a_process_group_collective_issued_in_a_capture_runs_at_every_replay(tmp_path):
    """dist.all_to_all_single (not a functional collective) inside a capture: recorded as the HCCL
    task it is on hardware, so each replay exchanges that step's data; with no split lists it is
    HCCL's AlltoAll (the NPU back end's dcp_npu.all_to_all)."""
    import torch.distributed as dist

    from dcp_compile.lowering.npu import ops as npu_ops

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("hccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        x = torch.arange(8.0).view(1, 8).to("npu")
        graph = torch.npu.NPUGraph()
        with torch.npu.graph(graph):
            y = npu_ops.ALL_TO_ALL(x * 2, dist.group.WORLD.group_name) + 1
        assert "hccl.collective" in graph.recorded_ops
        npu_emulator.reset_host_syncs()
        for value in (5.0, 7.0):
            x.copy_(torch.full((1, 8), value).pin_memory(), non_blocking=True)
            graph.replay()
            assert torch.equal(y.cpu(), torch.full((1, 8), 2 * value + 1))
        assert npu_emulator.alltoallv_calls() == 0
    finally:
        if started:
            dist.destroy_process_group()
