"""Four defects of the NPU path, each fixed, each with a test on the emulated npu device that
fails when its fix is undone:

1. The first KV write to an NPU pool crashed: lower_kernels swaps in dcp_triton:: ops, which had
   kernels for CUDA and CPU only (now PrivateUse1 too, lowering/triton/ops.py).
2. Block tables froze under NPU graphs: a replay must read the block table of its own step, which
   the feed copies into its persistent device buffer before every replay (runtime/host_inputs.py).
3. Replays raced graph updates: NPUGraphs.replay waits for the graph's previous replay (an event
   recorded after it) before NPUGraph.update (runtime/graph_runner.py).
4. Debug checks read the device inside a capture: the check ops skip while capturing
   (ops/internal.py), and a GraphRunner in debug mode checks the batch between replays.
5. Compile regions of two kinds of MLA layer (a dense first layer, then MoE ones: DeepSeek-V3,
   Kimi-K2) failed at the first replay: the graph recorded one FIA call a layer and was sent one
   update a kind of region. The step's feeds now give one update per graph run, in the order the
   step ran them (runtime/host_inputs.HostSlot.runs).

Numbers are compared with the torch reference (1) or with eager calls of an identical model fed
the same steps (2-5); batches mix lengths (1, below and across a page of 16) and carry padded rows.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dcp_compile
from dcp_compile.harness.scenario import half_precision_tolerance
from dcp_compile.models.config import preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.runtime import layout
from dcp_compile.runtime.batch import RequestTable
from dcp_compile.runtime.graph_runner import GraphRunner, NPUGraphs
from tests.npu.models import TINY_512

NPU = "npu"
CFG = TINY_512
ONE_MLA_LAYER = TINY_512.with_layers(2)
"""mla, linear: for defects 2-4, the runtime's (the feed's buffers, graph updates, checks around a
capture), which one MLA layer shows at half the interpreter's time. Updates of several FIA calls
per graph: tests/npu/test_graphs.py, and the graph cases of tests/distributed/test_npu_lowering.py."""
PAGE = 16
CAPACITY = 1024
PROMPTS = [[3] * 15, [4] * 31, [5], [6] * 40]
"""Request 0 crosses a page of 16 on its second decode step, request 1 (31 tokens) its first."""


def npu_model(kernels="npu", device=NPU, cfg=CFG, regions=False, **config):
    model = MLAModel(cfg, CAPACITY, max_requests=4, dtype=torch.bfloat16, page_size=PAGE, device=device,
                     regions=regions)
    return dcp_compile.apply(model, 1, kernels=kernels, **config)


def new_table():
    return RequestTable(4, 96, CAPACITY, PAGE)


def prefill(model, table, device=NPU):
    batch = table.extend_batch([0, 1, 2, 3], PROMPTS, pad_rows=1)
    return model(*batch.to(device).args(), host_metadata=batch.host)


def runner_for(model, debug=True):
    state = dcp_compile.state(model)
    return GraphRunner(model.compiled("gather-q"), buckets=(2, 4), debug=debug, graphs=NPUGraphs(),
                       host_slot=state.host_slot, watched=state.kv_pool.storage())


def eager_step(model, table, requests, tokens, bucket):
    """The step the runner replays, run by `model` itself on the same padded batch."""
    padded = table.extend_batch(requests, tokens).padded(bucket, len(tokens[0]))
    return model(*padded.to(NPU).args(), host_metadata=padded.host)[: len(requests)]


class Replayed:
    """Two identical models (same weights) fed the same steps: one replays its decode steps from
    NPU graphs, the other runs them eagerly."""

    def __init__(self, runner_debug=True, **config):
        self.model, self.eager = npu_model(cfg=ONE_MLA_LAYER, **config), npu_model(cfg=ONE_MLA_LAYER, **config)
        self.tables = [new_table(), new_table()]
        for model, table in zip((self.model, self.eager), self.tables):
            prefill(model, table)
        self.runner = runner_for(self.model, debug=runner_debug)

    def batch(self, requests, tokens):
        return self.tables[0].extend_batch(requests, tokens)

    def expected(self, requests, tokens):
        return eager_step(self.eager, self.tables[1], requests, tokens, self.runner.bucket_for(len(requests)))


# --- 1. The first write of an NPU pool --------------------------------------------------------


def test_an_npu_pool_is_written_by_its_first_prefill_and_decode_steps():
    """Revert (dcp_triton ops without a PrivateUse1 kernel): the prefill fails with NotImplementedError
    ("Could not run 'dcp_triton::sharded_kv_write' with arguments from the 'npu' backend")."""
    reference, lowered = npu_model("torch", device="cpu"), npu_model()
    tables = [new_table(), new_table()]
    tolerance = half_precision_tolerance("bfloat16", CFG.num_mla_layers, 1.0)
    steps = [PROMPTS, [[1], [2], [3], [4]], [[5], [6], [7], [8]]]
    for tokens in steps:
        outs = []
        for model, table, device in zip((reference, lowered), tables, ("cpu", NPU)):
            batch = table.extend_batch([0, 1, 2, 3], tokens, pad_rows=1)
            outs.append(model(*batch.to(device).args(), host_metadata=batch.host))
        expected, out = outs[0], outs[1].cpu()
        assert outs[1].device.type == NPU and torch.isfinite(out).all()
        assert (out - expected).abs().max() <= tolerance * expected.abs().max()
    table = tables[1]
    locations = torch.cat([table.req_to_token[b, : int(table.seq_lens[b])] for b in range(4)])
    assert locations.numel() == sum(map(len, PROMPTS)) + 8 and layout.PADDING_LOC not in locations.tolist()
    others = torch.ones(CAPACITY, dtype=torch.bool)
    others[locations] = False
    others[layout.PADDING_LOC] = False  # the padded rows' writes land there
    pools = [dcp_compile.state(m).kv_pool for m in (reference, lowered)]
    for layer in range(pools[1].num_layers):
        expected, written = pools[0].rows(layer), pools[1].rows(layer).cpu()  # the NPU pool: split latent | rope
        assert (written[locations] != 0).any(dim=-1).all()  # every token's row was written ...
        assert not written[others].any() and not expected[others].any()  # ... and no other row
        if layer == 0:  # the first MLA layer's KV comes from the embeddings alone: bit for bit
            assert torch.equal(written[locations], expected[locations])
        else:  # later layers' KV follows the attention above them (FIA against the reference)
            difference = (written[locations].float() - expected[locations].float()).abs().max()
            assert difference <= tolerance * expected[locations].float().abs().max()


# --- 2. Block tables under NPU graphs ---------------------------------------------------------


def test_each_replay_reads_the_block_table_of_its_own_step():
    """Steps of the same bucket whose block tables differ: other requests, and requests that grew
    a page since the last replay. Revert (the feed's block-table buffer not refreshed before a
    replay): the replays read a stale table and their logits differ from the eager ones."""
    replayed = Replayed()
    schedule = [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1, 2], [1, 3], [0, 1, 2, 3], [0, 1]]
    tables_seen: dict[int, list[torch.Tensor]] = {}
    for step, requests in enumerate(schedule):
        tokens = [[10 + step + r] for r in requests]
        batch = replayed.batch(requests, tokens)
        tables_seen.setdefault(replayed.runner.bucket_for(len(requests)), []).append(batch.host.block_tables[0].clone())
        out = replayed.runner(batch)
        expected = replayed.expected(requests, tokens)
        assert out.device.type == NPU and out.shape == expected.shape
        assert torch.equal(out.cpu(), expected.cpu()), f"step {step}: the replay of rows {requests} differs from eager"
    assert sorted(replayed.runner.captured) == [(2, 1, 96), (4, 1, 96)]  # one graph per bucket, replayed over and over
    for bucket, seen in tables_seen.items():  # the test is only as good as the tables changing between replays
        assert all(not torch.equal(a, b) for a, b in zip(seen, seen[1:])), bucket
    assert int(replayed.tables[0].seq_lens[0]) > PAGE and int(replayed.tables[0].seq_lens[1]) > 2 * PAGE  # both grew a page


# --- 3. Graph updates against a running replay ------------------------------------------------


def test_back_to_back_replays_with_new_lengths_wait_for_the_previous_replay():
    """Nothing between the two replays waits for the device (no debug checks, no read of the
    first output). Revert (no wait before NPUGraph.update): the second replay raises "NPUGraph.update
    while the graph's last replay may still run"."""
    replayed = Replayed(runner_debug=False)
    requests, steps = [0, 1, 2], [[[1], [2], [3]], [[4], [5], [6]]]
    outs, pushed = [], []
    for tokens in steps:
        outs.append(replayed.runner(replayed.batch(requests, tokens)))
        (captured,) = replayed.runner.captured.values()
        pushed.append(replayed.runner.graphs.applied(captured.graph))
    assert pushed[0] != pushed[1]  # new host lengths for FIA, pushed by NPUGraph.update
    assert pushed[1][0]["actual_seq_lengths_kv"] == [17, 33, 3, 0]  # the padded row of the bucket sees no key
    for tokens, out in zip(steps, outs):
        assert torch.equal(out.cpu(), replayed.expected(requests, tokens).cpu())


# --- 4. Debug checks and captures -------------------------------------------------------------


def test_debug_checks_skip_inside_the_capture_and_the_runner_checks_between_replays():
    """Revert (the check ops read the device while capturing): the capture fails with the emulator's
    CaptureError (a device-to-host read in an NPU graph capture). A bad batch is still caught,
    by the runner's check before its replay, as the eager model's own checks catch it."""
    replayed = Replayed(debug_checks=True)
    requests = [0, 1, 2]
    for step in range(2):  # a capture, then a replay with new lengths
        tokens = [[step + 1]] * 3
        out = replayed.runner(replayed.batch(requests, tokens))
        assert torch.equal(out.cpu(), replayed.expected(requests, tokens).cpu())
    good = replayed.batch(requests, [[7]] * 3)
    bad = dataclasses.replace(good, positions=good.positions + 64)  # past every row's length
    with pytest.raises(ValueError, match=r"positions must lie in \[0, seq_len\)"):
        replayed.runner(bad)
    eager_bad = dataclasses.replace(replayed.tables[1].extend_batch(requests, [[7]] * 3), positions=bad.positions)
    with pytest.raises(ValueError, match=r"positions must lie in \[0, seq_len\)"):
        replayed.eager(*eager_bad.to(NPU).args(), host_metadata=eager_bad.host)


# --- 5. Compile regions of two kinds of MLA layer ----------------------------------------------


def test_regions_of_two_kinds_of_layer_replay_with_one_fia_update_per_layer():
    """tiny-512-moe: a dense MLA layer, then two MoE ones, each layer a compile region: two kinds
    of region, one called once, the other twice, three FIA calls in the captured graph. Decode
    steps replayed from NPU graphs give the logits of the same model without regions, run eagerly
    on the same padded batches, and every replay pushes one update per FIA call (verify steps of
    regions replayed: tests/distributed/test_npu_lowering.py). Revert (one update per kind of
    region): the first replay raises the emulator's "cpu_update_input has 2 entries, the graph
    recorded 3 updatable calls", as torch_npu's NPUGraph.update does (docs/ascend.md §9.3)."""
    cfg = preset("tiny-512-moe")
    regional, plain = npu_model(cfg=cfg, regions=True), npu_model(cfg=cfg)
    tables = [new_table(), new_table()]
    for model, table in zip((regional, plain), tables):
        prefill(model, table)
    runner = runner_for(regional)
    requests = [0, 1, 2]
    for step in range(3):  # request 0 (15 tokens) crosses a page at its second step
        tokens = [[20 + step + r] for r in requests]
        out = runner(tables[0].extend_batch(requests, tokens))
        assert torch.equal(out.cpu(), eager_step(plain, tables[1], requests, tokens, 4).cpu()), f"decode step {step}"
    (captured,) = runner.captured.values()
    assert len(runner.graphs.applied(captured.graph)) == cfg.num_mla_layers
