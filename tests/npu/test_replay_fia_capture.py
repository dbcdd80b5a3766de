"""FIA's KV lengths at an NPU-graph capture are at least 1 (lowering/npu/feed.py): the graph
runner captures on a fully padded batch, all of whose lengths are 0, and FIA's tiling depends on
how the lengths split (vllm-ascend captures with lengths >= 1). Every replay's NPUGraph.update
sets the real lengths, 0 for padded rows included, and the replay matches the eager step."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import dcp_compile
from dcp_compile.lowering.npu import ensure_ops
from dcp_compile.lowering.npu import feed as feed_module
from dcp_compile.lowering.npu.feed import FIAFeed
from dcp_compile.models.mla import MLAModel
from dcp_compile.runtime.batch import RequestTable
from dcp_compile.runtime.graph_runner import GraphRunner, NPUGraphs
from dcp_compile.runtime.host_inputs import HOST_INPUT, HostInput
from dcp_compile.runtime.host_metadata import RankHostMetadata
from tests.npu.models import TINY_512

ensure_ops()
FIA = torch.ops.npu.npu_fused_infer_attention_score.default
NPU = "npu"
ONE_MLA_LAYER = TINY_512.with_layers(2)
PAGE = 16


def fia_graph(rows: int) -> fx.GraphModule:
    """An FIA call of a split verify's prefix part, as the lowering leaves it: host lists of
    placeholders (cumulative query lengths, KV lengths before the first query)."""
    graph = fx.Graph()
    lists = {}
    for kind, argument in (("cumulative_query_len", "actual_seq_lengths"), ("local_prefix_len", "actual_seq_lengths_kv")):
        nodes = []
        for b in range(rows):
            node = graph.placeholder(f"dcp_{kind}_{b}")
            node.meta[HOST_INPUT] = HostInput(kind, b)
            node.meta["val"] = 1
            nodes.append(node)
        lists[argument] = nodes
    local = [graph.placeholder(f"dcp_local_len_{b}") for b in range(rows)]
    for b, node in enumerate(local):
        node.meta[HOST_INPUT], node.meta["val"] = HostInput("local_len", b), 1
    graph.output((graph.call_function(FIA, (), lists), *local))
    return fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("capturing", [False, True])
def test_kv_lengths_are_at_least_one_only_while_capturing(monkeypatch, capturing):
    monkeypatch.setattr(feed_module.devices, "capturing", lambda device: capturing)
    feed = FIAFeed(fia_graph(3), 0)
    host = RankHostMetadata(query_lens=(2, 2, 2), local_seq_lens=(5, 0, 0), local_prefix_lens=(3, 0, 0),
                            block_table=None)
    values = dict(zip((n.name for n in feed.placeholders), feed.values(host)))
    assert [values[f"dcp_cumulative_query_len_{b}"] for b in range(3)] == [2, 4, 6]  # never changed
    floor = 1 if capturing else 0
    assert [values[f"dcp_local_prefix_len_{b}"] for b in range(3)] == [3, floor, floor]
    assert [values[f"dcp_local_len_{b}"] for b in range(3)] == [5, floor, floor]
    assert feed.graph_updates(host) == [{"actual_seq_lengths": [2, 4, 6], "actual_seq_lengths_kv": [3, 0, 0]}]
    assert feed.fed is host  # what check_fed compares: the real lengths


def npu_model():
    model = MLAModel(ONE_MLA_LAYER, 1024, max_requests=4, dtype=torch.bfloat16, page_size=PAGE, device=NPU)
    return dcp_compile.apply(model, 1, kernels="npu")


def fia_records(graph):
    """The graph's FIA records: captured as `.out`, as torch_npu's NPU-graph handler captures them."""
    return [r for r in graph._records if getattr(r.func, "_opname", None) == FIA._opname]


def test_a_capture_sees_lengths_of_at_least_one_and_a_replay_after_update_matches_eager():
    """Decode steps, then a split verify (its FIA takes the KV lengths before each row's first query)."""
    model, eager = npu_model(), npu_model()
    tables = [RequestTable(4, 96, 1024, PAGE) for _ in range(2)]
    for m, table in zip((model, eager), tables):
        prefill = table.extend_batch([0, 1, 2], [[3] * 15, [4] * 31, [5]])
        m(*prefill.to(NPU).args(), host_metadata=prefill.host)
    state = dcp_compile.state(model)
    runner = GraphRunner(model.compiled("gather-q"), buckets=(4,), graphs=NPUGraphs(), host_slot=state.host_slot,
                         watched=state.kv_pool.storage())
    requests = [0, 1, 2]
    for step in range(2):
        tokens = [[10 + step + r] for r in requests]
        batch = tables[0].extend_batch(requests, tokens)
        if step == 0:  # the capture, on a fully padded batch: every length 0, given to FIA as 1
            captured = runner.capture(batch, 1)
            (fia,) = fia_records(captured.graph)
            assert fia.kwargs["actual_seq_lengths_kv"] == [1, 1, 1, 1]
        out = runner(batch)
        assert fia.kwargs["actual_seq_lengths_kv"] == [16 + step, 32 + step, 2 + step, 0]  # updated: the padded row's 0
        padded = tables[1].extend_batch(requests, tokens).padded(4, 1)
        expected = eager(*padded.to(NPU).args(), host_metadata=padded.host)[:3]
        assert torch.equal(out.cpu(), expected.cpu())
    # a split verify of 3 drafts a row: FIA over the keys before each row's first query
    drafts = [[20 + r] * 3 for r in requests]
    batch = tables[0].extend_batch(requests, drafts, all_logits=True)
    captured = runner.capture(batch, 3)
    (fia,) = fia_records(captured.graph)
    assert fia.kwargs["actual_seq_lengths_kv"] == [1, 1, 1, 1] and fia.kwargs["actual_seq_lengths"] == [3, 6, 9, 12]
    out = runner(batch, tokens_per_row=3)
    assert fia.kwargs["actual_seq_lengths_kv"] == [17, 33, 3, 0]
    padded = tables[1].extend_batch(requests, drafts, all_logits=True).padded(4, 3)
    expected = eager(*padded.to(NPU).args(), host_metadata=padded.host)[:9]
    assert torch.equal(out.cpu(), expected.cpu())


def test_a_host_block_table_past_the_shard_is_refused_before_fia_reads_it():
    """The native lowering reads the KV through the host-fed block table alone: every step, replays
    included, checks its ids against the shard FIA reads."""
    from tests.npu.test_lowering import lowered_graph

    gm, _ = lowered_graph("decode", dcp_size=2, tp_size=2, batch=3, context=40)
    feed = FIAFeed(gm, 0)
    assert feed.pool_blocks is not None
    table = torch.zeros(3, 2, dtype=torch.int32)
    feed.prepare(RankHostMetadata((1, 1, 1), (1, 1, 1), (0, 0, 0), table))
    table[1, 0] = feed.pool_blocks
    with pytest.raises(IndexError, match="past the pool"):
        feed.prepare(RankHostMetadata((1, 1, 1), (1, 1, 1), (0, 0, 0), table))
