"""verify_attention: which kernel the Triton and FlashInfer back ends give attention over the pool
of a step with several queries a request (shape-only captures through the passes), and the
folded kernel's numbers through a whole model against the torch reference (the interpreter)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import dcp_compile  # noqa: E402
from dcp_compile.config import DCPConfig  # noqa: E402
from dcp_compile.debug import fake_capture  # noqa: E402
from dcp_compile.lowering import flashinfer, registry  # noqa: E402
from dcp_compile.lowering.triton.ops import triton_op  # noqa: E402
from dcp_compile.models.config import preset  # noqa: E402
from dcp_compile.models.mla import MLAModel  # noqa: E402
from dcp_compile.passes import PassManager  # noqa: E402
from dcp_compile.runtime.batch import RequestTable  # noqa: E402
from dcp_compile.runtime.kv_pool import MLAKVPool  # noqa: E402

FOLDED = triton_op("mla_folded_partial_attention")
PER_QUERY = triton_op("mla_partial_attention")


def _lowered(kernels, mode, dcp_size, **options):
    spec = fake_capture.GraphSpec(model="tiny", kernels=kernels, mode=mode, dcp_size=dcp_size, page_size=4 * dcp_size,
                                  attention_strategy="gather-q", dtype="float32", options=options)
    captured = fake_capture.capture(spec)
    PassManager(captured.pass_config(), passes=captured.passes()).run(captured.gm)
    return captured.gm


def _calls(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


@pytest.mark.parametrize("dcp_size", [1, 2])
def test_the_triton_back_end_sends_attention_over_the_pool_to_the_folded_launcher(dcp_size):
    """Decode and verify alike: the launcher chooses by each step's shapes, so a graph symbolic in
    the batch has no T == B guard."""
    for mode in ("verify", "decode"):
        gm = _lowered("triton", mode, dcp_size)
        assert len(_calls(gm, FOLDED)) == 3 and not _calls(gm, PER_QUERY)  # the tiny preset's 3 MLA layers
    unfolded = _lowered("triton", "verify", dcp_size, verify_attention="default")
    assert len(_calls(unfolded, PER_QUERY)) == 3 and not _calls(unfolded, FOLDED)


@pytest.mark.parametrize("dcp_size", [1, 2])
def test_flashinfer_leaves_verify_to_the_folded_kernel_only_when_asked(dcp_size, monkeypatch):
    from dcp_compile.lowering.flashinfer import lowering as flashinfer_lowering
    from dcp_compile.lowering.triton.lower_kernels import LowerKernels

    flashinfer.ensure_ops()
    paged = torch.ops.dcp_flashinfer.mla_paged_attention.default
    assert len(_calls(_lowered("flashinfer", "verify", dcp_size), paged)) == 3
    # Its general kernels lower CUDA pools only; here the shape-only capture's meta pool stands in.
    monkeypatch.setattr(flashinfer_lowering, "LowerKernels",
                        lambda devices, fold_verify: LowerKernels(devices=None, fold_verify=fold_verify))
    folded = _lowered("flashinfer", "verify", dcp_size, verify_attention="folded")
    assert len(_calls(folded, FOLDED)) == 3
    assert not _calls(folded, paged) and not _calls(folded, torch.ops.dcp.window_attention.default)
    decode = _lowered("flashinfer", "decode", dcp_size, verify_attention="folded")
    assert len(_calls(decode, paged)) == 3 and not _calls(decode, FOLDED)


def test_auto_folds_verify_on_triton_and_keeps_flashinfers_kernel():
    pool = MLAKVPool(1, 64, 512, 64, torch.bfloat16, torch.device("cpu"), 64)
    for name, resolved in (("triton", "folded"), ("flashinfer", "default")):
        lowering = registry.get(name)
        assert lowering.options.verify_attention == "auto"
        assert lowering.resolve_options(pool).verify_attention == resolved
    with pytest.raises(ValueError, match="verify_attention must be one of"):
        registry.options_for(registry.get("triton"), {"verify_attention": "fa3"})


def _logits(kernels, **options):
    """The logits of a prefill, a verify and a decode step, and the graphs dynamo compiled after the first."""
    from torch._dynamo.utils import counters

    model = MLAModel(preset("tiny"), kv_capacity=160, max_requests=4, seed=7)
    model = dcp_compile.apply(model, 1, config=DCPConfig(kernels=kernels, options=options))
    table = RequestTable(4, 40, 160)
    steps = [table.extend_batch([0, 1, 2], [list(range(1, 30)), [9], [4, 2, 7]], pad_rows=1),
             # verify: 5 queries a request on three requests and a padded row
             table.extend_batch([0, 1, 2], [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3], [5, 8, 9, 7, 9]], pad_rows=1),
             table.extend_batch([0, 1, 2], [[2], [7], [1]], pad_rows=1)]
    logits = [model(*steps[0].args())]
    graphs = counters["stats"]["unique_graphs"]
    logits += [model(*batch.args()) for batch in steps[1:]]
    return logits, counters["stats"]["unique_graphs"] - graphs


def test_the_folded_kernel_gives_the_reference_logits_through_the_model(monkeypatch):
    from dcp_compile.lowering.triton import folded_attention

    launches = []
    launch = folded_attention.folded_partial_attention_into
    monkeypatch.setattr(folded_attention, "folded_partial_attention_into",
                        lambda *args, **kwargs: launches.append(args[0].shape) or launch(*args, **kwargs))
    (got, graphs), (want, _) = _logits("triton"), _logits("torch")
    assert graphs == 0  # one graph, symbolic in the batch, serves decode and verify: no T == B guard
    # every layer of the three steps: 34, 16 and 4 tokens over 4 rows
    assert sorted({shape[0] for shape in launches}) == [4, 16, 34] and len(launches) == 9
    # the prefill (34 tokens: 9 a row on average) and verify (16) steps folded; decode went on to
    # the per-query kernel
    folded = [folded_attention.folds(tokens, 4, heads) for tokens, heads, _ in launches]
    assert sum(folded) == 6 and all(folds == (tokens != 4) for folds, (tokens, _, _) in zip(folded, launches))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


def _shuffled_verify_logits(kernels):
    """The logits of a verify step (k = 5 on four rows and a padded row) of a 16-head model, its
    tokens in a random order: the model contract asks for no grouping of a row's tokens, and
    `RequestTable` is one scheduler among others. Returns the logits and the token count of
    each folded-attention launch."""
    import dataclasses

    from dcp_compile.lowering.triton import folded_attention
    from dcp_compile.runtime.batch import ForwardBatch

    config = dataclasses.replace(preset("tiny"), num_heads=16)
    model = dcp_compile.apply(MLAModel(config, kv_capacity=200, max_requests=5, seed=7), 1,
                              config=DCPConfig(kernels=kernels))
    table = RequestTable(5, 40, 200)
    model(*table.extend_batch([0, 1, 2, 3], [list(range(1, 30)), [9], [4, 2, 7], [8, 8]]).args())
    batch = table.extend_batch([0, 1, 2, 3], [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3], [5, 8, 9, 7, 9], [2, 7, 1, 8, 2]],
                               pad_rows=1)
    order = torch.randperm(batch.input_ids.shape[0], generator=torch.Generator().manual_seed(0))
    shuffled = ForwardBatch(batch.input_ids[order], batch.positions[order], batch.q_seq_ids[order],
                            batch.out_loc[order], batch.req_to_token, batch.seq_lens, batch.state_slots,
                            torch.argsort(order)[batch.logits_index])
    assert not torch.equal(shuffled.q_seq_ids, batch.q_seq_ids.sort().values)  # not grouped by row
    launches = []
    launch = folded_attention.folded_partial_attention_into
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(folded_attention, "folded_partial_attention_into",
                      lambda *args, **kwargs: launches.append(args[0].shape[0]) or launch(*args, **kwargs))
        logits = model(*shuffled.args())
    return logits, launches


def test_a_batch_not_grouped_by_row_is_served_with_the_torch_back_ends_logits():
    """verify_attention='auto' folds verify; the folded kernel serves a batch whose rows' tokens
    are interleaved and out of row order, with the logits the torch back end gives it."""
    from dcp_compile.lowering.triton import folded_attention

    (got, launches), (want, _) = (_shuffled_verify_logits(kernels) for kernels in ("triton", "torch"))
    assert launches == [21] * 3 and folded_attention.folds(21, 5, 16)  # every MLA layer folded
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
