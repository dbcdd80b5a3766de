"""A verify step commits only its accepted tokens to the recurrent state.

The tiny preset's linear-attention layer runs a verify step's k drafts through its recurrent
state. After the step, MLAModel.commit_verify(state_slots, accepted) keeps the state after each
row's accepted drafts and RequestTable.truncate keeps their KV; the decode steps that follow equal
those of a model fed the accepted tokens directly. Rows accept 2, 0, 4 and 1 of k = 4 drafts over
prompts of mixed lengths, with a padded row (slot 0), in fp32 to 1e-5. Without the commit the
rejected drafts stay in the state and the decoded logits differ (the control)."""

from __future__ import annotations

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
    return MLAModel(preset("tiny"), kv_capacity=256, max_requests=len(PROMPTS), par=par, seed=3)


def _table() -> RequestTable:
    return RequestTable(len(PROMPTS), 64, 256)


def verify_then_decode(make_model, dcp_size: int, commit: bool = True) -> float:
    """The largest logits difference over DECODE_STEPS decode steps between a model that verified
    DRAFTS and kept ACCEPTED of them, and one fed the accepted tokens directly."""
    rows = list(range(len(PROMPTS)))
    speculative, direct = dcp_compile.apply(make_model(), dcp_size), dcp_compile.apply(make_model(), dcp_size)
    spec_table, direct_table = _table(), _table()
    for model, table in ((speculative, spec_table), (direct, direct_table)):
        model(*table.extend_batch(rows, PROMPTS, pad_rows=1).args())

    verify = spec_table.extend_batch(rows, DRAFTS, pad_rows=1, all_logits=True)
    speculative(*verify.args())
    for row, count in enumerate(ACCEPTED):
        spec_table.truncate(row, int(spec_table.seq_lens[row]) - len(DRAFTS[row]) + count)
    if commit:
        speculative.model.commit_verify(verify.state_slots, torch.tensor(ACCEPTED + [0]))
    kept = [row for row in rows if ACCEPTED[row]]
    direct(*direct_table.extend_batch(kept, [DRAFTS[row][:ACCEPTED[row]] for row in kept], pad_rows=1).args())

    worst = 0.0
    for step in range(DECODE_STEPS):
        tokens = [[(7 * step + row) % 50 + 1] for row in rows]
        logits = [model(*table.extend_batch(rows, tokens, pad_rows=1).args())[: len(rows)]
                  for model, table in ((speculative, spec_table), (direct, direct_table))]
        worst = max(worst, (logits[0] - logits[1]).abs().max().item())
    return worst


def test_verify_commits_only_the_accepted_drafts_at_dcp_size_one():
    assert verify_then_decode(_model, 1) < 1e-5


def test_without_the_commit_the_rejected_drafts_stay_in_the_state():
    assert verify_then_decode(_model, 1, commit=False) > 1e-2


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
