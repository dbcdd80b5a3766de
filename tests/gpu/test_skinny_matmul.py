"""The skinny-matmul ops on CUDA at the decode step's Kimi-K2 shapes (64 heads on one GPU), bf16,
against an fp32 product, with the configs the package holds for this GPU (or the heuristic):
every row block, the split-K path, the per-head layout as the model's graph has it, the
fallback past 64 rows, and a CUDA-graph capture (no host sync, the split buffer allocated
inside it)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from dcp_compile.lowering.triton import matmul_ops, skinny_matmul  # noqa: E402
from dcp_compile.lowering.triton.launching import is_interpreted  # noqa: E402

if is_interpreted(skinny_matmul._skinny_matmul_kernel):
    pytest.skip("TRITON_INTERPRET=1 is set in this process; run tests/gpu on its own", allow_module_level=True)

DEVICE = torch.device("cuda")
LINEARS = [(7168, 2112), (1536, 12288), (8192, 7168), (7168, 4096), (2048, 7168)]  # (K, N)
HEADS = [(64, 128, 512), (64, 512, 128)]  # (H, K, N): W_UK, W_UV


def _relative_error(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("rows", [1, 4, 16, 28, 64])
@pytest.mark.parametrize("k,n", LINEARS)
def test_skinny_linear_at_the_model_shapes(rows, k, n):
    gen = torch.Generator(device=DEVICE).manual_seed(rows + n)
    x = torch.randn(rows, k, device=DEVICE, generator=gen).bfloat16()
    w = (torch.randn(n, k, device=DEVICE, generator=gen) / k ** 0.5).bfloat16()
    out = matmul_ops.skinny_linear(x, w)
    assert out.shape == (rows, n) and torch.isfinite(out).all()
    assert _relative_error(out, x.float() @ w.float().t()) < 1e-2


@pytest.mark.parametrize("rows", [4, 28, 64])
@pytest.mark.parametrize("heads,k,n", HEADS)
def test_head_matmul_on_a_slice_of_q(rows, heads, k, n):
    gen = torch.Generator(device=DEVICE).manual_seed(rows + k)
    q = torch.randn(rows, heads, k + 64, device=DEVICE, generator=gen).bfloat16()
    w = (torch.randn(heads, k, n, device=DEVICE, generator=gen) / k ** 0.5).bfloat16()
    out = matmul_ops.head_matmul(q[..., :k], w)
    ref = torch.einsum("thk,hkn->thn", q[..., :k].float(), w.float())
    assert _relative_error(out, ref) < 1e-2


def test_past_64_rows_is_cublas_bit_for_bit():
    x = torch.randn(65, 1536, device=DEVICE).bfloat16()
    w = torch.randn(2048, 1536, device=DEVICE).bfloat16()
    assert torch.equal(matmul_ops.skinny_linear(x, w), torch.nn.functional.linear(x, w))


def test_replays_from_a_cuda_graph():
    x = torch.randn(4, 7168, device=DEVICE).bfloat16()
    w = torch.randn(2112, 7168, device=DEVICE).bfloat16()  # narrow N: the split-K path where tuned so
    matmul_ops.skinny_linear(x, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = matmul_ops.skinny_linear(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert _relative_error(out, x.float() @ w.float().t()) < 1e-2
