"""lower_projections: which products it swaps for the skinny-matmul ops (finder, with what must not
match), and on the reference model's graph the op counts before and after and the same logits
as cuBLAS's, over a prefill of mixed lengths with a padded row (more rows than the kernel takes)
and decode steps (the kernel). The pass is pointed at the CPU here; it runs on CUDA graphs."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.fx as fx  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

import dcp_compile  # noqa: E402
from dcp_compile.lowering.triton import skinny_matmul  # noqa: E402
from dcp_compile.lowering.triton.launching import is_interpreted  # noqa: E402
from dcp_compile.lowering.triton.lower_projections import LowerProjections, find_projection_sites  # noqa: E402
from dcp_compile.lowering.flashinfer.lowering import FlashInferLowering  # noqa: E402
from dcp_compile.lowering.torch.lowering import TorchLowering  # noqa: E402
from dcp_compile.lowering.triton.lowering import TritonLowering, TritonOptions  # noqa: E402
from dcp_compile.models.config import preset  # noqa: E402
from dcp_compile.models.mla import MLAModel  # noqa: E402
from dcp_compile.passes.graph_utils import normalize_meta  # noqa: E402
from dcp_compile.runtime.batch import RequestTable  # noqa: E402

if not is_interpreted(skinny_matmul._skinny_matmul_kernel):
    pytest.skip("the kernels were imported without TRITON_INTERPRET=1 in this process; run this file on its own",
                allow_module_level=True)


class _Products(nn.Module):
    """Products the pass must swap next to ones it must leave alone."""

    def __init__(self, dtype):
        super().__init__()
        g = torch.Generator().manual_seed(0)

        def param(*shape, of=dtype):
            return nn.Parameter(torch.randn(*shape, generator=g).to(of))
        self.w, self.heads = param(6, 8), param(2, 8, 5)
        self.bias, self.fp32_w, self.batched = param(6), param(6, 8, of=torch.float32), param(3, 8, 5)

    def forward(self, x, per_head, x32):
        return (F.linear(x, self.w),                                  # swapped
                torch.einsum("thk,hkn->thn", per_head, self.heads),   # swapped
                torch.bmm(per_head.transpose(0, 1), self.heads).transpose(0, 1),  # swapped
                torch.bmm(per_head.transpose(0, 1), self.heads),      # not seen as [T, H, N]: left
                F.linear(x, self.w, self.bias),                       # a bias: left
                F.linear(x32, self.fp32_w),                           # fp32: left
                torch.einsum("bhk,bkn->bhn", per_head.transpose(0, 1).contiguous()[:2], self.heads),  # another form
                torch.einsum("thk,hnk->thn", per_head, self.heads.transpose(1, 2)))  # weight's K last: left


def _graph(module, *inputs) -> fx.GraphModule:
    captured = []

    def backend(gm, example_inputs):
        captured.append(gm)
        return gm.forward
    torch.compile(module, backend=backend, fullgraph=True)(*inputs)
    normalize_meta(captured[0].graph)
    return captured[0]


def test_the_finder_matches_bias_free_half_precision_linears_and_per_head_products_only():
    gm = _graph(_Products(torch.bfloat16), torch.randn(3, 8).bfloat16(), torch.randn(3, 2, 8).bfloat16(), torch.randn(3, 8))
    sites = find_projection_sites(gm.graph, ("cpu",))
    assert [s.kind for s in sites] == ["linear", "heads", "heads"]
    assert sites[0].node.args[1].name.endswith("_w_") and sites[1].node.args[0] == "thk,hkn->thn"
    assert sites[2].operands[0].name == "l_per_head_" and sites[2].replaced[0].target is torch.bmm
    assert find_projection_sites(gm.graph, ("cuda",)) == []  # another device
    gm32 = _graph(_Products(torch.float32), torch.randn(3, 8), torch.randn(3, 2, 8), torch.randn(3, 8))
    assert find_projection_sites(gm32.graph, ("cpu",)) == []


def _model(dtype=torch.bfloat16):
    return MLAModel(preset("tiny").replace(layer_types=("mla", "linear", "mla")), kv_capacity=128, max_requests=4,
                    seed=7, dtype=dtype)


def _steps(model):
    table, outs = RequestTable(4, 96, 128), []
    prompts = [list(range(3, 3 + 70)), [8], [9, 10, 11]]  # 74 rows: past the kernel's 64
    outs.append(model(*table.extend_batch([0, 1, 2], prompts, pad_rows=1).args()))
    for step in range(2):
        outs.append(model(*table.extend_batch([0, 1, 2], [[12 + step], [13 + step], [14 + step]], pad_rows=1).args()))
    return outs


def test_the_reference_model_runs_its_projections_through_the_kernel_with_cublas_numbers(monkeypatch):
    # The torch reference attention (the interpreter would run the Triton attention for minutes).
    monkeypatch.setattr(TorchLowering, "passes", lambda self: [LowerProjections(devices=("cpu",))])
    baseline = _steps(dcp_compile.apply(_model(), 1, kernels="torch", disabled_passes=("lower_projections",),
                                        fuse_projections="on"))
    launches = []
    real = skinny_matmul.skinny_matmul_into
    monkeypatch.setattr(skinny_matmul, "skinny_matmul_into", lambda *a, **k: launches.append(a[1].shape[1]) or real(*a, **k))
    compiled = dcp_compile.apply(_model(), 1, kernels="torch", fuse_projections="on")
    got = _steps(compiled)
    for step, (a, b) in enumerate(zip(got, baseline)):
        scale = b.abs().max().item()
        assert (a - b).abs().max().item() <= 0.05 * scale, step  # bf16 matmuls rounded in another order
        assert torch.equal(a.argmax(-1), b.argmax(-1)), step
    state = dcp_compile.state(compiled)
    report = next(b.reports[-1] for b in state.backends.values() if b.reports)
    (record,) = [r for r in report.records if r.name == "lower_projections"]
    # per MLA layer: q_a+kv_a (fused), q_b, o_proj, gate+up (fused), down, and the W_UK / W_UV
    # per-head products (bmm); per linear-attention layer: q+k+v (fused), o_proj, gate+up, down; and the LM head
    mla, linear_attention = 5 + 2, 4
    assert record.sites == 2 * mla + linear_attention + 1
    assert record.ops_after.get("linear", 0) == 0 and record.ops_after.get("bmm", 0) == 0
    assert record.ops_after["dcp_triton::skinny_linear"] == record.ops_before["linear"]
    assert record.ops_after["dcp_triton::head_matmul"] == record.ops_before["bmm"] == 4
    assert launches and max(launches) <= skinny_matmul.MAX_ROWS  # decode rows ran the kernel; the prefill did not


def test_the_lowered_products_compile_under_inductor(monkeypatch):
    """The swapped ops under inductor: a prefill's rows (torch's product) and decode rows (the
    kernel) give cuBLAS's numbers. (The layouts the fakes promise are asserted op by op in
    tests/ops/test_skinny_matmul.py: CUDA's inductor checks them at run time.)"""
    want = _steps(dcp_compile.apply(_model(), 1, kernels="torch", fuse_projections="off"))[-2:]
    monkeypatch.setattr(TorchLowering, "passes", lambda self: [LowerProjections(devices=("cpu",))])
    compiled = dcp_compile.apply(_model(), 1, kernels="torch", inner_compile="inductor", fuse_projections="off")
    got = _steps(compiled)[-2:]
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() <= 0.05 * b.abs().max().item()


def test_auto_is_off_on_the_cpu_and_bad_values_are_refused():
    pool = _model(torch.float32).kv_pool
    assert TritonLowering().resolve_options(pool).skinny_matmuls == "off"
    assert TritonLowering().configured(TritonOptions("on")).resolve_options(pool).skinny_matmuls == "on"
    assert [p.enabled for p in FlashInferLowering().configured(TritonOptions("on")).passes()
            if isinstance(p, LowerProjections)] == [True]
    with pytest.raises(ValueError, match="skinny_matmuls must be one of"):
        TritonOptions(skinny_matmuls=True)
    with pytest.raises(ValueError, match="skinny_matmuls='on' is an option of kernels='triton'; kernels='torch' does not"):
        dcp_compile.apply(_model(torch.float32), 1, kernels="torch", skinny_matmuls="on")
