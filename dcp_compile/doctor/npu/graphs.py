"""The checks of NPU graphs: FIA captured with `auto_dispatch_capture`, refreshed by
`NPUGraph.update(cpu_update_input=...)` before each replay (docs/ascend.md §9.3, §17), and a whole
native decode and verify step captured and replayed by the runtime's GraphRunner."""

from __future__ import annotations

import importlib.util
import warnings

import torch

from dcp_compile.doctor.npu.attention import (HEADS, fia, fia_a5, fia_reference, live_rows, paged_cache,
                                                       queries)
from dcp_compile.doctor.npu.checks import Context, Result, attention_matches, first_line

GRAPH_KV_LENS, GRAPH_NEW_KV_LENS = [5, 130, 1], [7, 1, 64]
"""The decode lengths a captured FIA call is recorded with, and those the update pushes."""


def _captured_decode(device, run, seed: int, capture_lens=None, cache_lens=None):
    """(graph, (out, lse), q, q_rope, cache): `run(q, q_rope, cache, kv_lens)` captured in an NPU
    graph after two warm-up calls, with capture_lens (GRAPH_KV_LENS: every length >= 1, as the
    lowering captures, docs/ascend.md §17), over a cache for cache_lens (the longer of
    GRAPH_KV_LENS and GRAPH_NEW_KV_LENS)."""
    capture_lens = capture_lens or GRAPH_KV_LENS
    cache_lens = cache_lens or [max(a, b) for a, b in zip(GRAPH_KV_LENS, GRAPH_NEW_KV_LENS)]
    cache = paged_cache([max(a, b) for a, b in zip(capture_lens, cache_lens)], 128, device, seed=seed)
    q, q_rope = queries(len(capture_lens), HEADS, device, seed=seed + 1)
    for _ in range(2):
        run(q, q_rope, cache, capture_lens)
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph, auto_dispatch_capture=True):
        outputs = run(q, q_rope, cache, capture_lens)
    return graph, outputs, q, q_rope, cache


def _refused(update) -> str:
    try:
        update()
    except Exception as exc:
        return f"refused: {first_line(exc, 120)}"
    return "accepted"


def check_graph_update_names(result: Result, context: Context) -> None:
    device = context.device
    graph, (out, lse), q, q_rope, cache = _captured_decode(device, fia, seed=31)
    graph.update(cpu_update_input=[{"actual_seq_lengths_kv": GRAPH_NEW_KV_LENS}])
    graph.replay()
    torch.npu.synchronize()
    kv_ok, detail = attention_matches((out, lse), fia_reference(q, q_rope, cache, GRAPH_NEW_KV_LENS))
    query_lens, tnd_lens, tnd_new = [3, 1, 2], [5, 1, 40], [6, 2, 41]
    tq, tq_rope = queries(sum(query_lens), HEADS, device, seed=33)
    graph = torch.npu.NPUGraph()
    fia(tq, tq_rope, cache, tnd_lens, "TND", query_lens)
    with torch.npu.graph(graph, auto_dispatch_capture=True):
        tout, tlse = fia(tq, tq_rope, cache, tnd_lens, "TND", query_lens)
    new_query_lens = [2, 2, 2]  # the same tokens split otherwise: cumulative [2, 4, 6]
    graph.update(cpu_update_input=[{"actual_seq_lengths": [2, 4, 6], "actual_seq_lengths_kv": tnd_new}])
    graph.replay()
    torch.npu.synchronize()
    q_ok, _ = attention_matches((tout, tlse), fia_reference(tq, tq_rope, cache, tnd_new, new_query_lens))
    block_table = _refused(lambda: graph.update(cpu_update_input=[{"block_table": cache.table}]))
    result.measured = {**detail, "actual_seq_lengths_kv": kv_ok, "actual_seq_lengths": q_ok,
                       "block_table update (replaces a keyword argument; the lowering never sends it)": block_table}
    result.verdict = "PASS" if kv_ok and q_ok else "FAIL"


def check_v2_graph_update_names(result: Result, context: Context) -> None:
    graph, (out, lse), q, q_rope, cache = _captured_decode(context.device, lambda *a: fia_a5(*a, 2, nz_cache=True),
                                                           seed=35)
    graph.update(cpu_update_input=[{"actual_seq_kvlen": GRAPH_NEW_KV_LENS}])
    graph.replay()
    torch.npu.synchronize()
    ok, detail = attention_matches((out, lse), fia_reference(q, q_rope, cache, GRAPH_NEW_KV_LENS))
    v1_name = _refused(lambda: graph.update(cpu_update_input=[{"actual_seq_lengths_kv": GRAPH_KV_LENS}]))
    result.measured = {**detail, "actual_seq_lengths_kv (v1's name: torch_npu ignores a key its call lacks)": v1_name}
    result.verdict = "PASS" if ok else "FAIL"


UPDATE_COUNT_LENS = ([5, 130, 0], [1, 64, 7], [40, 2, 3])
"""The KV lengths each of three captured FIA calls is updated to."""


def check_fia_update_count(result: Result, context: Context) -> None:
    """Three FIA calls captured in one graph (as a model's layers are), updated with one dict each:
    every call replays with its own lengths; an update with fewer dicts than calls is refused
    (torch_npu's update_capture_record; on the 7.3.0 line it was taken, and the calls past the
    dicts were never updated: their replay waits forever, docs/ascend.md §20.3)."""
    device = context.device
    calls = len(UPDATE_COUNT_LENS)
    capture_lens = [1] * len(UPDATE_COUNT_LENS[0])
    cache = paged_cache([max(column) for column in zip(*UPDATE_COUNT_LENS)], 128, device, seed=37)
    inputs = [queries(len(capture_lens), HEADS, device, seed=38 + call) for call in range(calls)]
    for q, q_rope in inputs:
        fia(q, q_rope, cache, capture_lens)
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph, auto_dispatch_capture=True):
        outputs = [fia(q, q_rope, cache, capture_lens) for q, q_rope in inputs]
    graph.update(cpu_update_input=[{"actual_seq_lengths_kv": lens} for lens in UPDATE_COUNT_LENS])
    graph.replay()
    torch.npu.synchronize()
    own = []
    for (q, q_rope), pair, lens in zip(inputs, outputs, UPDATE_COUNT_LENS):
        ok, _ = attention_matches(live_rows(pair, [1] * len(lens), lens),
                                  live_rows(fia_reference(q, q_rope, cache, lens), [1] * len(lens), lens))
        own.append(ok)
    fewer = _refused(lambda: graph.update(cpu_update_input=[{"actual_seq_lengths_kv": lens}
                                                            for lens in UPDATE_COUNT_LENS[:-1]]))
    result.measured = {"fia_calls_recorded": calls, "each_call_replays_its_own_lengths": own,
                       f"{calls - 1} dicts for {calls} calls (must be refused)": fewer}
    result.verdict = "PASS" if all(own) and fewer.startswith("refused") else "FAIL"
    if fewer == "accepted":
        result.detail = ("an update with fewer dicts than recorded FIA calls was taken: the calls left without one are "
                         "never updated and their replay would wait forever; the runtime must send one dict per call")


def check_capture_lengths_one(result: Result, context: Context) -> None:
    """FIA captured with every KV length 1, then updated to lengths with 0 and long ones: the replay
    gives the updated lengths' attention (out 0 where a length is 0)."""
    lengths = [0, 37, 5, 300]
    graph, (out, lse), q, q_rope, cache = _captured_decode(context.device, fia, seed=41, capture_lens=[1, 1, 1, 1],
                                                           cache_lens=lengths)
    graph.update(cpu_update_input=[{"actual_seq_lengths_kv": lengths}])
    graph.replay()
    torch.npu.synchronize()
    ok, detail = attention_matches(live_rows((out, lse), [1] * 4, lengths),
                                   live_rows(fia_reference(q, q_rope, cache, lengths), [1] * 4, lengths))
    live = torch.tensor(lengths) > 0
    empty_out_zero = bool((out.cpu()[~live] == 0).all())
    result.measured = {**detail, "empty_row_out_zero": empty_out_zero}
    result.verdict = "PASS" if ok and empty_out_zero else "FAIL"


def _native_step_replays(device, off_device_warnings: list) -> dict:
    """A tiny-512 decode and split-verify step under npu_kernels='native' (dcp_size 1), captured by
    a GraphRunner and replayed: the capture succeeds (every op is device work) and the replays
    give the eager logits."""
    import dcp_compile
    from dcp_compile.models.config import preset
    from dcp_compile.models.mla import MLAModel
    from dcp_compile.runtime.batch import RequestTable
    from dcp_compile.runtime.graph_runner import GraphRunner, NPUGraphs

    config = preset("tiny-512").with_layers(2)
    model = dcp_compile.apply(MLAModel(config, 2048, max_requests=4, dtype=torch.bfloat16, page_size=128,
                                       device=device), 1, kernels="npu")
    eager = dcp_compile.apply(MLAModel(config, 2048, max_requests=4, dtype=torch.bfloat16, page_size=128,
                                       device=device), 1, kernels="npu")
    tables = [RequestTable(4, 512, 2048, 128) for _ in range(2)]
    state = dcp_compile.state(model)
    runner = GraphRunner(model.compiled("gather-q"), buckets=(4,), graphs=NPUGraphs(), host_slot=state.host_slot,
                         watched=state.kv_pool.storage())
    diffs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for table, target in zip(tables, (model, eager)):
            prefill = table.extend_batch([0, 1, 2], [[3] * 15, [4] * 131, [5]], pad_rows=1)
            target(*prefill.to(device).args(), host_metadata=prefill.host)
        for step in range(3):
            for tokens, per_row in (([[1 + step], [2], [3]], 1), ([[1] * 7, [2] * 7, [3] * 7], 7)):
                batches = [table.extend_batch([0, 1, 2], tokens, all_logits=per_row > 1) for table in tables]
                replayed = runner(batches[0], per_row)
                want = eager(*batches[1].to(device).args(), host_metadata=batches[1].host)
                diffs.append(float((replayed.float() - want.float()).abs().max()))
    off_device_warnings.extend(str(w.message)[:160] for w in caught if "fall back" in str(w.message))
    return {"max_abs_diff_logits": max(diffs), "graphs_captured": len(runner.captured)}


def check_native_step_on_device(result: Result, context: Context) -> None:
    warned: list[str] = []
    measured = _native_step_replays(context.device, warned)
    if context.emulated:
        from dcp_compile.testing import npu_emulator

        warned.extend(sorted(npu_emulator.ops_off_device()))
    result.measured = {**measured, "ops_falling_back_to_the_cpu": warned}
    result.verdict = "PASS" if not warned and measured["max_abs_diff_logits"] <= 5e-2 else "FAIL"


def check_torchair_symint_lengths(result: Result, context: Context) -> None:
    if importlib.util.find_spec("torchair") is None:
        result.detail = "needs torchair (torch_npu's dynamo back end), which ships with torch_npu"
        return
    import dcp_compile
    from dcp_compile.models.config import preset
    from dcp_compile.models.mla import MLAModel
    from dcp_compile.runtime.batch import RequestTable

    device = context.device
    compiles, outs = [], {}
    for inner in ("torchair", "eager"):
        torch._dynamo.reset()
        model = MLAModel(preset("tiny-512"), 4096, max_requests=4, dtype=torch.bfloat16, page_size=128, device=device)
        dcp = dcp_compile.apply(model, 1, kernels="npu", inner_compile=inner)
        table = RequestTable(4, 512, 4096, 128)
        logits = []
        for step in range(12):  # a prefill, then decode steps whose lengths all change
            tokens = [[1] * 5, [2] * 9, [3]] if step == 0 else [[step % 7 + 1]] * 3
            batch = table.extend_batch([0, 1, 2], tokens, pad_rows=1)
            logits.append(dcp(*batch.to(device).args(), host_metadata=batch.host).cpu())
        outs[inner] = logits
        compiles.append(len(dcp_compile.state(dcp).reports))
    diffs = [float((a.float() - b.float()).abs().max()) for a, b in zip(outs["torchair"], outs["eager"])]
    result.measured = {"torchair_graphs_compiled": compiles[0], "eager_graphs_compiled": compiles[1],
                       "max_abs_diff_logits": max(diffs)}
    result.verdict = "PASS" if compiles[0] <= 2 and max(diffs) <= 5e-2 else "FAIL"
