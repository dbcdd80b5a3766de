"""The Ascend A5 options of the NPU lowering (issue 16): the NZ KV cache, FIA v2 and the masked
verify, on the emulated npu device, in one process (dcp_size 1; DCP 2 and 4 are in
tests/distributed/test_npu_a5_options.py).

- The NZ layout holds channel d of row s of block b at [b, 0, d // 16, s, d % 16] (docs/ascend.md
  §11.4): known rows written through each KV writer are read back element by element by that
  rule, computed here on its own.
- Every option combination equals the default (nd, v1, split) in bf16, step by step, over a
  prefill that crosses FIA blocks, decode and verify with a padded row.
- A planted off-by-one in the stand-in FIA's NZ read makes that comparison fail.
- Bad input is refused at apply, or at the step that cannot be served.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

import dcp_compile
from dcp_compile.lowering import triton as triton_kernels
from dcp_compile.lowering.base import Unsupported
from dcp_compile.lowering.npu import lower_attention
from dcp_compile.lowering.npu.options import NPUOptions
from dcp_compile.testing import npu_standin as standin
from dcp_compile.ops import reference
from dcp_compile.models.config import preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.ops import nz
from dcp_compile.runtime import devices
from dcp_compile.runtime.batch import RequestTable
from tests.npu.models import TINY_512

os.environ.setdefault(devices.EMULATOR_ENV, "1")
devices.require_torch_npu("the NPU lowering's tests")

BLOCK = 128
# prefill (one request crossing a block), decode, verify k = 3 and 16 (equal rows: the masked verify serves them)
STEPS = [[[5] * 9, [6] * 140, [7]], [[1], [2], [3]], [[1, 2, 3], [4, 5, 6], [7, 8, 9]],
         [list(range(16)), list(range(16, 32)), list(range(32, 48))]]
ALL = [dict(npu_kv_format=f, fia_version=v, npu_verify=m) for f, v, m in itertools.product(("nd", "nz"), (1, 2),
                                                                                            ("split", "mask"))]
COMBOS = [ALL[7]]
"""nz, v2, mask: every option away from its default (the combinations run at DCP 2 in
tests/distributed/test_npu_a5_options.py; here, at dcp_size 1, a row crosses NZ blocks)."""


def combo_id(combo: dict) -> str:
    return f"{combo['npu_kv_format']}-v{combo['fia_version']}-{combo['npu_verify']}"


def _run(steps=STEPS, **options):
    model = MLAModel(TINY_512, 4096, max_requests=4, dtype=torch.bfloat16, page_size=BLOCK, device="npu",
                     seed=3)
    dcp = dcp_compile.apply(model, 1, kernels="npu", **options)
    table = RequestTable(4, 512, 4096, BLOCK)
    logits = []
    for tokens in steps:
        batch = table.extend_batch([0, 1, 2], tokens, pad_rows=1, all_logits=len(tokens[0]) > 1)
        logits.append(dcp(*batch.to("npu").args(), host_metadata=batch.host).cpu().float())
    return logits, model.kv_pool, dcp


@pytest.fixture(scope="module")
def default_run():
    return _run()


@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_each_combination_equals_the_default(combo, default_run):
    want, want_pool, _ = default_run
    standin.contiguous_copies.clear()
    got, pool, dcp = _run(**combo)
    assert standin.contiguous_copies == []  # FIA got contiguous NZ parts: no whole-shard copy (ASCEND defect 3)
    assert pool.layout.name == ("nz" if combo["npu_kv_format"] == "nz" else "split")
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.isfinite(a).all()
        # Same FIA arithmetic on the same keys: equal up to the order of bf16 sums (the masked
        # verify sums every key in one call, the split one in two merged parts).
        assert (a - b).abs().max() <= 0.02 * b.abs().max(), f"step {step}"
        assert torch.equal(a.argmax(-1), b.argmax(-1)), f"step {step}"
    for layer in range(pool.num_layers):  # the same rows hold the same KV in either layout
        assert torch.equal(pool.rows(layer).cpu().any(dim=1), want_pool.rows(layer).cpu().any(dim=1))
    assert torch.equal(pool.rows(0).cpu(), want_pool.rows(0).cpu())  # layer 0: from the embeddings alone
    summary = dcp_compile.state(dcp).pass_summary()
    assert summary["lower_npu_attention"] > 0


def _nz_element(cache: torch.Tensor, row: int, channel: int) -> torch.Tensor:
    """The documented NZ mapping, on its own: row s of block b, channel d -> [b, 0, d // 16, s, d % 16]."""
    return cache[row // BLOCK, 0, channel // 16, row % BLOCK, channel % 16]


@pytest.mark.parametrize("writer", ["reference", "triton"])
def test_nz_round_trip_element_by_element(writer):
    rows, rank_dim, rope_dim = 3 * BLOCK, 512, 64
    latent_cache = torch.zeros(nz.shape(rows, rank_dim, BLOCK), dtype=torch.bfloat16, device="npu")
    rope_cache = torch.zeros(nz.shape(rows, rope_dim, BLOCK), dtype=torch.bfloat16, device="npu")
    locations = torch.tensor([1, 2, 127, 128, 129, 255, 256, 2 * 383 + 1], device="npu")  # rank 1 of 2 owns the odd ones
    tokens = locations.numel()
    latent = torch.arange(tokens * rank_dim, dtype=torch.float32).reshape(tokens, rank_dim).to(torch.bfloat16)
    rope = -torch.arange(tokens * rope_dim, dtype=torch.float32).reshape(tokens, rope_dim).to(torch.bfloat16) - 1
    write = reference.kv_write if writer == "reference" else triton_kernels.kv_write
    write(latent_cache, latent.to("npu"), rope.to("npu"), locations, 1, 2, 1, rope_cache)
    latent_cache, rope_cache = latent_cache.cpu(), rope_cache.cpu()
    written = 0
    for token, loc in enumerate(locations.tolist()):
        if loc % 2 == 0:
            continue
        row = loc // 2
        for channel in range(rank_dim):
            assert _nz_element(latent_cache, row, channel) == latent[token, channel]
        for channel in range(rope_dim):
            assert _nz_element(rope_cache, row, channel) == rope[token, channel]
        written += 1
    assert written == 5
    assert int((latent_cache != 0).sum()) == written * rank_dim - 1  # latent[0, 0] is 0; nothing else written
    assert torch.equal(nz.to_rows(latent_cache)[[0, 1, 63, 64, 127, 191]].any(dim=1),
                       torch.tensor([True, False, True, True, True, False]))  # rows 0 (token 0's loc 1), 63, 64, 127


def test_a_planted_nz_off_by_one_fails_the_comparison(default_run, monkeypatch):
    want = default_run[0]
    monkeypatch.setenv(standin.PLANT_ENV, "nz-off-by-one")
    # The prefill (its 140-token row through gather-kv) and the decode step, FIA's first read of
    # the NZ cache; the verify steps would add time, not a read the plant has not already spoiled.
    got = _run(steps=STEPS[:2], **ALL[4])[0]  # nz, v1, split
    assert len(got) == 2 and any((a - b).abs().max() > 0.02 * b.abs().max() for a, b in zip(got, want))


def test_an_npu_graph_updates_fia_v2_by_its_own_names():
    """The emulated NPUGraph rewrites a recorded v2 call's lengths under v2's names, and refuses v1's
    (torch_npu's npugraph handlers: docs/ascend.md §9.3)."""
    from dcp_compile.lowering.npu import ensure_ops

    ensure_ops()
    torch.manual_seed(0)
    heads, blocks = 16, 4
    latent = nz.from_rows(torch.randn(blocks * BLOCK, 512, dtype=torch.bfloat16), BLOCK).to("npu")
    rope = nz.from_rows(torch.randn(blocks * BLOCK, 64, dtype=torch.bfloat16), BLOCK).to("npu")
    query = torch.randn(2, 1, heads, 512, dtype=torch.bfloat16).to("npu")
    query_rope = torch.randn(2, 1, heads, 64, dtype=torch.bfloat16).to("npu")
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32).to("npu")

    def run(lengths):
        return torch.ops.npu.npu_fused_infer_attention_score_v2(
            query, latent, latent, query_rope=query_rope, key_rope=rope, input_layout="BSND_NBSD",
            actual_seq_kvlen=list(lengths), num_query_heads=heads, softmax_scale=0.1, num_key_value_heads=1,
            block_table=table, block_size=BLOCK, return_softmax_lse=True)[0]

    out = torch.empty_like(run([3, 200]))
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph, auto_dispatch_capture=True):
        out.copy_(run([3, 200]))
    with pytest.raises(ValueError, match="takes no update of 'actual_seq_lengths_kv'"):
        graph.update(cpu_update_input=[{"actual_seq_lengths_kv": [150, 0]}])
    graph.update(cpu_update_input=[{"actual_seq_kvlen": [150, 0]}])
    graph.replay()
    torch.npu.synchronize()
    assert torch.equal(out.cpu(), run([150, 0]).cpu()) and not torch.equal(out.cpu(), run([3, 200]).cpu())


def test_nz_needs_blocks_of_128():
    model = MLAModel(TINY_512, 2048, max_requests=2, dtype=torch.bfloat16, page_size=16, device="npu")
    with pytest.raises(ValueError, match="npu_kv_format='nz' needs FIA blocks of 128"):
        dcp_compile.apply(model, 1, kernels="npu", npu_kv_format="nz")


def test_fia_v2_without_it_in_torch_npu_is_refused(monkeypatch):
    monkeypatch.setattr(lower_attention, "has_fia_v2", lambda: False)
    from dcp_compile.lowering.npu import lowering

    monkeypatch.setattr(lowering, "has_fia_v2", lambda: False)
    model = MLAModel(TINY_512, 2048, max_requests=2, dtype=torch.bfloat16, page_size=BLOCK, device="npu")
    with pytest.raises(Unsupported, match="fia_version=2 needs torch_npu's npu_fused_infer_attention_score_v2"):
        dcp_compile.apply(model, 1, kernels="npu", fia_version=2)


def test_npu_options_on_another_back_end_are_refused():
    model = MLAModel(preset("tiny"), 256, max_requests=2)
    with pytest.raises(ValueError, match="npu_kv_format='nz' is an option of kernels='npu'"):
        dcp_compile.apply(model, 1, kernels="torch", npu_kv_format="nz")


@pytest.mark.parametrize("fields, message", [
    (dict(npu_kv_format="NZ"), "npu_kv_format must be one of"),
    (dict(fia_version=3), "fia_version must be one of"),
    (dict(fia_version=True), "fia_version must be one of"),
    (dict(npu_verify="masked"), "npu_verify must be one of"),
])
def test_bad_option_values(fields, message):
    with pytest.raises(ValueError, match=message):
        NPUOptions(**fields)
    model = MLAModel(TINY_512, 4096, max_requests=4, dtype=torch.bfloat16, page_size=BLOCK, device="npu")
    with pytest.raises(ValueError, match=message):
        dcp_compile.apply(model, 1, kernels="npu", **fields)
