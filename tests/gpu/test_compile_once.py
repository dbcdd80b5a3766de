"""One compile for every decode bucket on a GPU: `DCPModel.compiled("gather-q", symbolic=True)`
under a GraphRunner with CUDA graphs, inductor as the inner compiler, bf16. `capture_buckets`
captures 8, 4, 2 and 1 (largest first: the compile's size hints) from one compiled graph; the
decode steps after it, over changing batches, replay only and give the logits of the same model
called without graphs. (The CPU twin, tests/runtime/test_compile_once.py, reruns the step on the
host instead of replaying a graph.)"""

from __future__ import annotations

import pytest
import torch

import dcp_compile
from dcp_compile.lowering import flashinfer
from dcp_compile.models.config import preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.runtime.batch import RequestTable
from dcp_compile.runtime.graph_runner import GraphRunner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FLASHINFER = flashinfer.unsupported_reason(torch.device("cuda")) if torch.cuda.is_available() else "needs a CUDA GPU"
PAGE = 32
BUCKETS = (1, 2, 4, 8)
PROMPTS = [[1], [2] * 9, [3] * 300, [4] * 2, [5] * 170, [6], [7] * 64, [8] * 33]
DECODE_ROWS = [list(range(8)), [0, 3, 6], [5], [1, 2, 4, 6, 7], [0, 7], list(range(8))]


def _model(kernels: str):
    model = MLAModel(preset("tiny-512").replace(layer_types=("mla",) * 3), kv_capacity=16384, max_requests=8,
                     dtype=torch.bfloat16, device="cuda", seed=11, page_size=PAGE)
    return dcp_compile.apply(model, 1, kernels=kernels, inner_compile="inductor")


def _decode_graphs(model) -> int:
    return len(dcp_compile.state(model).backends["gather-q"].reports)


@pytest.mark.parametrize("kernels", [
    "triton", pytest.param("flashinfer", marks=pytest.mark.skipif(FLASHINFER is not None, reason=str(FLASHINFER)))])
def test_every_bucket_replays_one_compile_with_the_eager_logits(kernels):
    served, reference = _model(kernels), _model(kernels)
    tables = [RequestTable(8, 1024, 16384, PAGE) for _ in range(2)]
    for model, table in zip((served, reference), tables):
        prefill = table.extend_batch(list(range(8)), PROMPTS)
        model(*prefill.to("cuda").args(), host_metadata=prefill.host)
    before = _decode_graphs(served)
    runner = GraphRunner(served.compiled("gather-q", symbolic=True), buckets=BUCKETS,
                         host_slot=dcp_compile.state(served).host_slot)
    seconds = runner.capture_buckets(RequestTable(8, 1024, 16384, PAGE).extend_batch([0], [[9]]))
    assert list(seconds) == sorted(BUCKETS, reverse=True)
    assert _decode_graphs(served) - before == 1, "every bucket, a size of 1 included, from one compiled graph"
    for step, rows in enumerate(DECODE_ROWS):
        tokens = [[10 + step]] * len(rows)
        got = runner(tables[0].extend_batch(rows, tokens))
        batch = tables[1].extend_batch(rows, tokens)
        want = reference(*batch.to("cuda").args(), host_metadata=batch.host)
        scale = want.float().abs().max().item()
        assert (got.float() - want.float()).abs().max().item() <= 2e-2 * scale, step  # bf16: same kernels, graph or not
        assert torch.equal(got.argmax(-1), want.argmax(-1)), step
    assert _decode_graphs(served) - before == 1  # the steps replayed; nothing compiled
