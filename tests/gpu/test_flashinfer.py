"""FlashInfer's MLA kernel (fa3) on a Hopper GPU: the plan's mapping against the torch reference,
and the FlashInfer lowering end to end (DCP = 2 against DCP = 1 over NCCL, CUDA-graph replay,
a stale plan caught in debug mode). Skipped where FlashInfer does not serve the GPU."""

from __future__ import annotations


import pytest
import torch

import dcp_compile
from dcp_compile.lowering import flashinfer
from dcp_compile.lowering.flashinfer import plans
from dcp_compile.ops import reference
from dcp_compile.models.config import preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.runtime.batch import RequestTable
from dcp_compile.runtime.graph_runner import GraphRunner
from dcp_compile.runtime.host_metadata import HostMetadata
from dcp_compile.harness.scenario import Scenario, compare

REASON = flashinfer.unsupported_reason(torch.device("cuda")) if torch.cuda.is_available() else "needs a CUDA GPU"
served = pytest.mark.skipif(REASON is not None, reason=str(REASON))
two_gpus = pytest.mark.skipif(REASON is not None or torch.cuda.device_count() < 2, reason="needs 2 Hopper GPUs with FlashInfer")
R, P = 512, 64
MLA_512 = preset("tiny-512").replace(layer_types=("mla",) * 3)


def paged_inputs(lengths, queries, page_size, heads, seed, dtype=torch.bfloat16):
    """Requests on random whole pages of a pool, their last q positions as queries (CPU)."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-max(max(lengths), 1) // page_size) * page_size
    pages_needed = sum(-(-n // page_size) for n in lengths)
    pages = torch.randperm(pages_needed + 8, generator=gen)[:pages_needed] + 1  # page 0 holds location 0
    req_to_token = torch.zeros(len(lengths), width, dtype=torch.int32)
    used = 0
    ids, positions = [], []
    for b, (n, q) in enumerate(zip(lengths, queries)):
        count = -(-n // page_size)
        own = pages[used : used + count]
        used += count
        cols = torch.arange(count * page_size)
        req_to_token[b, : count * page_size] = (own[cols // page_size] * page_size + cols % page_size).to(torch.int32)
        ids += [b] * q
        positions += list(range(max(n - q, 0), max(n - q, 0) + q))
    capacity = (pages_needed + 9) * page_size
    cache = (torch.randn(capacity, R + P, generator=gen) * 0.5).to(dtype)
    tokens = len(ids)
    q = torch.randn(tokens, heads, R + P, generator=gen).to(dtype)
    return dict(req_to_token=req_to_token, seq_lens=torch.tensor(lengths, dtype=torch.int32),
                q_seq_ids=torch.tensor(ids), q_positions=torch.tensor(positions), cache=cache,
                q_latent=q[..., :R], q_rope=q[..., R:])


@served
@pytest.mark.parametrize("keys,causal,queries", [("all", False, 1), ("all", True, 7), ("prefix", False, 16)])
@pytest.mark.parametrize("heads", [16, 64])
def test_plan_and_run_match_the_reference(keys, causal, queries, heads):
    from dcp_compile.lowering.flashinfer.plans import FlashInferPlan, PlanSpec

    lengths = [0, 1, 40, 300, 17, 2000]  # a padded row, a row shorter than its queries
    q_per_row = [min(queries, max(n, 1)) if n else queries for n in lengths]
    page = 16
    inputs = paged_inputs(lengths, q_per_row, page, heads, seed=heads + queries)
    host = HostMetadata.from_tensors(inputs["req_to_token"], inputs["seq_lens"], inputs["q_seq_ids"], 1, 1, page)
    scale = 0.07
    spec = PlanSpec(keys=keys, causal=causal, rows=len(lengths), tokens=len(inputs["q_seq_ids"]), heads=heads, rank_dim=R,
                    rope_dim=P, block_size=page, blocks_per_row=host.block_tables.shape[2], sm_scale=scale,
                    dtype=torch.bfloat16, device=torch.device("cuda"))
    plan = FlashInferPlan(spec)
    plan.plan(host.for_rank(0))
    cuda = {k: v.cuda() for k, v in inputs.items()}
    out, lse = plan.run(cuda["q_latent"], cuda["q_rope"], cuda["cache"])
    torch.cuda.synchronize()
    # The reference: all keys (decode), causal by position, or the keys before the first query.
    positions = reference.global_positions(inputs["req_to_token"])
    first = reference.first_query_positions(inputs["q_seq_ids"], inputs["q_positions"], len(lengths))
    query_positions = inputs["q_positions"] if keys == "all" else first[inputs["q_seq_ids"]] - 1
    if keys == "all" and not causal:
        query_positions = inputs["seq_lens"][inputs["q_seq_ids"]].long() - 1
    want_out, want_lse = reference.partial_attention(
        inputs["q_latent"].float(), inputs["q_rope"].float(), inputs["cache"].float(), inputs["req_to_token"],
        inputs["seq_lens"], positions, inputs["q_seq_ids"], query_positions, scale)
    out, lse = out.float().cpu(), lse.cpu()
    empty = torch.isneginf(want_lse)
    print(f"{keys} causal={causal} heads={heads}: max |out diff| {(out - want_out)[~empty].abs().max():.3g}, "
          f"max |lse diff| {(lse - want_lse)[~empty].abs().max():.3g}; empty rows give out {out[empty].abs().max() if empty.any() else 0} "
          f"and lse {lse[empty].unique().tolist()[:4] if empty.any() else []}")
    torch.testing.assert_close(out[~empty], want_out[~empty], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse[~empty], want_lse[~empty], atol=2e-3, rtol=1e-3)  # natural log, not base 2
    assert not out.isnan().any()
    assert torch.isneginf(lse[empty]).all() and not out[empty].any(), "a row without keys must give out 0, lse -inf"


def _model(kernels: str, dtype=torch.bfloat16, page_size: int = 16, **config):
    model = MLAModel(MLA_512, kv_capacity=8192, max_requests=4, dtype=dtype, device="cuda", seed=3, page_size=page_size)
    return dcp_compile.apply(model, 1, kernels=kernels, **config)


@served
def test_flashinfer_model_matches_triton_at_dcp1():
    """Prefill (causal chunks), decode and verify steps with padded rows: FlashInfer against Triton."""
    models = {k: _model(k) for k in ("flashinfer", "triton")}
    assert dcp_compile.state(models["flashinfer"]).config.kernels == "flashinfer"
    assert any(key[1:] == (R, P, torch.bfloat16) for key in plans._WARMED)  # built at apply, not in a step
    assert dcp_compile.state(_model("auto")).config.kernels == "flashinfer"  # auto picks it on a Hopper GPU
    tables = {k: RequestTable(4, 2048, 8192, 16) for k in models}
    steps = [[[5] * 37, [6], [7] * 300]] + [[[1], [2], [3]]] * 3 + [[[1] * 7] * 3, [[4] * 16] * 3]
    worst = 0.0
    for tokens in steps:
        logits = {}
        for kernels, model in models.items():
            batch = tables[kernels].extend_batch([0, 1, 2], tokens, pad_rows=1, all_logits=True)
            logits[kernels] = model(*batch.to("cuda").args(), host_metadata=batch.host).float()
        scale = logits["triton"].abs().max().item()
        worst = max(worst, (logits["flashinfer"] - logits["triton"]).abs().max().item() / scale)
    print(f"FlashInfer vs Triton at DCP 1, bf16: worst |diff| / max|logits| = {worst:.3g}")
    assert worst < 2e-2


@two_gpus
@pytest.mark.parametrize("mode,extra", [("decode", dict(steps=6)), ("verify", dict(draft_len=7, steps=4)),
                                        ("verify", dict(draft_len=16, steps=3)), ("extend", dict(chunk=37, steps=3))])
def test_dcp2_matches_dcp1_over_nccl(mode, extra):
    """Both models run FlashInfer (kernels='auto' resolves to it for the bf16, R = 512 baseline)."""
    result = compare(Scenario(mode=mode, device="cuda", kernels="flashinfer", model="tiny-512", layers=3,
                              dtype="bfloat16", page_size=32, contexts=(1, 3, 17, 300), seed=5, **extra))
    print(mode, {k: result[k] for k in ("max_abs_diff", "tolerance", "tokens_match", "strategy_counts")})
    assert result["finite"] and result["outputs_match"] and result["tokens_match"]
    assert result["pass_summary"]["lower_flashinfer_attention"] > 0


def _graph_vs_eager_on_rank(rank: int, world_size: int, debug_skip_plan: bool) -> float:
    from dcp_compile.lowering.flashinfer.plans import FlashInferPlan, StalePlanError
    from dcp_compile.runtime import parallel

    tp = parallel.build(2, 1)

    def twin():
        model = MLAModel(MLA_512, kv_capacity=8192, max_requests=4, par=tp, dtype=torch.bfloat16, device="cuda", seed=7,
                         page_size=32)
        compiled = dcp_compile.apply(model, 2, kernels="flashinfer")
        table = RequestTable(4, 1024, 8192, 32, dcp_size=2)
        prefill = table.extend_batch([0, 1, 2], [[5] * 9, [6], [7] * 30])
        compiled(*prefill.to("cuda").args(), host_metadata=prefill.host)
        return model, compiled, table

    _, eager, eager_table = twin()
    model, graphed, graph_table = twin()
    runner = GraphRunner(graphed.compiled("gather-q"), buckets=(4,), debug=True, host_slot=dcp_compile.state(graphed).host_slot,
                         watched=[model.kv_pool.cache(i) for i in range(3)])
    if debug_skip_plan:
        runner(graph_table.extend_batch([0, 1, 2], [[1], [2], [3]]))
        original = FlashInferPlan.plan
        FlashInferPlan.plan = lambda self, host: None  # a replay whose plan did not happen
        try:
            runner(graph_table.extend_batch([0, 1, 2], [[1], [2], [3]]))
        except StalePlanError:
            return -1.0
        finally:
            FlashInferPlan.plan = original
        return 1.0
    worst, tokens = 0.0, [[1], [2], [3]]
    for step in range(6):
        k = 1 if step % 3 else 5  # decode, and verify graphs of 5 tokens a row
        rows = [t * k for t in tokens]
        batch = eager_table.extend_batch([0, 1, 2], rows, all_logits=k > 1)
        expected = eager(*batch.to("cuda").args(), host_metadata=batch.host)
        got = runner(graph_table.extend_batch([0, 1, 2], rows, all_logits=k > 1), tokens_per_row=k)
        worst = max(worst, (got.float() - expected.float()).abs().max().item() / expected.float().abs().max().item())
        last = expected.view(3, k, -1)[:, -1] if k > 1 else expected
        tokens = [[int(t)] for t in last.argmax(-1)]
    return worst


@two_gpus
def test_dcp2_graph_replay_matches_eager_and_a_skipped_plan_is_caught():
    from dcp_compile.runtime.launch import spawn

    worst = spawn(_graph_vs_eager_on_rank, 2, False, backend="nccl")
    print("graph replay vs eager, FlashInfer DCP 2:", worst)
    assert max(worst) < 1e-2
    assert spawn(_graph_vs_eager_on_rank, 2, True, backend="nccl") == [-1.0, -1.0]
