"""The NPU lowering on the emulated npu device and the stand-ins of FIA and npu_attention_update:
the FIA and merge nodes the passes emit, what the host feeds them per rank, numerics against the
torch reference (on the CPU), and the bug classes of DESIGN.md that the Ascend path meets (FIA's
+inf LSE on an empty shard, all-empty padded rows, an LSE base mix-up, stale host lengths after a
rejected draft)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import dcp_compile
from dcp_compile.backend import DCPBackend
from dcp_compile.cli.main import main as cli_main
from dcp_compile.debug import fake_capture
from dcp_compile.lowering.base import Unsupported
from dcp_compile.lowering.npu import ensure_ops
from dcp_compile.lowering.npu import ops as npu_ops
from dcp_compile.ops import reference
from dcp_compile.models.config import preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.passes import PassManager
from dcp_compile.lowering.npu.feed import FIAFeed
from dcp_compile.lowering.npu.lower_attention import fia_block_size, max_pieces, padded_heads
from dcp_compile.runtime.batch import RequestTable
from dcp_compile.runtime.host_inputs import HOST_INPUT, HostInput
from dcp_compile.harness.scenario import half_precision_tolerance
from tests.npu.models import TINY_512

ensure_ops()
FIA = torch.ops.npu.npu_fused_infer_attention_score.default
UPDATE = torch.ops.npu.npu_attention_update.default
CAUSAL_MASK = "dcp_npu::step_causal_mask"  # the masked verify's mask (native kernels)
NPU = "npu"


# --- The graph after the passes -------------------------------------------------------------


def lowered_graph(mode="decode", dcp_rank=0, **spec_fields):
    """tiny-512's graph (shapes only) after every pass, gather-q, as DCP rank `dcp_rank` lowers it."""
    spec = fake_capture.GraphSpec(model="tiny-512", kernels="npu", block_size=16, mode=mode,
                                  attention_strategy="gather-q", **spec_fields)
    captured = fake_capture.capture(spec)
    config = dataclasses.replace(captured.pass_config(), dcp_rank=dcp_rank)
    PassManager(config, passes=captured.passes()).run(captured.gm)
    return captured.gm, spec


def fia_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is FIA]


@pytest.mark.parametrize("mode, layout, host_lens", [("decode", "BSND", "local_len"), ("verify", "TND", "piece_prefix_len")])
def test_fia_node_arguments(mode, layout, host_lens):
    gm, spec = lowered_graph(mode, dcp_size=2, tp_size=2, batch=3, context=40, draft_len=7)
    nodes = fia_nodes(gm)
    assert len(nodes) == preset("tiny-512").num_mla_layers
    for node in nodes:
        kw = node.kwargs
        assert kw["num_heads"] == 8  # 4 TP-local heads x dcp_size 2
        assert kw["num_key_value_heads"] == 1 and kw["sparse_mode"] == 0 and kw["softmax_lse_flag"] is True
        assert kw["input_layout"] == layout and kw["block_size"] == 16
        table = kw["block_table"] if layout == "BSND" else kw["block_table"].args[0]  # TND: a row per piece
        assert table.meta[HOST_INPUT] == HostInput("block_table")
        rows = 3 if layout == "BSND" else max_pieces(node.args[0].meta["val"].shape[0], 3)
        assert [n.meta[HOST_INPUT] for n in kw["actual_seq_lengths_kv"]] == [HostInput(host_lens, b) for b in range(rows)]
        if layout == "TND":  # pieces of <= 16 queries of a row (native)
            assert [n.meta[HOST_INPUT].kind for n in kw["actual_seq_lengths"]] == ["piece_cumulative_query_len"] * rows
        assert node.args[1] is node.args[2]  # value is the latent cache itself
        key, key_rope = node.args[1].meta["val"], node.kwargs["key_rope"].meta["val"]
        assert key.shape[1:] == (16, 512) and key_rope.shape[1:] == (16, 64) and key.shape[0] == key_rope.shape[0]
    merges = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is UPDATE]
    assert len(merges) == len(nodes) and all(len(n.args[0]) == 2 and n.args[2] == 0 for n in merges)


def test_host_inputs_are_each_ranks_own_lengths_and_block_table():
    batch_rows, context = 3, 40
    table = RequestTable(batch_rows, context + 1, 4096, 32, dcp_size=2)
    table.extend_batch([0, 1, 2], [[1] * 1, [1] * 19, [1] * 40])
    batch = table.extend_batch([0, 1, 2], [[1]] * 3)
    for rank in range(2):
        gm, _ = lowered_graph("decode", dcp_rank=rank, dcp_size=2, tp_size=2, batch=batch_rows, context=context)
        feed = FIAFeed(gm, rank)
        fed = dict(zip(feed.inputs, feed.values(feed.rank_view(batch.host))))
        _, lens, _ = reference.local_metadata(batch.req_to_token, batch.seq_lens, rank, 2, 1)
        assert [fed[HostInput("local_len", b)] for b in range(batch_rows)] == lens.tolist()
        fed_table = fed[HostInput("block_table")]  # the feed's buffer on the graph's device: meta here
        assert fed_table.shape == batch.host.block_tables[rank].shape and fed_table.dtype == torch.int32
        assert torch.equal(batch.host.for_rank(rank).block_table, batch.host.block_tables[rank])
    assert batch.host.local_seq_lens[0] != batch.host.local_seq_lens[1]


def test_heads_are_padded_to_a_power_of_two_and_sliced_back():
    gm, _ = lowered_graph("decode", dcp_size=2, tp_size=2, batch=2, context=20, num_heads=12)
    node = fia_nodes(gm)[0]
    assert node.kwargs["num_heads"] == 16 and node.args[0].meta["val"].shape[2] == 16  # 6 x 2 heads, padded
    merged = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is UPDATE][0]
    assert merged.meta["val"][0].shape[0] == 2 * 6  # tokens x this rank's own 6 heads after the exchange


def test_fia_limits_are_checked_before_compiling():
    assert [padded_heads(h) for h in (1, 3, 6, 12, 64, 100, 128)] == [1, 4, 8, 16, 64, 128, 128]
    with pytest.raises(ValueError, match="at most 128 query heads"):
        padded_heads(256)
    with pytest.raises(ValueError, match="whole\\s+local blocks"):
        fia_block_size(12, 2, 4)
    with pytest.raises(ValueError, match="16 or 128"):
        fia_block_size(8, 2, 1)
    cfg = preset("tiny-512")
    on_npu = dict(page_size=16, device=NPU)
    with pytest.raises(ValueError, match="at most 128 query heads"):
        dcp_compile.apply(MLAModel(cfg.replace(num_heads=256), 64, dtype=torch.bfloat16, **on_npu), 1, kernels="npu")
    with pytest.raises(Unsupported, match="bf16 or fp16"):
        dcp_compile.apply(MLAModel(cfg, 64, **on_npu), 1, kernels="npu")
    with pytest.raises(ValueError, match="kv_lora_rank 512"):
        dcp_compile.apply(MLAModel(preset("tiny"), 64, dtype=torch.bfloat16, **on_npu), 1, kernels="npu")


def test_a_kv_pool_on_the_cpu_is_refused():
    """FIA and npu_attention_update have npu kernels only (as torch_npu's): a CPU pool is refused
    when the model is made, not at its first step."""
    with pytest.raises(Unsupported, match="kernels='npu': its kernels run on an npu device .* the KV pool is on cpu"):
        dcp_compile.apply(MLAModel(preset("tiny-512"), 64, dtype=torch.bfloat16, page_size=16), 1, kernels="npu")


def test_dump_shows_the_fia_and_merge_nodes(tmp_path):
    assert cli_main(["dump", "--kernels", "npu", "--mode", "verify", "--draft-len", "7", "--dcp-size", "2",
                     "--out", str(tmp_path)]) == 0
    after = next(tmp_path.glob("graph00/*lower_npu_attention.after.py")).read_text()
    assert "torch.ops.npu.npu_fused_infer_attention_score.default" in after and "input_layout = 'TND'" in after
    assert "torch.ops.npu.npu_attention_update.default" in after and "dcp_block_table" in after


# --- Numerics at dcp_size 1: the lowered graphs against the torch reference ------------------


class Pair:
    """The same tiny-512 bf16 model (the same weights) under the torch reference on the CPU and
    under the NPU lowering on the npu device (with the NPU back end's `options`)."""

    devices = ("cpu", NPU)

    def __init__(self, heads=8, debug_checks=False, capacity=2048, page_size=16, **options):
        cfg = TINY_512.replace(num_heads=heads)
        self.models = [
            dcp_compile.apply(MLAModel(cfg, capacity, max_requests=4, dtype=torch.bfloat16, page_size=page_size,
                                       device=device), 1, kernels=kernels, debug_checks=debug_checks,
                              **(options if kernels == "npu" else {}))
            for kernels, device in zip(("torch", "npu"), self.devices)
        ]
        self.tables = [RequestTable(4, 96, capacity, page_size) for _ in self.models]
        self.tolerance_scale = half_precision_tolerance("bfloat16", cfg.num_mla_layers, 1.0)

    def step(self, tokens, all_logits=False, pad_rows=1, bucket=False):
        outs = []
        for model, table, device in zip(self.models, self.tables, self.devices):
            batch = table.extend_batch(list(range(len(tokens))), tokens, pad_rows=pad_rows, all_logits=all_logits,
                                       bucket=bucket)
            outs.append(model(*batch.to(device).args(), host_metadata=batch.host))
        reference_out, npu_out = outs
        assert npu_out.device.type == NPU
        npu_out = npu_out.cpu()
        assert torch.isfinite(npu_out).all()
        assert (npu_out - reference_out).abs().max() <= self.tolerance_scale * reference_out.abs().max()
        return reference_out, npu_out

    def truncate(self, request, length):
        for table in self.tables:
            table.truncate(request, length)


def test_lowered_decode_verify_and_long_chunks_match_the_reference():
    pair = Pair(heads=6)  # 6 heads: FIA runs 8, two padded
    pair.step([[3] * 5, [4] * 20, [5]])  # prefill: a row of 20 tokens, more than FIA's 16
    for step in range(4):
        pair.step([[1 + step], [2], [3]])  # decode; request 1 crosses a block of 16
    for k in (16, 7, 1):
        pair.step([[1] * k, [2] * k, [3] * k], all_logits=True)  # verify
        pair.truncate(0, int(pair.tables[0].seq_lens[0]) - k + 1)  # reject drafts
    strategies = dcp_compile.state(pair.models[1]).strategy_counts  # native: FIA serves the 20-token row too
    assert strategies["gather-q"] == 8 and strategies.get("gather-kv", 0) == 0
    assert dcp_compile.state(pair.models[1]).pass_summary()["lower_npu_attention"] > 0


def test_one_graph_per_batch_shape_over_changing_lengths():
    """20 decode steps and verify accept/reject change every length; graphs stay one per shape."""
    pair = Pair()
    pair.step([[3] * 4, [4] * 9, [5] * 2])
    for step in range(20):
        pair.step([[1], [2], [3]])
    for accepted in (0, 3, 6):
        pair.step([[1] * 7, [2] * 7, [3] * 7], all_logits=True)
        for request in range(3):
            pair.truncate(request, int(pair.tables[0].seq_lens[request]) - 7 + 1 + accepted)
        pair.step([[1], [2], [3]])
    state = dcp_compile.state(pair.models[1])
    assert len(state.reports) == 3  # prefill, decode, verify
    assert sum(state.strategy_counts.values()) == 1 + 20 + 6


def test_masked_verify_serves_rows_of_unequal_query_counts_and_masks_rows_of_equal_ones(monkeypatch):
    """npu_verify='mask' serves every batch: a prefill or extend whose tokens divide evenly over
    rows of unequal query counts runs the split FIA, a verify batch of equal k the masked FIA, and
    one captured graph (a batch shape) serves both, each lowering made when a step first needs it."""
    captured = []  # the graphs dynamo hands a backend
    backend_call = DCPBackend.__call__
    monkeypatch.setattr(DCPBackend, "__call__",
                        lambda self, gm, inputs: captured.append(self) or backend_call(self, gm, inputs))
    pair = Pair(npu_verify="mask")
    every = dict(all_logits=True)  # the same logits rows for all: one captured graph per token count
    pair.step([[1, 2, 3], [4], [5, 6, 7]], **every)  # prefill: 3 + 1 + 3 and a padded row's 1, 8 over 4 rows
    pair.step([[1] * 2, [2] * 2, [3] * 2], bucket=True, **every)  # verify k = 2: 4 rows of 2, the same graph
    pair.step([[1] * 4, [2] * 4, [3] * 4], bucket=True, **every)  # verify k = 4: 4 rows of 4
    pair.step([[1] * 6, [2] * 5, [3] * 4], **every)  # extend: 6 + 5 + 4 + 1, 16 over 4 rows, the same graph
    reports = dcp_compile.state(pair.models[1]).reports
    masked = [any(r.name == "lower_npu_attention" and r.ops_after.get(CAUSAL_MASK) for r in report.records)
              for report in reports]
    assert masked == [False, True, True, False]
    assert captured.count(dcp_compile.state(pair.models[1]).backends["gather-q"]) == 2  # one per batch shape


# --- Regressions --------------------------------------------------------------------------


def test_stale_host_lengths_after_a_rejected_draft_are_caught_in_debug_mode():
    pair = Pair(debug_checks=True)
    pair.step([[3] * 4, [4] * 9])
    pair.step([[1] * 7, [2] * 7], all_logits=True)
    pair.truncate(0, 4 + 2)  # accept one draft
    model, table = pair.models[1], pair.tables[1]
    batch = table.extend_batch([0, 1], [[1], [2]]).to(NPU)
    host = batch.host
    assert host.local_seq_lens[0] == (7, 17)  # fresh: the rejected drafts are gone
    stale = type(host)(host.dcp_size, host.interleave, host.page_size, host.query_lens,
                       ((host.local_seq_lens[0][0] + 5, host.local_seq_lens[0][1]),), host.local_prefix_lens,
                       host.block_tables)
    with pytest.raises(ValueError, match="stale host metadata"):
        model(*batch.args(), host_metadata=stale)


def _queries(tokens, heads, seed=0):
    """Host tensors (the reference's inputs); the op gets npu copies."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, heads, 512, generator=gen).bfloat16(),
            torch.randn(tokens, heads, 64, generator=gen).bfloat16())


def test_fia_empty_shard_lse_is_made_minus_inf_before_any_merge():
    """FIA gives lse = +inf where a row has no key (docs/ascend.md §7.2); the project's merges treat
    only -inf as empty, so the lowering converts it at once. Unconverted, the window merge of a
    verify row whose prefix shard is empty is wrong."""
    table = RequestTable(2, 64, 1024, 32, dcp_size=2)
    table.extend_batch([0, 1], [[1] * 1, [1] * 30])
    batch = table.extend_batch([0, 1], [[1] * 3, [1] * 3])  # row 0: 1 key before its queries
    cache = torch.randn(512, 576).bfloat16()
    q, q_rope = _queries(6, 4)
    rank = 1  # location of row 0's only prefix key is on rank 0: rank 1's prefix shard is empty
    host = batch.host.for_rank(rank)
    assert host.local_prefix_lens[0] == 0
    rows, lens, positions = reference.local_metadata(batch.req_to_token, batch.seq_lens, rank, 2, 1)
    device_cache = cache.to(NPU)
    out, lse = FIA(q.to(NPU), device_cache[:, :512].view(-1, 16, 512), device_cache[:, :512].view(-1, 16, 512),
                   query_rope=q_rope.to(NPU), key_rope=device_cache[:, 512:].view(-1, 16, 64), num_heads=4, scale=0.1,
                   input_layout="TND", num_key_value_heads=1, block_table=host.block_table.to(NPU), block_size=16,
                   actual_seq_lengths=host.cumulative_query_lens, actual_seq_lengths_kv=list(host.local_prefix_lens),
                   sparse_mode=0, softmax_lse_flag=True)
    out, lse = out.cpu(), lse.cpu().view(6, 4)
    assert torch.isposinf(lse[:3]).all()
    expected = reference.partial_attention(q, q_rope, cache, rows, lens, positions, batch.q_seq_ids, batch.positions, 0.1)
    args = (q, q_rope, cache, rows, lens, positions, batch.q_seq_ids, batch.positions, 0.1, 16)
    converted = reference.window_attention(out, lse.masked_fill(lse == math.inf, -math.inf), *args)
    unconverted = reference.window_attention(out, lse, *args)
    assert torch.allclose(converted[1], expected[1], atol=1e-4, equal_nan=False)
    assert (converted[0].float() - expected[0].float()).abs().max() < 2e-2
    assert not torch.allclose(unconverted[1], expected[1], atol=1e-2, equal_nan=True)


def _packed(shards=2, tokens=3, heads=4, empty=()):
    gen = torch.Generator().manual_seed(1)
    out = torch.randn(tokens, shards * heads, 512, generator=gen).bfloat16()
    lse = torch.randn(tokens, shards * heads, generator=gen)
    for token, shard in empty:
        lse[token, shard * heads : (shard + 1) * heads] = -math.inf
    packed = reference.pack_partials(out, lse, shards)
    return packed, reference.merge_partials(packed, 512)


def _attention_update(outs, lses):
    """npu_attention_update on npu copies of host tensors; its merged output back on the host."""
    return UPDATE([lse.to(NPU) for lse in lses], [out.to(NPU) for out in outs], 0)[0].cpu()


def test_padded_row_empty_on_every_shard_merges_to_zero_not_nan():
    packed, expected = _packed(empty=[(0, 0), (0, 1), (1, 1)])  # token 0 sees no key anywhere
    outs, lses = npu_ops.split_partials(packed, 512)
    merged = _attention_update(outs, lses).view(3, 4, 512)
    assert torch.isfinite(merged).all() and (merged[0] == 0).all()
    assert torch.allclose(merged.float(), expected.float(), atol=1e-2)
    raw_outs, raw_lses = reference.unpack_partials(packed, 512)
    unguarded = _attention_update(raw_outs.reshape(2, 12, 512), raw_lses.reshape(2, 12))
    assert torch.isnan(unguarded[:4]).all()  # what the guard prevents


def test_a_base_2_lse_breaks_the_merge():
    packed, expected = _packed()
    outs, lses = npu_ops.split_partials(packed, 512)
    assert torch.allclose(_attention_update(outs, lses).view(3, 4, 512).float(), expected.float(), atol=1e-2)
    base_2 = _attention_update(outs, lses / math.log(2)).view(3, 4, 512)
    assert (base_2.float() - expected.float()).abs().max() > 0.05
