"""fuse_projections: the projections that read one input become one matmul, on the reference
model's graph (op counts before and after), with the same numbers and the parameters turned into
views of the fused weight; what must not fuse."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dcp_compile
from dcp_compile.models.config import preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.passes import PassConfig
from dcp_compile.passes.fuse_projections import FuseProjections, bind_weights, find_projection_groups, finish_fusion
from dcp_compile.runtime.batch import RequestTable

HYBRID = ("mla", "linear", "mla")


def _model(seed=5, layer_types=HYBRID, dtype=torch.float32):
    return MLAModel(preset("tiny").replace(layer_types=layer_types), kv_capacity=128, max_requests=4, seed=seed, dtype=dtype)


def _steps(model):
    """Prefill of mixed lengths with a padded row, then two decode steps; the logits of each."""
    table, outs = RequestTable(4, 32, 128), []
    batch = table.extend_batch([0, 1, 2], [[3, 4, 5, 6, 7], [8], [9, 10, 11]], pad_rows=1)
    outs.append(model(*batch.args()))
    for step in range(2):
        batch = table.extend_batch([0, 1, 2], [[12 + step], [13 + step], [14 + step]], pad_rows=1)
        outs.append(model(*batch.args()))
    return outs


def _last_report(compiled):
    state = dcp_compile.state(compiled)
    return next(b.reports[-1] for b in state.backends.values() if b.reports)


def test_the_reference_model_fuses_q_a_with_kv_a_gate_with_up_and_q_k_v():
    model = _model()
    compiled = dcp_compile.apply(model, 1, fuse_projections="on")
    reference = _steps(dcp_compile.apply(_model(), 1, fuse_projections="off"))
    for got, want in zip(_steps(compiled), reference):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    (record,) = [r for r in _last_report(compiled).records if r.name == "fuse_projections"]
    # per MLA layer: q_a + kv_a, gate + up; per linear-attention layer: q, k, v and gate + up
    assert record.sites == 2 + 2 + 2
    linears = (record.ops_before["linear"], record.ops_after["linear"])
    assert linears[0] - linears[1] == 2 * (1 + 1) + (2 + 1)
    assert record.ops_after.get("aten::split_with_sizes", 0) - record.ops_before.get("aten::split_with_sizes", 0) == 6
    assert dcp_compile.state(compiled).config.fuse_projections == "on"


def test_the_parameters_become_views_of_the_fused_weight_with_their_values():
    model = _model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    compiled = dcp_compile.apply(model, 1, fuse_projections="on")
    _steps(compiled)
    attn, mlp = model.layers[0].attn, model.layers[0].mlp
    assert attn.q_a.untyped_storage().data_ptr() == attn.kv_a.untyped_storage().data_ptr()
    assert mlp.gate.untyped_storage().data_ptr() == mlp.up.untyped_storage().data_ptr()
    assert attn.kv_a.storage_offset() == attn.q_a.numel() and isinstance(attn.q_a, nn.Parameter)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert set(model.state_dict()) >= set(before)


def test_a_weight_updated_in_place_reaches_the_fused_matmul():
    fused, plain = _model(), _model()
    compiled = dcp_compile.apply(fused, 1, fuse_projections="on")
    baseline = dcp_compile.apply(plain, 1, fuse_projections="off")
    _steps(compiled), _steps(baseline)
    with torch.no_grad():
        for m in (fused, plain):
            m.layers[0].attn.kv_a.mul_(1.5)
            m.layers[2].mlp.up.add_(0.01)
    for got, want in zip(_steps(compiled), _steps(baseline)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_later_graph_fuses_the_packed_weights_without_copying():
    model = _model()
    compiled = dcp_compile.apply(model, 1, fuse_projections="on")
    _steps(compiled)
    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}
    torch._dynamo.reset()  # the next call compiles a new graph over the same parameters
    _steps(compiled)
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == pointers
    (record,) = [r for r in _last_report(compiled).records if r.name == "fuse_projections"]
    assert record.sites == 6


def test_auto_is_off_on_the_cpu():
    compiled = dcp_compile.apply(_model(), 1)
    assert dcp_compile.state(compiled).config.fuse_projections == "off"
    with pytest.raises(ValueError, match="fuse_projections must be one of"):
        dcp_compile.apply(_model(), 1, fuse_projections=True)


class _Projections(nn.Module):
    """Linears that must not fuse next to two that must."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a, self.b = (nn.Parameter(torch.randn(6, 8, generator=g)) for _ in range(2))
        self.wide = nn.Parameter(torch.randn(5, 12, generator=g))  # another input width
        self.biased = nn.Parameter(torch.randn(4, 8, generator=g))
        self.bias = nn.Parameter(torch.randn(4, generator=g))
        self.transposed = nn.Parameter(torch.randn(8, 3, generator=g))  # not contiguous as a [3, 8] weight
        self.other_input = nn.Parameter(torch.randn(7, 8, generator=g))

    def forward(self, x, y, z):
        return (F.linear(x, self.a), F.linear(x, self.b), F.linear(z, self.wide), F.linear(x, self.biased, self.bias),
                F.linear(x, self.transposed.t()), F.linear(y, self.other_input))


def _groups_of(module, *inputs):
    found = {}

    def backend(gm, example_inputs):
        bind_weights(gm, example_inputs)
        found["groups"] = [[n.args[1].name for n in g.linears] for g in find_projection_groups(gm)]
        found["sites"] = FuseProjections().run(gm, PassConfig(fuse_projections=True))
        gm.recompile()
        finish_fusion(gm)
        return gm.forward

    out = torch.compile(module, backend=backend, fullgraph=True)(*inputs)
    torch._dynamo.reset()
    return found, out


def test_only_bias_free_contiguous_linears_of_one_input_and_width_fuse():
    module = _Projections()
    x, y, z = torch.randn(3, 8), torch.randn(3, 8), torch.randn(3, 12)
    want = module(x, y, z)
    found, got = _groups_of(module, x, y, z)
    assert found["sites"] == 1 and len(found["groups"]) == 1 and len(found["groups"][0]) == 2
    assert module.a.untyped_storage().data_ptr() == module.b.untyped_storage().data_ptr()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_weights_an_earlier_unfused_graph_reads_stay_where_they_are():
    module = _Projections()
    x, y, z = torch.randn(3, 8), torch.randn(3, 8), torch.randn(3, 12)

    def unfused(gm, example_inputs):
        bind_weights(gm, example_inputs)  # what a graph compiled with the pass off records too
        return gm.forward

    torch.compile(module, backend=unfused, fullgraph=True)(x, y, z)
    torch._dynamo.reset()
    pointers = module.a.data_ptr(), module.b.data_ptr()
    found, _ = _groups_of(module, x, y, z)
    assert found["sites"] == 0 and (module.a.data_ptr(), module.b.data_ptr()) == pointers


def test_under_inductor_the_fused_model_matches_the_unfused_one_and_a_second_start_loads_the_aot_cache():
    """Inductor checks its example inputs against what dynamo traced: the parameters are pointed
    at the fused weight only after it compiled. A second start (a fresh model of other weights,
    dynamo reset) loads the compiled graph from AOTAutograd's cache: before the passes' nodes
    carried `example_value`, that cache refused the fused graph, and a warm start redid the
    whole AOT trace (23.6 s against 15.5 s for the 61-layer step on an H200)."""
    from torch._dynamo.utils import counters

    first = dcp_compile.apply(_model(seed=7), 1, fuse_projections="on", inner_compile="inductor")
    _steps(first)
    torch._dynamo.reset()
    counters.clear()
    model = _model()
    compiled = dcp_compile.apply(model, 1, fuse_projections="on", inner_compile="inductor")
    got = _steps(compiled)
    assert counters["aot_autograd"]["autograd_cache_hit"] >= 1
    assert counters["aot_autograd"]["autograd_cache_bypass"] == 0
    reference = _steps(dcp_compile.apply(_model(), 1, fuse_projections="off"))
    for g, want in zip(got, reference):
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-4)
    assert model.layers[0].attn.q_a.untyped_storage().data_ptr() == model.layers[0].attn.kv_a.untyped_storage().data_ptr()
