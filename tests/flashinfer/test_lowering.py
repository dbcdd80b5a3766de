"""The FlashInfer lowering on CPU, with FlashInfer's wrapper replaced at the call boundary by its
torch stand-in: what the pass emits, the plan arguments handed to the wrapper (CSR page lists
from the host block tables, lengths, causal flags, LSE base), numerics against the reference at
DCP 1 and over gloo ranks at DCP 2, graph replay planning, and the bad-input errors."""

from __future__ import annotations

import dataclasses
import logging
import math
from types import SimpleNamespace

import pytest
import torch

import dcp_compile
from dcp_compile.lowering import registry
from dcp_compile.debug import fake_capture
from dcp_compile.lowering import flashinfer
from dcp_compile.lowering.base import Unsupported
from dcp_compile.lowering.flashinfer import plans as fi_plans
from dcp_compile.testing.flashinfer_standin import MLAPlanMetadata, ReferenceMLAWrapper
from dcp_compile.ops import reference
from dcp_compile.models.config import preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.passes import PassManager
from dcp_compile.lowering.flashinfer.lower_attention import flashinfer_block_size
from dcp_compile.runtime.batch import RequestTable
from dcp_compile.runtime.graph_runner import GraphRunner
from dcp_compile.runtime.host_inputs import HostSlot
from dcp_compile.runtime.host_metadata import HostMetadata
from dcp_compile.harness.scenario import Scenario
from dcp_compile.ops import targets
from tests.npu.test_graphs import FakeGraphs

flashinfer.ensure_ops()
MLA_PAGED = torch.ops.dcp_flashinfer.mla_paged_attention.default
WINDOW = targets.WINDOW_ATTENTION
PAGE = 4


# --- The stand-in is FlashInfer's contract -------------------------------------------------------


def paged_case(lengths, queries, heads=3, rank_dim=16, rope_dim=8, seed=0):
    """Requests on random whole pages, their last q positions as queries, and host metadata."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-max(lengths) // PAGE) * PAGE
    pages_needed = sum(-(-n // PAGE) for n in lengths)
    pages = torch.randperm(pages_needed + 4, generator=gen)[:pages_needed] + 1
    table = torch.zeros(len(lengths), width, dtype=torch.int64)
    used, ids, positions = 0, [], []
    for b, (n, q) in enumerate(zip(lengths, queries)):
        count = -(-n // PAGE)
        cols = torch.arange(count * PAGE)
        table[b, : count * PAGE] = pages[used : used + count][cols // PAGE] * PAGE + cols % PAGE
        used += count
        ids += [b] * q
        positions += range(max(n - q, 0), max(n - q, 0) + q)
    cache = torch.randn((pages_needed + 5) * PAGE, rank_dim + rope_dim, generator=gen)
    q = torch.randn(len(ids), heads, rank_dim + rope_dim, generator=gen)
    case = SimpleNamespace(table=table, seq_lens=torch.tensor(lengths), ids=torch.tensor(ids), positions=torch.tensor(positions),
                           cache=cache, q_latent=q[..., :rank_dim], q_rope=q[..., rank_dim:], heads=heads)
    case.host = HostMetadata.from_tensors(table, case.seq_lens, case.ids, 1, 1, PAGE)
    return case


def run_plan(case, keys, causal):
    spec = fi_plans.PlanSpec(keys=keys, causal=causal, rows=len(case.seq_lens), tokens=len(case.ids), heads=case.heads,
                             rank_dim=case.q_latent.shape[-1], rope_dim=case.q_rope.shape[-1], block_size=PAGE,
                             blocks_per_row=case.host.block_tables.shape[2], sm_scale=0.3, dtype=torch.float32,
                             device=torch.device("cpu"))
    plan = fi_plans.FlashInferPlan(spec)
    plan.plan(case.host.for_rank(0))
    return plan, plan.run(case.q_latent, case.q_rope, case.cache)


@pytest.mark.parametrize("keys,causal", [("all", False), ("all", True), ("prefix", False)])
def test_plan_maps_host_metadata_onto_flashinfer_and_matches_the_reference(keys, causal):
    case = paged_case([0, 1, 9, 30, 5], [3, 1, 3, 3, 3])
    plan, (out, lse) = run_plan(case, keys, causal)
    args = plan.wrapper.plans[-1]
    csr = args["csr"]
    # The CSR page list is each row's used local blocks, in position order; lengths in tokens.
    kv_lens = case.host.local_seq_lens[0] if keys == "all" else case.host.local_prefix_lens[0]
    assert csr["kv_len_arr"].tolist() == list(kv_lens)
    blocks = [-(-n // PAGE) for n in kv_lens]
    assert csr["kv_indptr"].tolist() == [0] + list(torch.tensor(blocks).cumsum(0).tolist())
    table = case.host.block_tables[0]
    assert csr["kv_indices"].tolist() == [int(table[b, j]) for b in range(len(blocks)) for j in range(blocks[b])]
    assert csr["qo_indptr"].tolist() == [0, 3, 4, 7, 10, 13]
    assert (args["page_size"], args["causal"], args["lse_mode"], args["query_layout"]) == (PAGE, causal, "basee", "split")
    # Against the reference: every key (decode), causal by position, or the keys before the first query.
    first = reference.first_query_positions(case.ids, case.positions, len(case.seq_lens))[case.ids]
    query_positions = {("all", False): case.seq_lens[case.ids] - 1, ("all", True): case.positions,
                       ("prefix", False): first - 1}[(keys, causal)]
    want_out, want_lse = reference.partial_attention(case.q_latent, case.q_rope, case.cache, case.table, case.seq_lens,
                                                     reference.global_positions(case.table), case.ids, query_positions, 0.3)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse)  # natural log; -inf (and out 0) for the padded row
    assert torch.isneginf(lse[0]).all() and not out[0].any()


def test_a_plan_calls_flashinfer_again_only_when_its_metadata_changes():
    """plan() with the metadata of the last plan (another region's graph of the same step) makes
    no FlashInfer plan; new lengths, or a block table changed in place at the same lengths (a
    cache's rows given to another request), do."""
    case = paged_case([0, 1, 9, 30, 5], [3, 1, 3, 3, 3])
    plan, _ = run_plan(case, "all", False)
    plan.plan(case.host.for_rank(0))
    assert len(plan.wrapper.plans) == 1
    table = case.host.block_tables[0]
    table[3, 0] = table[3, 0] + 1000
    plan.plan(case.host.for_rank(0))
    assert len(plan.wrapper.plans) == 2 and plan.wrapper.plans[-1]["csr"]["kv_indices"].tolist().count(int(table[3, 0])) == 1
    longer = case.host.for_rank(0)
    longer = type(longer)(longer.query_lens, (0, 1, 9, 29, 5), longer.local_prefix_lens, longer.block_table)
    plan.plan(longer)
    assert len(plan.wrapper.plans) == 3 and plan.wrapper.plans[-1]["csr"]["kv_len_arr"].tolist() == [0, 1, 9, 29, 5]
    plan.plan(longer)
    assert len(plan.wrapper.plans) == 3 and plan.planned_for == plan.lengths(longer)


def test_standin_lse_is_base_2_unless_asked_for_base_e():
    case = paged_case([6, 7], [1, 1])
    plan, (_, lse_e) = run_plan(case, "all", False)
    plan.wrapper._plan["lse_mode"] = "base2"
    _, lse_2 = plan.wrapper.run(query=(case.q_latent, case.q_rope), kv_cache=(
        case.cache[:, :16].unflatten(0, (-1, PAGE)), case.cache[:, 16:].unflatten(0, (-1, PAGE))), return_lse=True)
    torch.testing.assert_close(lse_2 * math.log(2.0), lse_e)


def test_standin_refuses_what_flashinfer_refuses():
    wrapper = ReferenceMLAWrapper(torch.empty(1, dtype=torch.uint8))
    common = dict(num_heads=2, head_dim_ckv=16, head_dim_kpe=8, page_size=4, causal=False, sm_scale=1.0,
                  q_data_type=torch.float32, kv_data_type=torch.float32)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    with pytest.raises(ValueError, match="int32"):
        wrapper.plan(metadata=MLAPlanMetadata.csr(i32(0, 1), i32(0, 1), torch.tensor([3]), i32(4)), **common)
    with pytest.raises(ValueError, match="page counts"):
        wrapper.plan(metadata=MLAPlanMetadata.csr(i32(0, 1), i32(0, 1), i32(3), i32(5)), **common)
    with pytest.raises(ValueError, match="reserved"):
        ReferenceMLAWrapper(torch.empty(1, dtype=torch.uint8), use_cuda_graph=True)


# --- The pass ---------------------------------------------------------------------------------


def lowered(mode, dcp_size, **fields):
    spec = fake_capture.GraphSpec(model="tiny", kernels="flashinfer", mode=mode, dcp_size=dcp_size, page_size=PAGE * dcp_size,
                                  attention_strategy="gather-q", dtype="float32", **fields)
    captured = fake_capture.capture(spec)
    PassManager(captured.pass_config(), passes=captured.passes()).run(captured.gm)
    return captured.gm


def calls(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


@pytest.mark.parametrize("mode,dcp_size,keys,causal,windows", [
    ("decode", 1, "all", False, 0), ("verify", 1, "all", True, 0),
    ("decode", 2, "all", False, 0), ("verify", 2, "prefix", False, 3)])
def test_pass_emits_one_plan_per_graph_and_the_window_split_under_dcp(mode, dcp_size, keys, causal, windows):
    gm = lowered(mode, dcp_size)
    attention = calls(gm, MLA_PAGED)
    assert len(attention) == 3  # the tiny preset's MLA layers
    specs = gm.meta[fi_plans.PLAN_SPECS]
    plan_inputs = fi_plans.plan_placeholders(gm.graph)
    assert len(specs) == len(plan_inputs) == 1 and {n.args[3] for n in attention} == set(plan_inputs)  # one plan
    spec = specs[0]
    assert (spec.keys, spec.causal, spec.block_size) == (keys, causal, PAGE)
    assert len(calls(gm, WINDOW)) == windows
    assert not calls(gm, torch.ops.dcp.mla_partial_attention.default) and not calls(gm, torch.ops.dcp.mla_attention.default)


def test_a_site_past_the_plans_capacity_stays_for_the_general_kernels(monkeypatch):
    """fa3's plan takes at most MAX_WORK_ITEMS tiles of query rows x heads: a graph past it (here
    the capacity patched to 1) keeps its attention for the back end's general kernels instead
    of failing at the first plan; the bound is at least what FlashInfer counted on an H100
    (65536 items for 8 x 16k prefill tokens at 64 heads; 8192 for 1 x 16k)."""
    from dcp_compile.lowering.flashinfer import lower_attention

    assert lower_attention.work_items_bound(8 * 16384, 8, 64) >= 65536
    assert lower_attention.work_items_bound(16384, 1, 64) >= 8192
    assert lower_attention.work_items_bound(16384, 1, 64) <= lower_attention.MAX_WORK_ITEMS
    monkeypatch.setattr(lower_attention, "MAX_WORK_ITEMS", 1)
    gm = lowered("verify", 1)
    assert not calls(gm, MLA_PAGED) and len(calls(gm, torch.ops.dcp.mla_attention.default)) == 3
    assert not fi_plans.plan_placeholders(gm.graph)


def test_a_feed_keeps_recent_batch_sizes_and_every_captured_one(monkeypatch):
    """A graph symbolic in the batch shape makes a plan per batch size (each a wrapper and its
    buffers): its feed keeps the MAX_SIZED_PLANS most recently used, and every plan a device graph
    was captured with (its replays read that plan's buffers) for good."""
    from dcp_compile.runtime.host_metadata import RankHostMetadata

    monkeypatch.setattr(fi_plans, "MAX_SIZED_PLANS", 2)
    feed = fi_plans.FlashInferFeed(lowered("decode", 1), 0)

    def prepare(rows: int, capturing: bool = False) -> fi_plans.FlashInferPlan:
        monkeypatch.setattr(fi_plans.devices, "capturing", lambda device: capturing)
        feed.prepare(RankHostMetadata((1,) * rows, (3,) * rows, (2,) * rows, torch.zeros(rows, 4, dtype=torch.int32)))
        (plan,) = feed.plans
        assert plan.spec.rows == rows and plan.spec.tokens == rows and plan.spec.blocks_per_row == 4
        return plan

    captured = prepare(1, capturing=True)
    assert captured.planned_for is None  # a capture plans nothing: the runner plans before each replay
    first = prepare(2)
    assert prepare(2) is first  # the same size, the same plan (planned again)
    prepare(3)
    prepare(4)  # sizes 3 and 4 are the two most recent: size 2's plan is dropped
    assert prepare(2) is not first
    assert prepare(1) is captured and captured.planned_for == ((1,), (3,))


def test_block_size_must_map_pages_onto_local_blocks():
    assert flashinfer_block_size(8, 2, 1) == 4
    assert flashinfer_block_size(4, 2, 4) == 4
    with pytest.raises(ValueError, match="whole local blocks|local blocks"):
        flashinfer_block_size(6, 2, 2)


# --- Numerics at DCP 1, and planning around graph replay ----------------------------------------


def tiny_model(kernels, **config):
    model = MLAModel(preset("tiny"), 2048, max_requests=4, page_size=PAGE)
    return dcp_compile.apply(model, 1, kernels=kernels, **config)


def test_dcp1_prefill_decode_verify_match_the_reference_and_plan_every_step():
    lowered_model, reference_model = tiny_model("flashinfer", debug_checks=True), tiny_model("torch")
    tables = [RequestTable(4, 64, 2048, PAGE) for _ in range(2)]
    steps = [[[1] * 5, [2] * 19, [3]], [[4]] * 3, [[5] * 7] * 3, [[6]] * 3, [[7] * 16] * 3]
    for tokens in steps:
        outs = []
        for model, table in zip((lowered_model, reference_model), tables):
            batch = table.extend_batch([0, 1, 2], tokens, pad_rows=1, all_logits=True)
            outs.append(model(*batch.args(), host_metadata=batch.host))
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
        slot = dcp_compile.state(lowered_model).host_slot
        plan = slot.fed[0].plans[0]
        # This step's plan: its lengths, with the padded row's keys at 0.
        assert plan.planned_for[1] == tuple(int(n) for n in tables[0].seq_lens[:3]) + (0,)
        assert plan.wrapper.plans[-1]["causal"] == (len(tokens[0]) > 1)


def test_stale_lengths_are_caught_by_the_plan_check_in_debug_mode():
    model = tiny_model("flashinfer", debug_checks=True)
    table = RequestTable(4, 64, 2048, PAGE)
    prefill = table.extend_batch([0, 1], [[1] * 6, [2] * 3])
    model(*prefill.args(), host_metadata=prefill.host)
    stale = table.extend_batch([0, 1], [[1], [2]])
    table.truncate(0, 5)  # host metadata of another step, as after a rejected draft
    other = table.extend_batch([0, 1], [[1], [2]])
    with pytest.raises(ValueError, match="stale host metadata"):
        model(*stale.args(), host_metadata=other.host)


def test_runner_plans_before_every_replay_and_catches_a_skipped_plan(monkeypatch):
    model = tiny_model("flashinfer")
    table = RequestTable(4, 64, 2048, PAGE)
    prefill = table.extend_batch([0, 1, 2], [[1] * 5, [2] * 9, [3] * 2])
    model(*prefill.args(), host_metadata=prefill.host)
    state = dcp_compile.state(model)
    runner = GraphRunner(model.compiled("gather-q"), buckets=(4,), graphs=FakeGraphs(device="cpu"), host_slot=state.host_slot, debug=True)
    runner(table.extend_batch([0, 1, 2], [[1]] * 3))
    plan = runner.captured[(4, 1, 64)].feeds[0].plans[0]
    assert plan.planned_for == ((1, 1, 1, 1), (6, 10, 3, 0))
    runner(table.extend_batch([0, 1, 2], [[1]] * 3))
    assert plan.planned_for == ((1, 1, 1, 1), (7, 11, 4, 0))  # planned again for the replay
    monkeypatch.setattr(fi_plans.FlashInferPlan, "plan", lambda self, host: None)
    with pytest.raises(fi_plans.StalePlanError, match="another step"):
        runner(table.extend_batch([0, 1, 2], [[1]] * 3))


# --- DCP over gloo ranks ---------------------------------------------------------------------------

# Run by tests/conftest.py, in one spawn per TP size with the other modules' cases.
CASES = [
    # Decode with one-token requests (empty shards) and a padded row; pages of 8 = one local block of 4 a rank.
    Scenario(dcp_size=2, tp_size=2, batch=5, contexts=(1, 3, 30, 70, 17), steps=4, seed=21, kernels="flashinfer",
             page_size=8),
    # Verify k = 7 with scripted accept/reject (the prefix + window split), page-interleaved pages of 4.
    Scenario(mode="verify", draft_len=7, dcp_size=2, tp_size=2, batch=4, contexts=(1, 5, 40, 20), steps=3, seed=22,
             kernels="flashinfer", interleave=4, page_size=4),
]


INDUCTOR_AT_DCP2 = Scenario(mode="verify", draft_len=3, dcp_size=2, tp_size=2, batch=3, contexts=(1, 9, 30), steps=2,
                            seed=23, kernels="flashinfer", page_size=8, inner_compile="inductor", layers=1)
GLOO_SCENARIOS = CASES + [INDUCTOR_AT_DCP2]


@pytest.mark.parametrize("scenario", CASES, ids=lambda s: f"{s.mode}-I{s.interleave}-P{s.page_size}")
def test_dcp2_matches_dcp1(scenario, scenario_results):
    result = scenario_results[scenario]
    assert result["finite"] and result["outputs_match"] and result["tokens_match"]
    assert result["max_abs_diff"] < result["tolerance"]
    assert result["pass_summary"]["lower_flashinfer_attention"] > 0
    assert 0 < result["graphs_captured"] <= result["graph_keys"]  # static FlashInfer graphs: one per shape at most


# --- Selection and bad input ------------------------------------------------------------------------


# --- Under inductor -------------------------------------------------------------------------------
# The plan is a host-fed graph input (runtime.host_inputs), so any inner compiler runs the lowered
# graph: inductor compiles the rest of the model around dcp_flashinfer::mla_paged_attention.


def test_inductor_equals_eager_at_dcp1_and_plans_every_step():
    inductor, eager = tiny_model("flashinfer", inner_compile="inductor"), tiny_model("flashinfer")
    tables = [RequestTable(4, 64, 2048, PAGE) for _ in range(2)]
    steps = [[[1] * 5, [2] * 19, [3]], [[4]] * 3, [[5]] * 3, [[6] * 7] * 3]  # prefill, decode twice, verify
    for tokens in steps:
        outs = []
        for model, table in zip((inductor, eager), tables):
            batch = table.extend_batch([0, 1, 2], tokens, pad_rows=1)
            outs.append(model(*batch.args(), host_metadata=batch.host))
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
        plan = dcp_compile.state(inductor).host_slot.fed[0].plans[0]
        assert plan.planned_for[1] == tuple(int(n) for n in tables[0].seq_lens[:3]) + (0,)  # this step's lengths
    compiled = dcp_compile.state(inductor).backends["gather-q"].reports
    # The plans are sized by each step, so the graphs are symbolic in the batch shape: prefill and
    # verify share one graph, decode (a token a row) has its own, compiled once. (Static graphs,
    # one per batch shape, made 3.)
    assert len(compiled) == 2


def test_inductor_at_dcp2_over_gloo_matches_dcp1(scenario_results):
    result = scenario_results[INDUCTOR_AT_DCP2]
    assert result["finite"] and result["outputs_match"] and result["tokens_match"]
    assert result["max_abs_diff"] < result["tolerance"]
    assert result["pass_summary"]["lower_flashinfer_attention"] > 0


def test_auto_falls_back_to_triton_with_one_log_line(monkeypatch, caplog):
    pool = SimpleNamespace(device=torch.device("cuda"), kv_lora_rank=512, rope_dim=64, dtype=torch.bfloat16, page_size=16)
    config = dcp_compile.DCPConfig()
    monkeypatch.setattr(flashinfer, "unsupported_reason", lambda *a: "flashinfer cannot be imported (test)")
    with caplog.at_level(logging.INFO, logger="dcp_compile"):
        assert registry.resolve("auto", pool, config).name == "triton"
    assert [r.message for r in caplog.records if "kernels='auto'" in r.message] == [
        "kernels='auto': triton, not flashinfer: flashinfer cannot be imported (test)"]
    monkeypatch.setattr(flashinfer, "unsupported_reason", lambda *a: None)
    assert registry.resolve("auto", pool, config).name == "flashinfer"
    assert registry.resolve("auto", pool, dataclasses.replace(config, inner_compile="inductor")).name == "flashinfer"


def test_unsupported_setups_say_why():
    assert "CUDA" in flashinfer.unsupported_reason(torch.device("cpu"))
    if not torch.cuda.is_available():
        reason = flashinfer.unsupported_reason(torch.device("cuda"))
        assert "pip install 'dcp_compile[cuda]'" in reason or "Hopper" in reason


def test_a_graph_run_without_host_metadata_is_a_clear_error():
    gm = lowered("decode", 1)
    feed = fi_plans.FlashInferFeed(gm, 0)
    with pytest.raises(RuntimeError, match="host_metadata=batch.host"):
        HostSlot(0).feed(feed)
    with pytest.raises(RuntimeError, match="ran without its plan"):
        fi_plans.plan_of(torch.zeros(4, dtype=torch.int32))


def test_warm_up_builds_once_per_shape():
    assert fi_plans.warm_up(torch.device("cpu"), 16, 8, torch.float32, PAGE) > 0
    assert fi_plans.warm_up(torch.device("cpu"), 16, 8, torch.float32, PAGE) == 0.0


def test_a_flashinfer_without_the_mla_wrapper_is_named(monkeypatch):
    monkeypatch.setattr(flashinfer, "_module", lambda: SimpleNamespace())
    reason = flashinfer.unsupported_reason(torch.device("cuda"))
    assert "has no flashinfer.mla.BatchMLAPagedAttentionWrapper" in reason and ">= 0.7" in reason
    with pytest.raises(Unsupported, match="kernels='flashinfer': .*BatchMLAPagedAttentionWrapper"):
        registry.get("flashinfer").check(SimpleNamespace(device=torch.device("cuda"), kv_lora_rank=512, rope_dim=64,
                                                         dtype=torch.bfloat16, page_size=16), dcp_compile.DCPConfig())
