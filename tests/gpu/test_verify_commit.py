"""A verify step commits only its accepted tokens on a CUDA GPU, its verify and decode steps
replayed from CUDA graphs (the default kernels, fp32, dcp_size 1): the flow of
tests/runtime/test_verify_commit.py equals feeding the kept tokens directly, where requests that
verify without the commit do not. Skipped without CUDA (CI is CPU-only); run on the GPU machine."""

from __future__ import annotations

import pytest
import torch

import dcp_compile
from dcp_compile.models.config import preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.runtime.batch import RequestTable
from dcp_compile.runtime.graph_runner import GraphRunner
from tests.runtime.test_verify_commit import PROMPTS, replayed_verify_then_decode

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_verify_replayed_from_a_cuda_graph_commits_only_the_accepted_drafts():
    model = dcp_compile.apply(MLAModel(preset("tiny"), kv_capacity=256, max_requests=3 * len(PROMPTS), device="cuda",
                                       seed=3), 1)
    runner = GraphRunner(model.compiled("gather-q"), buckets=(16,), debug=True, host_slot=dcp_compile.state(model).host_slot)
    committed, uncommitted, _ = replayed_verify_then_decode(model, RequestTable(3 * len(PROMPTS), 64, 256), runner, "cuda")
    assert len(runner.captured) == 2  # the verify graph and the decode graph, each replayed
    print(f"committed {committed:.4g}, uncommitted {uncommitted:.4g}")
    assert committed < 1e-4 and uncommitted > 1e-2
