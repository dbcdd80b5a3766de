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
from tests.runtime.test_verify_commit import ACCEPTED, DECODE_STEPS, DRAFTS, PROMPTS

NPU = "npu"


def test_verify_replayed_from_an_npu_graph_commits_only_the_accepted_drafts():
    n = len(PROMPTS)
    committed, direct, uncommitted = list(range(n)), list(range(n, 2 * n)), list(range(2 * n, 3 * n))
    everyone = committed + direct + uncommitted
    assert "linear" in TINY_512.layer_types
    model = dcp_compile.apply(MLAModel(TINY_512, 2048, max_requests=3 * n, dtype=torch.bfloat16, page_size=16,
                                       device=NPU, seed=3), 1, kernels="npu")
    table = RequestTable(3 * n, 64, 2048, 16)
    runner = GraphRunner(model.compiled("gather-q"), buckets=(16,), debug=True, graphs=device_graphs(torch.device(NPU, 0)),
                         host_slot=dcp_compile.state(model).host_slot)

    def eager(requests, tokens):
        batch = table.extend_batch(requests, tokens, pad_rows=1)
        model(*batch.to(NPU).args(), host_metadata=batch.host)

    eager(everyone, PROMPTS * 3)
    verifying = committed + uncommitted
    verify = table.extend_batch(verifying, DRAFTS * 2, all_logits=True)
    runner(verify, tokens_per_row=len(DRAFTS[0]))
    for request in verifying:
        table.truncate(request, int(table.seq_lens[request]) - len(DRAFTS[request % n]) + ACCEPTED[request % n])
    model.model.commit_verify(verify.state_slots[:n].to(NPU), torch.tensor(ACCEPTED, device=NPU))
    kept = [request for request in direct if ACCEPTED[request % n]]
    eager(kept, [DRAFTS[request % n][:ACCEPTED[request % n]] for request in kept])

    worst, scale = [0.0, 0.0], 0.0
    for step in range(DECODE_STEPS):
        tokens = [[(7 * step + request % n) % 50 + 1] for request in everyone]
        logits = runner(table.extend_batch(everyone, tokens)).float().cpu()
        scale = max(scale, logits[direct].abs().max().item())
        for group, rows in enumerate((committed, uncommitted)):
            worst[group] = max(worst[group], (logits[rows] - logits[direct]).abs().max().item())
    assert len(runner.captured) == 2  # the verify graph and the decode graph, each replayed
    tolerance = half_precision_tolerance("bfloat16", TINY_512.num_mla_layers, scale)
    print(f"committed {worst[0]:.4g}, tolerance {tolerance:.4g}, uncommitted {worst[1]:.4g}")
    assert worst[0] < tolerance < worst[1]
