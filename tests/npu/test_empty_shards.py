"""FIA's output on an empty shard is not trusted (issue 18, defect 6): the NPU lowering masks the
tokens whose FIA call saw no key by the batch's device lengths (dcp_npu.prefix_key_counts), so a
kernel that returns garbage there changes nothing. Runs on the emulated npu device, with the
stand-in FIA made to return NaN and a finite LSE on empty requests (standin.PLANTS)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.fx as fx

import dcp_compile
from dcp_compile.harness.scenario import Scenario, compare
from dcp_compile.testing import npu_standin as standin
from dcp_compile.lowering.npu import ensure_ops, ops as npu_ops
from dcp_compile.lowering.npu.lower_attention import LowerNPUAttention, attention_update_op
from dcp_compile.ops import reference
from dcp_compile.models.mla import MLAModel
from dcp_compile.runtime import devices
from dcp_compile.runtime.batch import RequestTable
from tests.npu.models import TINY_512

os.environ.setdefault(devices.EMULATOR_ENV, "1")
devices.require_torch_npu("the NPU lowering's tests")

GARBAGE = "empty-shard-garbage"


@pytest.mark.parametrize("dcp_size, interleave", [(1, 1), (2, 1), (4, 1), (2, 16)])
def test_prefix_key_counts_are_the_lengths_fia_is_given(dcp_size, interleave):
    """The device count of keys each query's FIA call sees equals the host length FIA is handed:
    the local length (decode), the local keys before the row's first query (verify)."""
    table = RequestTable(5, 80, 4096, 16 * dcp_size, dcp_size, interleave)
    table.extend_batch([0, 1, 2, 3], [[1] * 1, [1] * 2, [1] * 37, [1] * 5])
    for tokens in ([[1]] * 4, [[1] * 3, [1] * 7, [1] * 1, [1] * 16]):
        batch = table.extend_batch([0, 1, 2, 3], tokens, pad_rows=1)
        decode = len(tokens[0]) == 1 and all(len(t) == 1 for t in tokens)
        for rank in range(dcp_size):
            _, lens, positions = reference.local_metadata(batch.req_to_token, batch.seq_lens, rank, dcp_size, interleave)
            counts = npu_ops.prefix_key_counts(lens, None if decode else positions, batch.q_seq_ids, batch.positions,
                                                 decode)
            host = batch.host.for_rank(rank)
            per_row = host.local_seq_lens if decode else host.local_prefix_lens
            assert counts.tolist() == [per_row[row] for row in batch.q_seq_ids.tolist()]


def _npu_model():
    model = MLAModel(TINY_512, 2048, max_requests=4, dtype=torch.bfloat16, page_size=16, device="npu")
    return dcp_compile.apply(model, 1, kernels="npu")


def test_garbage_from_fia_on_empty_requests_changes_no_logit(monkeypatch):
    """A padded row (no key) in decode, and a verify row whose every key is in the window (FIA's
    prefix empty): with FIA returning NaN and an lse of 30 there, the logits are bit for bit those
    of the faithful stand-in, and finite."""
    torch.manual_seed(0)
    clean, planted = _npu_model(), _npu_model()
    planted.load_state_dict(clean.state_dict())
    tables = [RequestTable(4, 64, 2048, 16) for _ in range(2)]
    steps = [
        [[5] * 9, [6] * 3],          # prefill: TND with 9 and 3 queries, prefixes empty
        [[7], [8]],                  # decode, with a padded row
        [[1, 2, 3], [4, 5, 6, 7]],   # verify
    ]
    for tokens in steps:
        outs = []
        for model, table, plant in ((clean, tables[0], None), (planted, tables[1], GARBAGE)):
            if plant:
                monkeypatch.setenv(standin.PLANT_ENV, plant)
            else:
                monkeypatch.delenv(standin.PLANT_ENV, raising=False)
            batch = table.extend_batch([0, 1], tokens, pad_rows=1, all_logits=len(tokens[0]) > 1)
            outs.append(model(*batch.to("npu").args(), host_metadata=batch.host).cpu())
        assert torch.isfinite(outs[0]).all()
        assert torch.equal(outs[0], outs[1])


def test_dcp_two_with_garbage_on_empty_shards_matches_dcp_size_one(monkeypatch):
    """Lengths 1 and 2 leave shards empty at DCP 2, and a padded row is empty on both."""
    monkeypatch.setenv(standin.PLANT_ENV, GARBAGE)
    result = compare(Scenario(mode="verify", draft_len=3, dcp_size=2, tp_size=2, batch=3, contexts=(1, 2, 40), steps=2,
                              kernels="npu", device="npu", block_size=16, seed=3, layers=TINY_512.num_layers))
    assert result["finite"] and result["tokens_match"]
    assert result["outputs_match"] and result["max_abs_diff"] < result["tolerance"]


def test_an_lse_of_plus_inf_from_a_shard_with_keys_is_not_taken_for_an_empty_shard():
    """Issue 36, item 7. npu_attention_update gives a +inf lse no weight (what an empty shard reports). The lowering
    makes it NaN where the shard had keys (a faulty FIA result), so the merge shows NaN for that
    token instead of dropping its keys; where the shard was empty it is -inf, as before."""
    ensure_ops()
    graph = fx.Graph()
    counts, out, lse = graph.placeholder("counts"), graph.placeholder("out"), graph.placeholder("lse")
    graph.output(LowerNPUAttention._zero_unseen(graph, counts, out, lse))
    mask = fx.GraphModule(torch.nn.Module(), graph)
    tokens, heads, dim = 3, 2, 16
    torch.manual_seed(0)
    outs = [torch.randn(tokens, heads, dim, device="npu") for _ in range(2)]
    lses = [torch.randn(tokens, heads, device="npu") for _ in range(2)]
    lses[0][0] = float("inf")   # token 0: rank 0 saw 3 keys, yet FIA says +inf
    lses[0][1] = float("inf")   # token 1: rank 0 saw no key (+inf, as CANN >= 8.5 reports)
    counts = [torch.tensor([3, 0, 2], device="npu"), torch.tensor([4, 1, 5], device="npu")]
    masked = [mask(c, o, l) for c, o, l in zip(counts, outs, lses)]
    assert torch.isnan(masked[0][1][0]).all() and (masked[0][1][1] == float("-inf")).all()
    merged, _ = attention_update_op()([l.reshape(-1) for _, l in masked], [o.reshape(-1, dim) for o, _ in masked], 0)
    merged = merged.view(tokens, heads, dim).cpu()
    assert torch.isnan(merged[0]).all()  # before: rank 1's keys alone, finite and wrong
    torch.testing.assert_close(merged[1], outs[1][1].cpu())  # the empty shard weighs nothing
    assert torch.isfinite(merged[2]).all()
