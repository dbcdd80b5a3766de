"""A verify step commits only its accepted tokens to the recurrent state.

The tiny preset's linear-attention layer runs a verify step's k drafts through its recurrent
state. After the step, MLAModel.commit_verify(state_slots, accepted) keeps the state after each
row's accepted drafts and RequestTable.truncate keeps their KV; the decode steps that follow equal
those of requests fed the accepted tokens directly. Rows accept 2, 0, 4 and 1 of k = 4 drafts over
prompts of mixed lengths, with a padded row (slot 0), in fp32 to 1e-5. Requests that verify
without the commit keep the rejected drafts in their state, and their logits differ (the control)."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import dcp_compile
from dcp_compile.models.config import preset
from dcp_compile.models.linear_attention import StepRecord, commit_linear_attention, linear_attention
from dcp_compile.models.mla import MLAModel
from dcp_compile.runtime.batch import RequestTable
from dcp_compile.runtime.parallel import ParallelState

PROMPTS = [[3, 14, 15, 9, 26], [5], [35, 8, 9, 7, 9, 3, 2, 38, 4], [6, 26]]
DRAFTS = [[11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34], [41, 42, 43, 44]]
ACCEPTED = [2, 0, 4, 1]
DECODE_STEPS = 6


def _model(par: ParallelState | None = None) -> MLAModel:
    return MLAModel(preset("tiny"), kv_capacity=256, max_requests=3 * len(PROMPTS), par=par, seed=3)


def verify_then_decode(make_model, dcp_size: int) -> tuple[float, float]:
    """The largest logits difference over DECODE_STEPS decode steps from requests fed the kept
    drafts directly: of requests that verified DRAFTS, kept ACCEPTED of them and committed that,
    and of requests that did the same without the commit. The three groups of len(PROMPTS)
    requests share one model and one batch per step (one compile per step shape)."""
    n = len(PROMPTS)
    committed, direct, uncommitted = list(range(n)), list(range(n, 2 * n)), list(range(2 * n, 3 * n))
    everyone = committed + direct + uncommitted
    model = dcp_compile.apply(make_model(), dcp_size)
    table = RequestTable(3 * n, 64, 256)
    model(*table.extend_batch(everyone, PROMPTS * 3, pad_rows=1).args())

    verifying = committed + uncommitted
    verify = table.extend_batch(verifying, DRAFTS * 2, pad_rows=1, all_logits=True)
    model(*verify.args())
    for request in verifying:
        table.truncate(request, int(table.seq_lens[request]) - len(DRAFTS[request % n]) + ACCEPTED[request % n])
    padded_row = len(verifying)
    model.model.commit_verify(torch.cat([verify.state_slots[:n], verify.state_slots[padded_row:]]),
                              torch.tensor(ACCEPTED + [0]))
    kept = [request for request in direct if ACCEPTED[request % n]]
    model(*table.extend_batch(kept, [DRAFTS[request % n][:ACCEPTED[request % n]] for request in kept],
                              pad_rows=1).args())

    worst = [0.0, 0.0]
    for step in range(DECODE_STEPS):
        tokens = [[(7 * step + request % n) % 50 + 1] for request in everyone]
        logits = model(*table.extend_batch(everyone, tokens, pad_rows=1).args())
        for group, rows in enumerate((committed, uncommitted)):
            worst[group] = max(worst[group], (logits[rows] - logits[direct]).abs().max().item())
    return worst[0], worst[1]


def replayed_verify_then_decode(model, table: RequestTable, runner, device) -> tuple[float, float, float]:
    """verify_then_decode's flow with the verify and decode steps replayed by `runner` (a
    GraphRunner over `model`, whose table is `table`, padding to its bucket) and the prefill and
    the direct requests' chunk run eagerly on `device`; also the decoded logits' scale."""
    n = len(PROMPTS)
    committed, direct, uncommitted = list(range(n)), list(range(n, 2 * n)), list(range(2 * n, 3 * n))
    everyone = committed + direct + uncommitted

    def eager(requests, tokens):
        batch = table.extend_batch(requests, tokens, pad_rows=1)
        model(*batch.to(device).args(), host_metadata=batch.host)

    eager(everyone, PROMPTS * 3)
    verifying = committed + uncommitted
    verify = table.extend_batch(verifying, DRAFTS * 2, all_logits=True)
    runner(verify, tokens_per_row=len(DRAFTS[0]))
    for request in verifying:
        table.truncate(request, int(table.seq_lens[request]) - len(DRAFTS[request % n]) + ACCEPTED[request % n])
    model.model.commit_verify(verify.state_slots[:n].to(device), torch.tensor(ACCEPTED, device=device))
    kept = [request for request in direct if ACCEPTED[request % n]]
    eager(kept, [DRAFTS[request % n][:ACCEPTED[request % n]] for request in kept])

    worst, scale = [0.0, 0.0], 0.0
    for step in range(DECODE_STEPS):
        tokens = [[(7 * step + request % n) % 50 + 1] for request in everyone]
        logits = runner(table.extend_batch(everyone, tokens)).float().cpu()
        scale = max(scale, logits[direct].abs().max().item())
        for group, rows in enumerate((committed, uncommitted)):
            worst[group] = max(worst[group], (logits[rows] - logits[direct]).abs().max().item())
    return worst[0], worst[1], scale


def test_verify_commits_only_the_accepted_drafts_at_dcp_size_one():
    committed, uncommitted = verify_then_decode(_model, 1)
    assert committed < 1e-5
    assert uncommitted > 1e-2  # the rejected drafts left in the state: the test sees them


def test_the_commit_replays_the_steps_own_arithmetic():
    """Each accepted count gives exactly the state the step reached after that many tokens."""
    torch.manual_seed(0)
    heads, dim, k = 2, 4, 5
    record = StepRecord(3, heads, dim, "cpu")
    state = torch.randn(3, heads, dim, dim)
    q, key, value = (torch.randn(k + 1, heads, dim) for _ in range(3))
    q_seq_ids, slots, positions = torch.tensor([0] * k + [1]), torch.tensor([2, 0]), torch.tensor([7, 8, 9, 10, 11, 0])
    before = state.clone()
    per_token = []
    for count in range(k + 1):
        prefix = state.clone() if count == 0 else before.clone()
        if count:
            linear_attention(q[:count], key[:count], value[:count], prefix, q_seq_ids[:count], slots[:1],
                             positions[:count], 0.9, *(torch.zeros_like(t) for t in vars(record).values()))
        per_token.append(prefix[2].clone())
    linear_attention(q, key, value, state, q_seq_ids, slots, positions, 0.9, *vars(record).values())
    for count in range(k + 1):
        committed = state.clone()
        commit_linear_attention(committed, *vars(record).values(), slots, torch.tensor([count, 0]))
        assert torch.equal(committed[2], per_token[count])
        assert torch.equal(committed[1], before[1])
    opcheck(commit_linear_attention, (state.clone(), *vars(record).values(), slots, torch.tensor([3, 0])))
    opcheck(linear_attention, (q, key, value, state.clone(), q_seq_ids, slots, positions, 0.9,
                               *(t.clone() for t in vars(record).values())))


def test_commit_verify_refuses_counts_that_are_not_one_int64_count_a_row():
    model = _model()
    with pytest.raises(ValueError, match="two vectors of one length"):
        model.commit_verify(torch.tensor([1, 2]), torch.tensor([1]))
    with pytest.raises(ValueError, match="int64"):
        model.commit_verify(torch.tensor([1]), torch.tensor([1], dtype=torch.int32))
