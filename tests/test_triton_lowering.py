"""The whole model with its attention lowered to the Triton kernels (interpreted on CPU) against
the torch reference kernels."""

from __future__ import annotations

import pytest
import torch

import dcp_compile
from dcp_compile.models.config import preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.runtime.batch import RequestTable

pytest.importorskip("triton")


def _run(kernels: str):
    model = dcp_compile.apply(MLAModel(preset("tiny"), kv_capacity=128, max_requests=3, seed=4), 1, kernels=kernels)
    table = RequestTable(3, 32, 128)
    logits = [model(*table.extend_batch([0, 1, 2], [[5, 6, 7, 8], [9], [1, 2]], pad_rows=1).args())]
    logits.append(model(*table.extend_batch([0, 1, 2], [[3], [4], [5]], pad_rows=1).args()))
    return model, logits


def test_triton_lowered_model_matches_reference():
    lowered, got = _run("triton")
    _, expected = _run("torch")
    assert dcp_compile.state(lowered).pass_summary()["lower_kernels"] > 0
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
