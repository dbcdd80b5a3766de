"""A verify step commits only its accepted tokens on the emulated npu device, its verify and
decode steps replayed from NPU graphs: the verify graph records each row's state and update terms
into the layer's buffers, and MLAModel.commit_verify (device ops, after the replay) keeps the kept
drafts' state. The flow of tests/runtime/test_verify_commit.py (k = 4, rows keeping 2, 0, 4, 1,
runner-padded rows, 6 decode steps) equals feeding the kept tokens directly, in bf16 within the
harness's rounding tolerance, where leaving the rejected drafts in the state is far outside it."""

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


class Served:
    def __init__(self):
        model = MLAModel(TINY_512, 2048, max_requests=len(PROMPTS), dtype=torch.bfloat16, page_size=16, device=NPU,
                         seed=3)
        assert "linear" in TINY_512.layer_types
        self.model = dcp_compile.apply(model, 1, kernels="npu")
        self.table = RequestTable(len(PROMPTS), 64, 2048, 16)
        self.runner = None

    def eager(self, rows, tokens):
        batch = self.table.extend_batch(rows, tokens, pad_rows=1)
        return self.model(*batch.to(NPU).args(), host_metadata=batch.host)

    def replayed(self, rows, tokens, all_logits=False):
        if self.runner is None:
            self.runner = GraphRunner(self.model.compiled("gather-q"), buckets=(4, 8), debug=True,
                                      graphs=device_graphs(torch.device(NPU, 0)),
                                      host_slot=dcp_compile.state(self.model).host_slot)
        batch = self.table.extend_batch(rows, tokens, all_logits=all_logits)
        return self.runner(batch, tokens_per_row=len(tokens[0])), batch


def _worst(commit: bool) -> tuple[float, float]:
    """The largest decode logits difference from feeding the kept tokens directly, and the logits' scale."""
    rows = list(range(len(PROMPTS)))
    speculative, direct = Served(), Served()
    for served in (speculative, direct):
        served.eager(rows, PROMPTS)
    _, verify = speculative.replayed(rows, DRAFTS, all_logits=True)
    for row, count in enumerate(ACCEPTED):
        speculative.table.truncate(row, int(speculative.table.seq_lens[row]) - len(DRAFTS[row]) + count)
    if commit:
        speculative.model.model.commit_verify(verify.state_slots.to(NPU), torch.tensor(ACCEPTED, device=NPU))
    kept = [row for row in rows if ACCEPTED[row]]
    direct.eager(kept, [DRAFTS[row][:ACCEPTED[row]] for row in kept])
    worst, scale = 0.0, 0.0
    for step in range(DECODE_STEPS):
        tokens = [[(7 * step + row) % 50 + 1] for row in rows]
        logits = [served.replayed(rows, tokens)[0][: len(rows)].float().cpu() for served in (speculative, direct)]
        worst = max(worst, (logits[0] - logits[1]).abs().max().item())
        scale = max(scale, logits[1].abs().max().item())
    assert len(speculative.runner.captured) == 2  # the verify graph and the decode graph, each replayed
    return worst, scale


def test_verify_replayed_from_an_npu_graph_commits_only_the_accepted_drafts():
    worst, scale = _worst(commit=True)
    tolerance = half_precision_tolerance("bfloat16", TINY_512.num_mla_layers, scale)
    uncommitted, _ = _worst(commit=False)
    print(f"worst {worst:.4g}, tolerance {tolerance:.4g}, uncommitted {uncommitted:.4g}")
    assert worst < tolerance < uncommitted
