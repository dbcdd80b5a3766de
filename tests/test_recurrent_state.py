"""The reference model's recurrent (linear-attention) layers start each request afresh: a prompt
prefilled in a slot another request used gives a fresh model's logits (issue 36, item 6: on
f9a85fb the old request's state leaked in, 1.79 off). At DCP 2 the state is replicated, so DCP 1
shows it."""

from __future__ import annotations

import torch

import dcp_compile
from dcp_compile.models.config import preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.runtime.batch import RequestTable

PROMPT = [[7, 3, 9, 4, 1]]


def _served():
    model = dcp_compile.apply(MLAModel(preset("tiny"), 256, max_requests=2, seed=6), 1)
    assert any(layer.kind == "linear" for layer in model.model.layers)
    return model, RequestTable(2, 32, 256)


def test_a_reused_slot_starts_afresh():
    model, table = _served()
    model(*table.extend_batch([0], [[11, 12, 13, 14]]).args())
    model(*table.extend_batch([0], [[15]]).args())
    table.truncate(0, 0)  # the request leaves; the next one takes its slot
    got = model(*table.extend_batch([0], PROMPT, all_logits=True).args())

    fresh, fresh_table = _served()
    want = fresh(*fresh_table.extend_batch([0], PROMPT, all_logits=True).args())
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max().item()
    # and a request's later tokens keep its own state: a decode step equals the fresh model's
    step = model(*table.extend_batch([0], [[8]]).args())
    assert torch.allclose(step, fresh(*fresh_table.extend_batch([0], [[8]]).args()), atol=1e-5, rtol=0)
