"""A verify step commits only its accepted tokens on the emulated npu device, its verify and
decode steps replayed from NPU graphs: the verify graph records each row's state and update terms
into the layer's buffers, and MLAModel.commit_verify (device ops, after the replay) keeps the kept
drafts' state. The flow of tests/runtime/test_verify_commit.py (k = 4, rows keeping 2, 0, 4, 1,
runner-padded rows in every replay, 6 decode steps) equals feeding the kept tokens directly, in
bf16 within the harness's rounding tolerance, where requests that verify without the commit are
far outside it."""

from __future__ import annotations

import torch

import dcp_compile
from dcp_compile.harness.scenario import half_precision_tolerance
from dcp_compile.models.mla import MLAModel
from dcp_compile.runtime.batch import RequestTable
from dcp_compile.runtime.graph_runner import GraphRunner, device_graphs
from tests.npu.models import TINY_512
from tests.runtime.test_verify_commit import PROMPTS, replayed_verify_then_decode

NPU = "npu"


def test_verify_replayed_from_an_npu_graph_commits_only_the_accepted_drafts():
    assert "linear" in TINY_512.layer_types
    model = dcp_compile.apply(MLAModel(TINY_512, 2048, max_requests=3 * len(PROMPTS), dtype=torch.bfloat16,
                                       page_size=16, device=NPU, seed=3), 1, kernels="npu")
    runner = GraphRunner(model.compiled("gather-q"), buckets=(16,), debug=True, graphs=device_graphs(torch.device(NPU, 0)),
                         host_slot=dcp_compile.state(model).host_slot)
    committed, uncommitted, scale = replayed_verify_then_decode(model, RequestTable(3 * len(PROMPTS), 64, 2048, 16),
                                                                runner, NPU)
    assert len(runner.captured) == 2  # the verify graph and the decode graph, each replayed
    tolerance = half_precision_tolerance("bfloat16", TINY_512.num_mla_layers, scale)
    print(f"committed {committed:.4g}, tolerance {tolerance:.4g}, uncommitted {uncommitted:.4g}")
    assert committed < tolerance < uncommitted
