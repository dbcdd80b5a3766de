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
def test_the_triton_back_end_folds_verify_and_keeps_decode_on_its_per_query_kernel(dcp_size):
    verify = _lowered("triton", "verify", dcp_size)
    assert len(_calls(verify, FOLDED)) == 3 and not _calls(verify, PER_QUERY)  # the tiny preset's 3 MLA layers
    decode = _lowered("triton", "decode", dcp_size)
    assert len(_calls(decode, PER_QUERY)) == 3 and not _calls(decode, FOLDED)
    unfolded = _lowered("triton", "verify", dcp_size, verify_attention="default")
    assert len(_calls(unfolded, PER_QUERY)) == 3 and not _calls(unfolded, FOLDED)


@pytest.mark.parametrize("dcp_size", [1, 2])
def test_flashinfer_leaves_verify_to_the_folded_kernel_only_when_asked(dcp_size):
    flashinfer.ensure_ops()
    paged = torch.ops.dcp_flashinfer.mla_paged_attention.default
    assert len(_calls(_lowered("flashinfer", "verify", dcp_size), paged)) == 3
    folded = _lowered("flashinfer", "verify", dcp_size, verify_attention="folded")
    # On a CPU pool its general kernels are the torch reference (lower_kernels runs on CUDA pools):
    # no FlashInfer plan and no window split is left in the verify graph.
    assert not _calls(folded, paged) and not _calls(folded, torch.ops.dcp.window_attention.default)
    assert len(_calls(_lowered("flashinfer", "decode", dcp_size, verify_attention="folded"), paged)) == 3


def test_auto_folds_verify_on_triton_and_keeps_flashinfers_kernel():
    pool = MLAKVPool(1, 64, 512, 64, torch.bfloat16, torch.device("cpu"), 64)
    for name, resolved in (("triton", "folded"), ("flashinfer", "default")):
        lowering = registry.get(name)
        assert lowering.options.verify_attention == "auto"
        assert lowering.resolve_options(pool).verify_attention == resolved
    with pytest.raises(ValueError, match="verify_attention must be one of"):
        registry.options_for(registry.get("triton"), {"verify_attention": "fa3"})


def _logits(kernels, **options):
    model = MLAModel(preset("tiny"), kv_capacity=160, max_requests=4, seed=7)
    model = dcp_compile.apply(model, 1, config=DCPConfig(kernels=kernels, options=options))
    table = RequestTable(4, 40, 160)
    steps = [table.extend_batch([0, 1, 2], [list(range(1, 30)), [9], [4, 2, 7]], pad_rows=1),
             # verify: 5 queries a request on three requests and a padded row
             table.extend_batch([0, 1, 2], [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3], [5, 8, 9, 7, 9]], pad_rows=1),
             table.extend_batch([0, 1, 2], [[2], [7], [1]], pad_rows=1)]
    return [model(*batch.args()) for batch in steps]


def test_the_folded_kernel_gives_the_reference_logits_through_the_model(monkeypatch):
    from dcp_compile.lowering.triton import folded_attention

    launches = []
    launch = folded_attention.folded_partial_attention_into
    monkeypatch.setattr(folded_attention, "folded_partial_attention_into",
                        lambda *args, **kwargs: launches.append(args[0].shape) or launch(*args, **kwargs))
    got, want = _logits("triton"), _logits("torch")
    # every layer of the two steps with several queries a row (34 and 16 tokens over 4 rows)
    assert sorted({shape[0] for shape in launches}) == [16, 34] and len(launches) == 6
    assert all(folded_attention.folds(tokens, 4, heads) for tokens, heads, _ in launches)  # folded, not handed on
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
