"""One compile for every batch bucket: `DCPModel.compiled(strategy, symbolic=True)` under a
GraphRunner captures each bucket's graph from one compiled graph (a size of 1 too, where torch has
size-oblivious sizes and the largest bucket compiles first), on the back ends whose graphs may be
symbolic (Lowering.static_shapes); every replay equals the same model's eager step."""

from __future__ import annotations

import pytest
import torch

import dcp_compile
from dcp_compile import shapes
from dcp_compile.models.config import preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.runtime.batch import RequestTable
from dcp_compile.runtime.graph_runner import GraphRunner
from dcp_compile.testing.graphs import RerunGraphs
from tests.npu.test_graphs import FakeGraphs

PAGE = 4
BUCKETS = (1, 2, 4, 8)
# Decode steps of changing batches: rows 8, 3, 1, 5, 2 (buckets 8, 4, 1, 8, 2); requests 0 and 5
# hold one token before it (an empty shard at DCP > 1, a short row here).
PROMPTS = [[1], [2] * 9, [3] * 30, [4] * 2, [5] * 17, [6], [7] * 64, [8] * 5]
DECODE_ROWS = [list(range(8)), [0, 3, 6], [5], [1, 2, 4, 6, 7], [0, 7], list(range(8))]


def _model(kernels: str, **config):
    return dcp_compile.apply(MLAModel(preset("tiny"), 2048, max_requests=8, page_size=PAGE), 1, kernels=kernels,
                             **config)


def _decode_graphs(model) -> int:
    return len(dcp_compile.state(model).backends["gather-q"].reports)


def _prefilled(*models):
    tables = [RequestTable(8, 128, 2048, PAGE) for _ in models]
    for model, table in zip(models, tables):
        prefill = table.extend_batch(list(range(8)), PROMPTS)
        model(*prefill.args(), host_metadata=prefill.host)
    return tables


def test_a_runner_captures_every_bucket_from_one_compile():
    served, reference = _model("torch"), _model("torch")
    tables = _prefilled(served, reference)
    before = _decode_graphs(served)
    runner = GraphRunner(served.compiled("gather-q", symbolic=True), buckets=BUCKETS, graphs=RerunGraphs())
    for step, rows in enumerate(DECODE_ROWS):
        tokens = [[10 + step]] * len(rows)
        got = runner(tables[0].extend_batch(rows, tokens))
        batch = tables[1].extend_batch(rows, tokens)
        torch.testing.assert_close(got, reference(*batch.args(), host_metadata=batch.host), atol=1e-5, rtol=1e-5)
    assert sorted(key[0] for key in runner.captured) == list(BUCKETS)
    # All four buckets from one graph (torch 2.13), or bucket 1 on its own where dynamo
    # specialises a size of 1; the static variant compiles one per bucket.
    assert 1 <= _decode_graphs(served) - before <= 2, _decode_graphs(served) - before


def test_capturing_the_buckets_largest_first_compiles_once_for_all_of_them():
    """capture_buckets before serving: every bucket, largest first, from one compiled graph (its
    hints the largest bucket's); the decode steps after it only replay, equal to the eager step."""
    served, reference = _model("torch"), _model("torch")
    tables = _prefilled(served, reference)
    before = _decode_graphs(served)
    runner = GraphRunner(served.compiled("gather-q", symbolic=True), buckets=BUCKETS, graphs=RerunGraphs())
    template = RequestTable(8, 128, 2048, PAGE).extend_batch([0], [[9]])  # the page-table width only
    seconds = runner.capture_buckets(template)
    assert list(seconds) == sorted(BUCKETS, reverse=True) and all(s > 0 for s in seconds.values())
    compiled = _decode_graphs(served) - before
    # torch without size-oblivious sizes specialises a size of 1: one graph more
    assert compiled == (1 if shapes.SIZE_OBLIVIOUS_SUPPORTED else 2), compiled
    assert runner.capture_buckets(template) == {}  # nothing left to capture
    for step, rows in enumerate(DECODE_ROWS):
        tokens = [[10 + step]] * len(rows)
        got = runner(tables[0].extend_batch(rows, tokens))
        batch = tables[1].extend_batch(rows, tokens)
        torch.testing.assert_close(got, reference(*batch.args(), host_metadata=batch.host), atol=1e-5, rtol=1e-5)
    assert _decode_graphs(served) - before == compiled  # the steps compiled nothing
    with pytest.raises(ValueError, match="bucket 3 is not one of"):
        runner.capture(template, 1, bucket=3)


def test_a_batch_past_the_largest_bucket_runs_the_compiled_graph_without_a_new_compile():
    """More rows than any bucket: the runner runs the step outside any graph (one warning), from
    the graph compiled for the buckets, and gives the eager step's logits."""
    served, reference = _model("torch"), _model("torch")
    tables = _prefilled(served, reference)
    runner = GraphRunner(served.compiled("gather-q", symbolic=True), buckets=(1, 2, 4), graphs=RerunGraphs())
    runner.capture_buckets(RequestTable(8, 128, 2048, PAGE).extend_batch([0], [[9]]))
    compiled = _decode_graphs(served)
    rows = list(range(8))
    with pytest.warns(UserWarning, match="8 rows exceeds the largest captured bucket 4: running eagerly"):
        got = runner(tables[0].extend_batch(rows, [[11]] * 8))
    batch = tables[1].extend_batch(rows, [[11]] * 8)
    torch.testing.assert_close(got, reference(*batch.args(), host_metadata=batch.host), atol=1e-5, rtol=1e-5)
    assert _decode_graphs(served) == compiled
    assert sorted(key[0] for key in runner.captured) == [1, 2, 4]


def test_flashinfer_captures_every_bucket_from_one_compile_with_a_plan_per_bucket():
    """FlashInfer's plans are sized by the step: one compiled graph, a plan per bucket, each
    planned again for its step's lengths before every replay."""
    served = _model("flashinfer")
    (table,) = _prefilled(served)
    before = _decode_graphs(served)
    state = dcp_compile.state(served)
    runner = GraphRunner(served.compiled("gather-q", symbolic=True), buckets=BUCKETS, graphs=FakeGraphs(device="cpu"),
                         host_slot=state.host_slot)
    for step, rows in enumerate(DECODE_ROWS):
        runner(table.extend_batch(rows, [[10 + step]] * len(rows)))
        bucket = runner.bucket_for(len(rows))
        (feed,) = runner.captured[(bucket, 1, table.req_to_token.shape[1])].feeds
        (plan,) = feed.plans
        lengths = tuple(int(table.seq_lens[r]) for r in rows) + (0,) * (bucket - len(rows))
        assert plan.planned_for == ((1,) * bucket, lengths)  # this step's lengths, padded rows empty
    assert sorted(key[0] for key in runner.captured) == list(BUCKETS)
    assert 1 <= _decode_graphs(served) - before <= 2, _decode_graphs(served) - before


def test_symbolic_is_refused_where_the_back_end_compiles_per_shape():
    model = _model("flashinfer", debug_checks=True)  # its debug check reads one host length a row
    with pytest.raises(ValueError, match="per batch shape .*symbolic=False"):
        model.compiled("gather-q", symbolic=True)
