"""The transformers front end on CUDA: an unmodified DeepseekV3ForCausalLM with DeepSeek-V3's
attention widths (R 512, P 64, n 128, v 128; 16 heads, 2 layers) through dcp_compile.apply at
dcp_size 1, against the untouched model's generate(), on every CUDA back end (flashinfer where it
is installed, triton, torch) with the eager and the inductor inner compile, in fp32 and bf16, and
with the decode steps replayed from CUDA graphs (FlashInfer's plans fed before each replay).

The near-tie rule (the harness's, dcp_compile/harness/scenario.py), with FP32_LOGITS in fp32 and
BF16_LOGITS in bf16: a row's tokens may part only where the untouched model's two candidates are
within 2 x the tolerance of each other, and the logits before that within the tolerance (the
Triton kernels' fp32 dots may round as TF32). Skipped where no CUDA device is present."""

from __future__ import annotations

import copy

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("transformers")
pytest.importorskip("triton")

import dcp_compile  # noqa: E402
from tests.hf.models import agree_near_ties as _agree  # noqa: E402
from tests.hf.models import one_region_per_kind, tiny_model  # noqa: E402

WIDTHS = dict(hidden_size=256, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, qk_rope_head_dim=64,
              qk_nope_head_dim=128, v_head_dim=128, vocab_size=256, max_position_embeddings=512,
              initializer_range=0.02)
NEW_TOKENS = 12
FP32_LOGITS = 2e-3
BF16_LOGITS = 0.1


def _model(dtype):
    return tiny_model(**WIDTHS).to("cuda", dtype)


def _generate(model, input_ids):
    with torch.no_grad():
        out = model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, 1)  # logits [B, steps, vocab]


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, WIDTHS["vocab_size"], (rows, length), generator=generator).cuda()
            for rows, length in ((2, 37), (1, 5), (3, 64))]


def _flashinfer() -> bool:
    """Whether FlashInfer serves this GPU with the test's widths in bf16."""
    from dcp_compile.lowering import flashinfer

    return flashinfer.unsupported_reason(torch.device("cuda"), WIDTHS["kv_lora_rank"], WIDTHS["qk_rope_head_dim"],
                                         torch.bfloat16) is None


needs_flashinfer = pytest.mark.skipif(not _flashinfer(), reason="FlashInfer is not installed")


@pytest.mark.parametrize("kernels,inner_compile,dtype", [
    pytest.param("flashinfer", "inductor", torch.bfloat16, marks=needs_flashinfer),
    pytest.param("flashinfer", "eager", torch.bfloat16, marks=needs_flashinfer),
    ("triton", "eager", torch.float32),
    ("triton", "inductor", torch.bfloat16),
    ("triton", "eager", torch.bfloat16),
    ("torch", "inductor", torch.bfloat16),
])
def test_generate_matches_transformers_on_cuda(prompts, kernels, inner_compile, dtype):
    reference = _model(dtype)
    model = dcp_compile.apply(copy.deepcopy(reference), dcp_size=1, kernels=kernels, inner_compile=inner_compile)
    tolerance = FP32_LOGITS if dtype == torch.float32 else BF16_LOGITS
    for input_ids in prompts:
        got, want = _generate(model, input_ids), _generate(reference, input_ids)
        _agree(got, want, tolerance)
    graphs = len(dcp_compile.state(model).reports)
    # rows 1 | more, x prefill | one-token decode; never one per prompt length (FlashInfer's plans
    # are sized by each step, so its graphs are symbolic too).
    assert graphs <= 6, graphs


def test_auto_kernels_pick_flashinfer_where_installed(prompts):
    """kernels='auto' on CUDA: FlashInfer where it serves the GPU, else Triton."""
    reference = _model(torch.bfloat16)
    model = dcp_compile.apply(copy.deepcopy(reference), dcp_size=1)
    assert dcp_compile.state(model).config.kernels == ("flashinfer" if _flashinfer() else "triton")
    _agree(_generate(model, prompts[0]), _generate(reference, prompts[0]), BF16_LOGITS)


@pytest.mark.parametrize("kernels,inner_compile,dtype", [
    ("triton", "eager", torch.float32), ("triton", "inductor", torch.bfloat16),
    pytest.param("flashinfer", "inductor", torch.bfloat16, marks=needs_flashinfer),
])
def test_generate_replays_cuda_graphs_with_transformers_tokens(prompts, kernels, inner_compile, dtype):
    """capture_decode_graphs: every decode step of generate() replays a CUDA graph captured once
    per batch size (hf/graphs.py); the tokens are the untouched model's."""
    reference = _model(dtype)
    model = dcp_compile.apply(copy.deepcopy(reference), dcp_size=1, kernels=kernels, inner_compile=inner_compile)
    model.capture_decode_graphs(batch_sizes=(1, 2, 3), max_length=WIDTHS["max_position_embeddings"])
    tolerance = FP32_LOGITS if dtype == torch.float32 else BF16_LOGITS
    for input_ids in prompts + prompts[:1]:
        got, want = _generate(model, input_ids), _generate(reference, input_ids)
        _agree(got, want, tolerance)
    graphs = model.decode_graphs
    assert graphs.replays == (len(prompts) + 1) * (NEW_TOKENS - 1)
    assert sorted(key[0] for key in graphs.captured) == [1, 2, 3]


@pytest.mark.parametrize("kernels", ["triton", pytest.param("flashinfer", marks=needs_flashinfer)])
def test_regions_replay_cuda_graphs_with_transformers_tokens(prompts, kernels):
    """apply(..., regions=True) under inductor in bf16 (one dense, then three MoE layers: two kinds,
    each compiled once), generate()'s decode steps replayed from CUDA graphs: the untouched
    model's tokens under the near-tie rule."""
    reference = tiny_model(**WIDTHS, num_hidden_layers=4, first_k_dense_replace=1).to("cuda", torch.bfloat16)
    model = dcp_compile.apply(copy.deepcopy(reference), dcp_size=1, kernels=kernels, inner_compile="inductor",
                              regions=True)
    model.capture_decode_graphs(batch_sizes=(1, 2, 3), max_length=WIDTHS["max_position_embeddings"])
    for input_ids in prompts:
        _agree(_generate(model, input_ids), _generate(reference, input_ids), BF16_LOGITS)
    assert model.decode_graphs.replays == len(prompts) * (NEW_TOKENS - 1)
    assert one_region_per_kind([r.sites("absorb_mla") for r in dcp_compile.state(model).reports], kinds=2)
