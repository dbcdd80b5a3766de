"""The transformers front end on the npu device, with generate()'s decode steps replayed from
device graphs (dcp_compile/hf/graphs.py): on 2 ranks of the emulated npu device (hccl; NPU graphs,
whose replay runs exactly the recorded ops on the captured buffers, takes the host-fed FIA
lengths as NPUGraph.update pushes them, and refuses host traffic in a capture).

Two back ends, in one launch:
- kernels='npu' (the NPU lowering: FIA over the pool, npu_attention_update for the merge, the
  native ops for the rest), on DeepSeek-V3 tiny with FIA's widths (R 512, P 64) in bf16 (FIA's
  dtypes), at DCP 2 and at dcp_size 1, under the near-tie rule (BF16_LOGITS);
- kernels='triton' in fp32 at DCP 2, its kernels under the Triton interpreter as triton-ascend
  would run them there: transformers' tokens, logits within 1e-5.

Dense layers (transformers' default MoE experts count tokens with histc on integers, which has no
CPU kernel, and the emulator runs CPU kernels). Batches of 2 and 1 rows, a left-padded batch of
prompts of 1, 7 and 20 tokens, and a second batch of 2 rows that replays the graph captured for the
first; every decode step replayed, one graph per batch size.

And kernels='npu' at DCP 2 with compile regions (apply(regions=True)) on a dense layer, then two
MoE ones (experts batched_mm): two kinds of region, three FIA calls a captured graph.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from dcp_compile.runtime.launch import spawn  # noqa: E402

NEW_TOKENS = 5
LENGTHS = (1, 7, 20)
BF16_LOGITS = 0.2
"""bf16's logit tolerance: the tiny model's logits reach about 10 (initializer_range 0.2), where a
bf16 step is 0.06; the absorbed and the expanded attention round apart by up to 0.1 here."""
FIA_WIDTHS = dict(kv_lora_rank=512, qk_rope_head_dim=64)
FIA_BLOCK = 16
"""FIA's smaller block size (16 or 128 on a CANN of 2025): pages of 16 rows per rank."""
CASES = (("triton", torch.float32, 2), ("npu", torch.bfloat16, 2), ("npu", torch.bfloat16, 1))
"""(kernels, dtype, dcp_size)."""


def rank_generates(rank: int, world: int, kernels: str, dtype: torch.dtype, dcp_size: int) -> dict:
    import dcp_compile
    from tests.hf.models import agree_near_ties, prompt, tiny_model
    from tests.hf.test_caches_and_generate import _left_padded

    device = torch.device("npu", torch.npu.current_device())
    widths = FIA_WIDTHS if kernels == "npu" else {}
    reference = tiny_model(first_k_dense_replace=2, **widths).to(dtype)
    extra = {"block_size": FIA_BLOCK} if kernels == "npu" else {}
    model = dcp_compile.apply(copy.deepcopy(reference).to(device), dcp_size=dcp_size, kernels=kernels,
                              kv_capacity=1024, **extra)
    model.capture_decode_graphs(batch_sizes=(1, 2, 3), max_length=64)
    _, padded, mask = _left_padded(LENGTHS)
    calls = [(prompt(), {}), (prompt(3)[:1], {}), (padded, {"attention_mask": mask}), (prompt(5), {})]
    results = []
    for input_ids, extra in calls:
        _, got, want = _generate_both(model, device, reference, input_ids, extra)
        try:  # plain values back to the test: tensors in the result queue outlive their rank
            near_tie = ("ok", agree_near_ties(got, want, BF16_LOGITS))
        except AssertionError as exc:
            near_tie = ("failed", repr(exc))
        results.append(dict(tokens_equal=bool(torch.equal(got[0], want[0])), near_tie=near_tie,
                            logits=float((got[1].float() - want[1].float()).abs().max())))
    graphs, state = model.decode_graphs, dcp_compile.state(model)
    replays, captured = graphs.replays, sorted(key[0] for key in graphs.captured)
    off_device = _off_device_ops(model, device)
    syncs = peer_flags = None
    if kernels == "npu":
        syncs = (_syncs_per_decode_step(model, device), _syncs_per_decode_step(copy.deepcopy(reference).to(device), device))
    if kernels == "npu" and dcp_size > 1:
        peer_flags = _deferred_agreement_flags(model, device, rank)
    ops = [dict(report.records[-1].ops_after) for report in state.reports]
    return dict(results=results, replays=replays, captured=captured,
                compiled=len(state.reports), ops=ops, kernels=state.lowering.name, page_size=state.kv_pool.page_size,
                syncs=syncs, off_device=off_device, peer_flags=peer_flags)


def _deferred_agreement_flags(model, device, rank: int) -> list[int]:
    """The `peer_step` device flag after a decode step's deferred agreement (no host sync) on
    the same token on both ranks, then on a token that differs on rank 1."""
    from dcp_compile.runtime import guards

    flags, index = guards.error_flags(device), guards.INDEX["peer_step"]
    seen = []
    for token in (7, 7 + rank):
        ids = torch.tensor([[token]], device=device)
        model._agreement.check_step(ids, ids, None, None, deferred=True)
        seen.append(int(flags[index]))
        flags.zero_()
    return seen


def _off_device_ops(model, device) -> dict:
    """The aten ops torch_npu would run on the host, and the ops whose NPU kernel syncs to learn
    its output's size, over a generate() of a prefill and replayed decode steps (the emulator's
    op coverage, dcp_compile/testing/npu_emulator/op_coverage.py)."""
    from dcp_compile.testing import npu_emulator
    from tests.hf.models import prompt

    npu_emulator.reset_host_syncs()
    with torch.no_grad():
        model.generate(prompt().to(device), max_new_tokens=4, do_sample=False)
    return {"off_device": npu_emulator.ops_off_device(), "syncing": npu_emulator.syncing_ops()}


def _syncs_per_decode_step(model, device) -> float:
    """The emulated device's host syncs each decode step of generate() adds (two calls of 3 and
    11 new tokens on a warm model, the difference over the 8 extra steps)."""
    from dcp_compile.testing import npu_emulator
    from tests.hf.models import prompt

    counts = []
    for new_tokens in (2, 3, 11):
        before = npu_emulator.host_syncs()
        with torch.no_grad():
            model.generate(prompt().to(device), max_new_tokens=new_tokens, do_sample=False)
        counts.append(npu_emulator.host_syncs() - before)
    return (counts[2] - counts[1]) / 8


def _generate_both(model, device, reference, input_ids, extra: dict):
    """generate() of the applied model on `device` and of the untouched reference on the CPU: (the
    model's output, its (tokens, logits [B, steps, vocab]) on the CPU, the reference's)."""
    outputs = []
    for served, on in ((model, device), (reference, torch.device("cpu"))):
        with torch.no_grad():
            out = served.generate(input_ids.to(on), **{k: v.to(on) for k, v in extra.items()},
                                  max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True)
        outputs.append(out)
    got, want = ((out.sequences.cpu(), torch.stack(out.logits, 1).cpu()) for out in outputs)
    return outputs[0], got, want


def rank_hybrid(rank: int, world: int) -> dict:
    """Kimi-Linear (2 KDA and 2 MLA layers) at DCP 2, kernels="triton" in fp32, decode graphs on: a
    batch of 2, then a second batch of 2 (a new cache taking the graph over while the first is
    alive); tokens and logits against transformers, and the first cache's linear-attention state
    handed back to it unchanged. (A left-padded hybrid batch: test_transformers_distributed.)"""
    import dcp_compile
    from tests.hf.models import prompt, tiny_model

    device = torch.device("npu", torch.npu.current_device())
    # Dense MLPs: the MoE's routing counts with an integer histc, which the emulator's CPU kernels lack.
    reference = tiny_model(family="kimi-linear", mlp_layer_types=["dense"] * 4)
    model = dcp_compile.apply(copy.deepcopy(reference).to(device), dcp_size=world, kernels="triton", kv_capacity=1024)
    model.capture_decode_graphs(batch_sizes=(2,), max_length=64)
    vocab = reference.config.vocab_size
    calls = [(prompt(vocab=vocab), {}), (prompt(5, vocab=vocab), {})]
    worst, equal, outputs = 0.0, True, []
    for input_ids, extra in calls:
        out, got, want = _generate_both(model, device, reference, input_ids, extra)
        outputs.append(out)
        equal &= bool(torch.equal(got[0], want[0]))
        worst = max(worst, float((got[1] - want[1]).abs().max()))
        if len(outputs) == 1:  # the first cache's state, before another cache takes its graph over
            first_state = [layer.recurrent_states[0].cpu() for layer in _kda(outputs[0].past_key_values)]
    handed_back = [layer.recurrent_states[0].cpu() for layer in _kda(outputs[0].past_key_values)]
    replays = model.decode_graphs.replays
    return dict(tokens_equal=equal, logits=worst, replays=replays, off_device=_off_device_ops(model, device),
                state_kept=all(torch.equal(a, b) for a, b in zip(first_state, handed_back)))


def _kda(cache) -> list:
    from transformers.cache_utils import LinearAttentionLayer

    return [layer for layer in cache.layers if isinstance(layer, LinearAttentionLayer)]


def rank_regions(rank: int, world: int) -> dict:
    """DeepSeek-V3 tiny with FIA's widths in bf16, a dense layer then two MoE ones, each a compile
    region, at DCP 2 with its decode steps replayed: near-tie agreement with transformers (whose
    tokens the same model gives at dcp_size 1: tests/hf/test_regions.py), and the updates each
    replay pushed (one per FIA call)."""
    import dcp_compile
    from tests.hf.models import agree_near_ties, prompt, tiny_model

    device = torch.device("npu", torch.npu.current_device())
    reference = tiny_model(num_hidden_layers=3, first_k_dense_replace=1, experts_implementation="batched_mm",
                           **FIA_WIDTHS).to(torch.bfloat16)
    model = dcp_compile.apply(copy.deepcopy(reference).to(device), dcp_size=world, kernels="npu", regions=True,
                              block_size=FIA_BLOCK, kv_capacity=1024)
    model.capture_decode_graphs(batch_sizes=(2,), max_length=64)
    _, got, want = _generate_both(model, device, reference, prompt(), {})
    try:
        near_tie = ("ok", agree_near_ties(got, want, BF16_LOGITS))
    except AssertionError as exc:
        near_tie = ("failed", repr(exc))
    graphs = model.decode_graphs
    return dict(tokens_equal=bool(torch.equal(got[0], want[0])), near_tie=near_tie, replays=graphs.replays,
                updates=[len(graphs.graphs.applied(captured.graph)) for captured in graphs.captured.values()])


def rank_runs(rank: int, world: int) -> dict:
    """Every case in one launch."""
    from tests.hf.models import available

    runs = {case: rank_generates(rank, world, *case) for case in CASES}
    runs["regions"] = rank_regions(rank, world)
    runs["hybrid"] = rank_hybrid(rank, world) if available("kimi-linear") else None
    return runs


@pytest.fixture(scope="module")
def ranks(npu_emulator):
    return spawn(rank_runs, 2, backend="hccl")


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case[0]}-{str(case[1])[6:]}-dcp{case[2]}")
def test_generate_replays_decode_graphs_with_transformers_tokens(ranks, case):
    kernels, dtype, dcp_size = case
    for rank in ranks:
        run = rank[case]
        assert run["kernels"] == kernels
        for result in run["results"]:
            assert result["near_tie"][0] == "ok", result
            if dtype == torch.float32:
                assert result["tokens_equal"] and result["logits"] < 1e-5, result
        assert run["replays"] == 4 * (NEW_TOKENS - 1)  # every decode step of the 4 calls
        assert run["captured"] == [1, 2, 3]  # the second batch of 2 replays the first's graph


def test_the_npu_lowering_runs_fia_over_the_pool_and_merges_with_attention_update(ranks):
    """kernels='npu' compiles per shape (its FIA lengths are planned on the host): a graph per
    prefill length and batch, each of whose 2 MLA layers is one FIA call over the pool; at DCP 2
    the partials merge with npu_attention_update, and no layer is left to the reference ops."""
    for rank in ranks:
        for dcp_size in (2, 1):
            run = rank[("npu", torch.bfloat16, dcp_size)]
            assert run["page_size"] == FIA_BLOCK * dcp_size
            for ops in run["ops"]:
                assert _count(ops, "npu_fused_infer_attention_score") == 2, " ".join(sorted(ops))
                assert _count(ops, "npu_attention_update") == (2 if dcp_size > 1 else 0), ops
                assert not any(name.startswith("dcp::mla_") for name in ops), ops


def _count(ops: dict, fragment: str) -> int:
    return sum(count for name, count in ops.items() if fragment in name)


@pytest.mark.parametrize("dcp_size", [1, 2])
def test_a_replayed_decode_step_adds_no_host_sync_to_transformers_loop(ranks, dcp_size):
    """Inside generate() a replayed decode step reads nothing back from the device: no token-id or
    position check (the token is the model's own, the positions the cache's), the cache's length
    kept on the host, the host metadata from the cache's host view, the device error flags read
    back without a wait, and at DCP 2 the peers' agreement all-gathered and compared on the device.
    transformers' own loop reads its stop flag once a step (measured on an untouched copy of the
    model on the same device); the step adds nothing to it (it added 4 at DCP 1 before: the
    length, the token check, the positions and the error flags; at DCP 2 it added 3, the agreement's)."""
    for rank in ranks:
        ours, theirs = rank[("npu", torch.bfloat16, dcp_size)]["syncs"]
        assert ours == theirs, (ours, theirs)


def test_a_decode_step_the_peers_disagree_on_sets_the_peer_flag_on_every_rank(ranks):
    """The deferred agreement: the same token on both ranks leaves the `peer_step` flag clear; a
    token that differs on one rank sets it on both (the compiled step raises it at the next
    step, runtime/guards.py)."""
    for rank in ranks:
        assert rank[("npu", torch.bfloat16, 2)]["peer_flags"] == [0, 1]


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case[0]}-{str(case[1])[6:]}-dcp{case[2]}")
def test_every_op_of_a_step_runs_on_the_npu(ranks, case):
    """No aten op of a generate() (its prefill, its replayed decode steps, transformers' loop)
    is one torch_npu runs on the host or one whose kernel syncs to learn its output's size;
    inside a capture either would have raised (the emulator's op coverage)."""
    for rank in ranks:
        assert rank[case]["off_device"] == {"off_device": {}, "syncing": {}}, rank[case]["off_device"]


def test_a_hybrid_model_replays_its_decode_steps_with_transformers_tokens(ranks):
    """Kimi-Linear's decode steps replay NPU graphs (they ran compiled before: its KDA state was
    not in the captured cache): its linear-attention layers' state is captured over a static copy,
    which the replayed cache's layers then point at. Tokens equal to transformers', logits within
    1e-4 (fp32), every decode step replayed, and a first cache whose graph another one took over
    gets its own state back unchanged."""
    for rank in ranks:
        run = rank["hybrid"]
        if run is None:
            pytest.skip("kimi_linear is not in this transformers")
        assert run["tokens_equal"] and run["logits"] < 1e-4, run
        assert run["replays"] == 2 * (NEW_TOKENS - 1)
        assert run["state_kept"]
        # Every aten op of its generate() (the KDA layers' included) one torch_npu runs on the device.
        assert run["off_device"] == {"off_device": {}, "syncing": {}}, run["off_device"]


def test_regions_of_two_kinds_of_layer_replay_their_decode_steps_at_dcp_two(ranks):
    """A dense layer and two MoE ones, each a compile region (two kinds), at DCP 2: every decode
    step replayed, each replay pushing one update per FIA call (three), and the tokens agree with
    transformers' under the near-tie rule. One update per kind of region failed the first replay
    ("cpu_update_input has 2 entries, the graph recorded 3 updatable calls")."""
    for rank in ranks:
        run = rank["regions"]
        assert run["near_tie"][0] == "ok", run
        assert run["replays"] == NEW_TOKENS - 1 and run["updates"] == [3], run


def test_triton_compiles_one_graph_per_kind_of_step(ranks):
    """(1 row | more) x (prefill | decode), whatever the lengths and padding."""
    for rank in ranks:
        assert rank[("triton", torch.float32, 2)]["compiled"] == 4
