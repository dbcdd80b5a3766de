"""The skinny-matmul kernel and its two ops (dcp_triton::skinny_linear, dcp_triton::head_matmul)
against torch in float64, on CPU under TRITON_INTERPRET=1. Outputs are poisoned with NaN before
each launch, so an unwritten element fails."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from dcp_compile.lowering.triton import matmul_ops, skinny_matmul  # noqa: E402
from dcp_compile.lowering.triton.launching import is_interpreted  # noqa: E402
from dcp_compile.lowering.triton.skinny_matmul import MAX_ROWS, SkinnyConfig, skinny_matmul_into  # noqa: E402

if not is_interpreted(skinny_matmul._skinny_matmul_kernel):
    pytest.skip("the kernels were imported without TRITON_INTERPRET=1 in this process; run this file on its own",
                allow_module_level=True)

# fp32: the interpreter's dot is exact fp32. bf16: the output is rounded once (2^-8 relative).
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _reference(x, w):
    return torch.bmm(x.double(), w.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,rows,k,n,weight_k_contiguous,config", [
    (1, 4, 96, 40, True, None),                      # a linear's weight [N, K] seen as [K, N]
    (1, 1, 300, 24, True, SkinnyConfig(16, 64, 3)),  # K split 3 ways, the last split short
    (1, 17, 70, 33, True, SkinnyConfig(32, 32, 1)),  # 17 rows: a 32-row tile; ragged K and N
    (3, 5, 64, 48, False, None),                     # per-head [H, K, N], N unit-stride
    (2, 64, 40, 20, False, SkinnyConfig(16, 16, 2)),  # the most rows, split K, per-head
])
def test_kernel_matches_float64(dtype, batch, rows, k, n, weight_k_contiguous, config):
    gen = _gen(rows * 100 + k)
    x = torch.randn(batch, rows, k, generator=gen).to(dtype)
    w = (torch.randn(batch, n, k, generator=gen).transpose(1, 2) if weight_k_contiguous
         else torch.randn(batch, k, n, generator=gen)).to(dtype)
    out = torch.full((batch, rows, n), float("nan"), dtype=dtype)
    skinny_matmul_into(out, x, w, config)
    torch.testing.assert_close(out.double(), _reference(x, w), **TOLERANCE[dtype])


def test_split_k_leaves_its_tile_counters_at_zero_and_sums_in_a_fixed_order():
    gen = _gen(5)
    x, w = torch.randn(1, 3, 256, generator=gen), torch.randn(1, 256, 40, generator=gen)
    config = SkinnyConfig(16, 32, 8)
    first = skinny_matmul_into(torch.full((1, 3, 40), float("nan")), x, w, config)
    assert not skinny_matmul._counters(x.device).any()  # a replayed launch starts from zero again
    again = skinny_matmul_into(torch.full((1, 3, 40), float("nan")), x, w, config)
    assert torch.equal(first, again)
    torch.testing.assert_close(first.double(), _reference(x, w), **TOLERANCE[torch.float32])


def test_kernel_reads_and_writes_strided_views():
    """The per-head product as the model has it: q_nope a slice of q [T, H, 192], heads as the batch
    dimension of both the input and the output view, no copies."""
    gen = _gen(3)
    q = torch.randn(5, 4, 24, generator=gen)
    q_nope = q[..., :16]
    w = torch.randn(4, 16, 32, generator=gen)
    out = torch.full((5, 4, 32), float("nan"))
    skinny_matmul_into(out.transpose(0, 1), q_nope.transpose(0, 1), w, SkinnyConfig(16, 16, 1))
    torch.testing.assert_close(out.double(), torch.einsum("thk,hkn->thn", q_nope.double(), w.double()), **TOLERANCE[torch.float32])


@pytest.mark.parametrize("rows,n,k", [(4, 7168, 8192), (4, 2112, 7168), (28, 12288, 1536), (4, 576, 7168)])
def test_default_configs_put_enough_programs_on_the_machine(rows, n, k):
    config = skinny_matmul.choose(rows, n, k, 1, programs_wanted=528)
    programs = -(-n // config.block_n) * config.splits
    assert programs >= 528 // 2 and config.splits * config.block_k <= k


def test_bad_shapes_and_strides_raise():
    x, w = torch.randn(1, 4, 8), torch.randn(1, 8, 6)
    with pytest.raises(ValueError, match="do not chain"):
        skinny_matmul_into(torch.empty(1, 4, 5), x, w)
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS} rows"):
        skinny_matmul_into(torch.empty(1, MAX_ROWS + 1, 6), torch.randn(1, MAX_ROWS + 1, 8), w)
    with pytest.raises(ValueError, match="unit-stride"):
        skinny_matmul_into(torch.empty(1, 4, 6), torch.randn(1, 8, 4).transpose(1, 2), w)


@pytest.mark.parametrize("rows", [1, 7, MAX_ROWS])
def test_skinny_linear_runs_the_kernel_and_matches_linear(rows, monkeypatch):
    launched = []
    real = skinny_matmul.skinny_matmul_into
    monkeypatch.setattr(skinny_matmul, "skinny_matmul_into", lambda *a, **k: launched.append(1) or real(*a, **k))
    gen = _gen(rows)
    x, w = torch.randn(rows, 48, generator=gen).bfloat16(), torch.randn(40, 48, generator=gen).bfloat16()
    out = matmul_ops.skinny_linear(x, w)
    assert launched and out.shape == (rows, 40) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), x.double() @ w.double().t(), **TOLERANCE[torch.bfloat16])
    x3 = torch.randn(2, rows, 48, generator=gen).bfloat16()[:, : max(1, rows // 2)]  # flattens to one row block
    torch.testing.assert_close(matmul_ops.skinny_linear(x3, w).double(), x3.double() @ w.double().t(),
                               **TOLERANCE[torch.bfloat16])


def test_skinny_linear_falls_back_to_linear_where_the_kernel_does_not_apply(monkeypatch):
    monkeypatch.setattr(skinny_matmul, "skinny_matmul_into", lambda *a, **k: pytest.fail("the kernel ran"))
    gen = _gen(9)
    w = torch.randn(12, 16, generator=gen)
    cases = [torch.randn(MAX_ROWS + 1, 16, generator=gen),              # a prefill's rows: cuBLAS's
             torch.randn(16, 4, generator=gen).t(),                     # K not unit-stride
             torch.randn(0, 16, generator=gen)]                         # no rows
    for x in cases:
        assert torch.equal(matmul_ops.skinny_linear(x, w), torch.nn.functional.linear(x, w))
    x = torch.randn(3, 16, generator=gen).double()  # a dtype the kernel does not take
    assert torch.equal(matmul_ops.skinny_linear(x, w.double()), torch.nn.functional.linear(x, w.double()))


def test_head_matmul_matches_einsum_and_falls_back_past_the_row_limit():
    gen = _gen(11)
    q = torch.randn(6, 3, 40, generator=gen).bfloat16()
    w = torch.randn(3, 32, 24, generator=gen).bfloat16()
    out = matmul_ops.head_matmul(q[..., :32], w)
    assert out.shape == (6, 3, 24) and out.stride() == (24, 6 * 24, 1)  # head-major, as einsum leaves it
    torch.testing.assert_close(out.double(), torch.einsum("thk,hkn->thn", q[..., :32].double(), w.double()),
                               **TOLERANCE[torch.bfloat16])
    many = torch.randn(MAX_ROWS + 3, 3, 32, generator=gen)
    fallback = matmul_ops.head_matmul(many, w.float())
    assert torch.equal(fallback, torch.einsum("thk,hkn->thn", many, w.float())) and fallback.stride() == (24, 67 * 24, 1)


def test_the_ops_pass_opcheck():
    gen = _gen(13)
    torch.library.opcheck(torch.ops.dcp_triton.skinny_linear.default,
                          (torch.randn(3, 16, generator=gen), torch.randn(8, 16, generator=gen)))
    torch.library.opcheck(torch.ops.dcp_triton.head_matmul.default,
                          (torch.randn(3, 2, 16, generator=gen), torch.randn(2, 16, 8, generator=gen)))


def test_the_packaged_h200_table_names_valid_configs_or_cublas():
    table = skinny_matmul.tuned_configs("NVIDIA H200")
    assert table and skinny_matmul.tuned_configs("A GPU nobody tuned") == {}
    for shape, blocks in table.items():
        batch, k, n = map(int, shape.split("x"))
        for block, entry in blocks.items():
            assert int(block) in (16, 32, 64)
            if entry != skinny_matmul.TORCH_FASTER:
                config = SkinnyConfig(*entry)
                assert config.block_n in (16, 32, 64, 128, 256) and config.splits * config.block_k <= k, (shape, block)
    # q_a + kv_a at 4 tokens: the kernel, split over K; o_proj: cuBLAS
    assert skinny_matmul.choose(4, 2112, 7168, 1, 528, "NVIDIA H200").splits > 1
    assert skinny_matmul.choose(4, 7168, 8192, 1, 528, "NVIDIA H200") is None


def test_a_table_given_by_the_environment_replaces_the_packaged_one(tmp_path, monkeypatch):
    path = tmp_path / "mine.json"
    path.write_text('{"configs": {"1x96x40": {"16": [32, 32, 3, 4, 3], "32": "cublas"}}}')
    monkeypatch.setenv(skinny_matmul.CONFIGS_ENV, str(path))
    skinny_matmul.tuned_configs.cache_clear()
    try:
        assert skinny_matmul.choose(4, 40, 96, 1, 8, "any") == SkinnyConfig(32, 32, 3, 4, 3)
        assert skinny_matmul.choose(20, 40, 96, 1, 8, "any") is None  # the 32-row block: cuBLAS
        assert skinny_matmul.choose(64, 40, 96, 1, 8, "any") is None  # 64 rows: the largest block tuned below
        monkeypatch.setenv(skinny_matmul.CONFIGS_ENV, str(tmp_path / "missing.json"))
        skinny_matmul.tuned_configs.cache_clear()
        with pytest.raises(FileNotFoundError, match="names no file"):
            skinny_matmul.choose(4, 40, 96, 1, 8, "any")
    finally:
        skinny_matmul.tuned_configs.cache_clear()
