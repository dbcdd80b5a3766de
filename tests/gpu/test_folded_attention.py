"""The folded partial-attention kernel (lowering/triton/folded_attention.py) on CUDA, against the
torch reference, replayed from CUDA graphs (the kernel itself, fold=True, and where noted the
launcher's choice, folded_attention.folds): every k = 1..16 queries a request, Kimi-K2 latent
sizes (R = 512, P = 64, bf16), contexts up to 32k, padded rows, one-token requests and empty
shards (DCP 2, rank 1). Capture fails on any host sync. Run on its own (`python -m pytest
tests/gpu`): the interpreter tests set TRITON_INTERPRET=1 for their process.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from dcp_compile.lowering.triton import attention, folded_attention  # noqa: E402
from dcp_compile.lowering.triton.launching import is_interpreted  # noqa: E402
from dcp_compile.ops import reference  # noqa: E402
from tests.gpu.test_triton_cuda import BF16_OUT, DEVICE, SCALE, _check_attention, _local_inputs  # noqa: E402

if is_interpreted(folded_attention._attend_folded_kernel):
    pytest.skip("TRITON_INTERPRET=1 is set in this process; run tests/gpu on its own", allow_module_level=True)


def _captured(args, fold=None):
    """The kernel captured in a CUDA graph over static outputs (NaN before each replay), and them."""
    q_latent = args[0]
    out = torch.empty(q_latent.shape, dtype=q_latent.dtype, device=DEVICE)
    lse = torch.empty(q_latent.shape[:2], device=DEVICE)

    def step():
        folded_attention.folded_partial_attention_into(*args, SCALE, out, lse, fold=fold)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    def replay():
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        return out, lse
    return replay


@pytest.mark.parametrize("k", range(1, 17))
def test_every_k_under_a_cuda_graph_matches_the_reference(k):
    args = _local_inputs(16, dcp_size=2, rank=1, per_request=k, seed=100 + k)
    assert (args[4] == 0).any(), "padded rows and empty shards"
    expected = reference.partial_attention(*args, SCALE)
    _check_attention(_captured(args, fold=True)(), expected, BF16_OUT)


@pytest.mark.parametrize("heads,k", [(8, 7), (32, 4), (64, 7), (128, 2)])
@pytest.mark.parametrize("fold", [True, None], ids=["folded", "launcher"])
def test_head_counts_under_a_cuda_graph_match_the_reference(heads, k, fold):
    """The folded kernel at every head count, and the launcher's choice (folds())."""
    args = _local_inputs(heads, dcp_size=2, rank=0, per_request=k, seed=heads * 10 + k, interleave=64)
    _check_attention(_captured(args, fold)(), reference.partial_attention(*args, SCALE), BF16_OUT)


def test_a_replay_follows_lengths_and_positions_changed_in_place():
    args = _local_inputs(16, dcp_size=2, rank=1, per_request=7, seed=7)
    replay = _captured(args, fold=True)
    q_ids, q_positions, seq_lens = args[6], args[7], args[4]
    seq_lens.copy_((seq_lens * 3) // 4)
    q_positions.copy_(torch.clamp(q_positions - 5, min=0))
    _check_attention(replay(), reference.partial_attention(*args, SCALE), BF16_OUT)


def test_it_agrees_with_the_per_query_kernel_in_fp32():
    """The same splits and merge as attention.py: in fp32 (IEEE dots) they agree to rounding."""
    args = _local_inputs(16, dcp_size=2, rank=1, per_request=5, dtype=torch.float32, seed=3)
    out = torch.empty_like(args[0])
    lse = torch.empty(args[0].shape[:2], device=DEVICE)
    folded_attention.folded_partial_attention_into(*args, SCALE, out, lse, fold=True)
    want_out, want_lse = attention.partial_attention(*args, SCALE)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


def test_tokens_in_any_order_under_a_cuda_graph_match_the_reference():
    """The model contract asks for no order of a batch's tokens: shuffled across rows, captured,
    then replayed after the order changed in place (the sort that finds each request's tokens
    runs inside the graph)."""
    args = list(_local_inputs(16, dcp_size=2, rank=1, per_request=5, seed=11))
    generator = torch.Generator().manual_seed(0)

    def shuffle():
        order = torch.randperm(args[0].shape[0], generator=generator).to(DEVICE)
        for i in (0, 1, 6, 7):
            args[i].copy_(args[i][order])
        assert not torch.equal(args[6], args[6].sort().values)

    shuffle()
    replay = _captured(args, fold=True)
    _check_attention(replay(), reference.partial_attention(*args, SCALE), BF16_OUT)
    shuffle()
    _check_attention(replay(), reference.partial_attention(*args, SCALE), BF16_OUT)
