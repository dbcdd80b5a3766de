"""End to end on GPUs: DCP against DCP=1 through NCCL with the Triton kernels, and CUDA-graph
replay against eager. Skipped without CUDA (CI is CPU-only); run on the GPU machine."""

from __future__ import annotations

import warnings

import pytest
import torch

import dcp_compile
from dcp_compile.models.config import preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.runtime.batch import RequestTable
from dcp_compile.runtime.graph_runner import GraphRunner, StaleAddressError
from dcp_compile.harness.scenario import Scenario, compare

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
MLA_ONLY = preset("tiny").replace(layer_types=("mla",) * 4)


@two_gpus
@pytest.mark.parametrize("mode,extra", [("decode", {}), ("verify", {"draft_len": 7}),
                                        ("extend", {"chunk": 37, "attention_strategy": "gather-kv"})])
def test_dcp2_matches_dcp1_fp32(mode, extra):
    result = compare(Scenario(mode=mode, device="cuda", contexts=(1, 3, 17, 300), steps=4, seed=3, **extra))
    assert result["finite"] and result["tokens_match"]
    assert result["max_rel_diff"] < 1e-3, result["max_rel_diff"]


@two_gpus
def test_dcp2_matches_dcp1_bf16():
    result = compare(Scenario(device="cuda", dtype="bfloat16", contexts=(1, 3, 17, 300), steps=4, seed=4))
    assert result["finite"]
    assert result["max_rel_diff"] < 3e-2, result["max_rel_diff"]


def _prefilled(seed=1):
    model = MLAModel(MLA_ONLY, kv_capacity=1024, max_requests=4, device="cuda", seed=seed)
    compiled = dcp_compile.apply(model, 1)
    table = RequestTable(4, 64, 1024)
    compiled(*table.extend_batch([0, 1, 2], [[5] * 9, [6], [7] * 30]).to("cuda").args())
    return model, compiled, table


@cuda
def test_graph_replay_matches_eager_with_padded_rows():
    _, eager, eager_table = _prefilled()
    model, graphed, graph_table = _prefilled()
    runner = GraphRunner(graphed.compiled("gather-q"), buckets=(1, 4), debug=True,
                         watched=[model.kv_pool.cache(i) for i in range(4)])
    tokens = [[1], [2], [3]]
    for _ in range(4):
        expected = eager(*eager_table.extend_batch([0, 1, 2], tokens).to("cuda").args())
        got = runner(graph_table.extend_batch([0, 1, 2], tokens))  # 3 rows run in the 4-row graph
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        tokens = [[int(t)] for t in expected.argmax(-1)]
    assert list(runner.captured) == [(4, 1, 64)]


@cuda
def test_stale_address_is_detected():
    model, graphed, table = _prefilled()
    runner = GraphRunner(graphed.compiled("gather-q"), buckets=(4,), debug=True, watched=[model.kv_pool.cache(0)])
    runner(table.extend_batch([0], [[1]]))
    runner.watched = [torch.empty_like(model.kv_pool.cache(0))]  # as if the cache were reallocated
    with pytest.raises(StaleAddressError):
        runner(table.extend_batch([0], [[1]]))


@cuda
def test_batch_beyond_largest_bucket_falls_back_to_eager_once():
    _, graphed, table = _prefilled()
    runner = GraphRunner(graphed.compiled("gather-q"), buckets=(1, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner(table.extend_batch([0, 1, 2], [[1], [2], [3]]))
        runner(table.extend_batch([0, 1, 2], [[1], [2], [3]]))
    assert sum("exceeds the largest captured bucket" in str(w.message) for w in caught) == 1
    assert runner.captured == {}


def _graph_vs_eager_on_rank(rank: int, world_size: int) -> float:
    """DCP = 2 over NCCL: decode steps replayed from CUDA graphs (collectives captured) against
    the same steps run eagerly on a twin model."""
    from dcp_compile.runtime import parallel

    tp = parallel.build(2, 1)

    def twin():
        model = MLAModel(MLA_ONLY, kv_capacity=1024, max_requests=4, par=tp, device="cuda", seed=7)
        compiled = dcp_compile.apply(model, 2, attention_strategy="gather-q")
        table = RequestTable(4, 64, 1024)
        compiled(*table.extend_batch([0, 1, 2], [[5] * 9, [6], [7] * 30]).to("cuda").args())
        return model, compiled, table

    _, eager, eager_table = twin()
    model, graphed, graph_table = twin()
    runner = GraphRunner(graphed.compiled("gather-q"), buckets=(4,), debug=True,
                         watched=[model.kv_pool.cache(i) for i in range(4)])
    worst, tokens = 0.0, [[1], [2], [3]]
    for _ in range(4):
        expected = eager(*eager_table.extend_batch([0, 1, 2], tokens).to("cuda").args())
        got = runner(graph_table.extend_batch([0, 1, 2], tokens))
        worst = max(worst, (got - expected).abs().max().item())
        tokens = [[int(t)] for t in expected.argmax(-1)]
    return worst


@two_gpus
def test_dcp2_graph_replay_matches_eager():
    from dcp_compile.runtime.launch import spawn

    assert max(spawn(_graph_vs_eager_on_rank, 2, backend="nccl")) < 1e-4


@cuda
def test_a_bad_page_table_entry_is_masked_flagged_and_raised_at_the_next_check():
    """On a device the batch guard never reads outside the pool and never syncs: the entry is
    masked, a device flag is set, and the model raises when it reads the flags back."""
    model = dcp_compile.apply(MLAModel(MLA_ONLY, kv_capacity=1024, max_requests=4, device="cuda"), 1, kernels="triton")
    table = RequestTable(4, 64, 1024)
    batch = table.extend_batch([0, 1], [[5] * 9, [6] * 3]).to("cuda")
    batch.req_to_token[0, 2] = 5000  # past the pool's 1024 locations
    out = model(*batch.args())
    assert torch.isfinite(out).all()
    with pytest.raises(IndexError, match="page-table entry in use outside the pool"):
        model.check_errors()
    batch = table.extend_batch([0, 1], [[1], [2]]).to("cuda")
    batch.seq_lens[1] = 0  # a real token taken for padding
    model(*batch.args())
    with pytest.raises(ValueError, match="padded row"):
        model.check_errors()
    assert torch.isfinite(model(*table.extend_batch([0, 1], [[3], [4]]).to("cuda").args())).all()
    model.check_errors()  # the flags were cleared


@cuda
def test_unpadded_prefills_share_symbolic_graphs_and_match_static_ones():
    model = dcp_compile.apply(MLAModel(MLA_ONLY, kv_capacity=4096, max_requests=4, device="cuda"), 1, kernels="triton")
    table = RequestTable(4, 256, 4096)
    lengths = list(range(2, 40, 3))

    def run(step, length):
        batch = table.extend_batch([0, 1], [[5] * length, [6] * (length + 7)]).to("cuda")
        out = step(*batch.args())
        for request in (0, 1):
            table.truncate(request, 0)
        return out

    symbolic = [run(model, n) for n in lengths]
    assert len(dcp_compile.state(model).reports) <= 3  # one symbolic graph (and dynamo's own specialisations)
    static = [run(model.compiled("gather-q"), n) for n in lengths]  # one static graph per shape
    for got, expected in zip(symbolic, static):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
