"""Compile regions (dcp_compile/regions.py) in one process: a model whose decoder layers are
nested_compile_region calls runs the passes and the lowering once per kind of layer and gives the
logits of the same model without regions; the cache rule holds inside a region; a step's batch
inputs that a graph runner may skip are the same with and without regions. DCP 2 against
dcp_size 1: tests/distributed/test_regions.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dcp_compile
from dcp_compile import regions
from dcp_compile.models import mla
from dcp_compile.models.config import MoEConfig, preset
from dcp_compile.models.mla import MLAModel
from dcp_compile import ops
from dcp_compile.passes.cache_use import CacheMisuseError, check_cache_use
from dcp_compile.runtime.batch import RequestTable
from dcp_compile.runtime.graph_runner import unread_inputs

PAGE = 4
PROMPTS = [[1], [2] * 9, [3] * 30, [4] * 2, [5] * 17]
DECODE_ROWS = [[0, 1, 2, 3, 4], [1, 3], [4], [0, 2, 3]]


def _models(kernels: str, inner: str = "eager"):
    """The tiny hybrid model (three MLA layers, one linear-attention layer) with regions under the
    inner compiler `inner`, and without regions under eager FX (the reference logits: a second
    inductor compile of the whole step would double the test's time and check nothing more)."""
    return [dcp_compile.apply(MLAModel(preset("tiny"), 2048, max_requests=5, page_size=PAGE, regions=on), 1,
                              kernels=kernels, inner_compile=inner if on else "eager") for on in (True, False)]


def _reports(model):
    return [r for backend in dcp_compile.state(model).backends.values() for r in backend.reports]


@pytest.mark.parametrize("kernels,inner", [("flashinfer", "inductor")])  # torch, eager: tests/distributed/test_regions.py
def test_a_regional_model_gives_the_plain_models_logits_from_one_lowering_of_its_layer(kernels, inner):
    regional, plain = _models(kernels, inner)
    tables = [RequestTable(5, 64, 2048, PAGE) for _ in range(2)]
    outputs = []
    for model, table in zip((regional, plain), tables):
        prefill = table.extend_batch(list(range(5)), PROMPTS)
        outputs.append([model(*prefill.args(), host_metadata=prefill.host)])
        for step, rows in enumerate(DECODE_ROWS):
            batch = table.extend_batch(rows, [[10 + step]] * len(rows))
            outputs[-1].append(model(*batch.args(), host_metadata=batch.host))
    for got, want in zip(*outputs):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # In each graph (the prefill's, the decode steps'), the three MLA layers share one lowering
    # (two where dynamo traces the first call of a region apart, torch 2.10).
    assert len(_reports(regional)) == len(_reports(plain)) >= 1
    if kernels == "flashinfer":
        assert {r.sites("lower_flashinfer_attention") for r in _reports(plain)} == {3}
        assert max(r.sites("lower_flashinfer_attention") for r in _reports(regional)) <= 2


def test_asked_to_fuse_projections_a_regional_model_leaves_its_weights_and_compiles_every_graph(caplog):
    """fuse_projections='on' does not apply inside regions: the fused parameters would be views of
    one weight, which invoke_subgraph refuses as a region's inputs at the next graph's trace."""
    regional = MLAModel(preset("tiny"), 2048, max_requests=5, page_size=PAGE, regions=True)
    pointers = {name: p.data_ptr() for name, p in regional.named_parameters()}
    models = [dcp_compile.apply(MLAModel(preset("tiny"), 2048, max_requests=5, page_size=PAGE), 1, kernels="torch",
                                fuse_projections="off"),
              dcp_compile.apply(regional, 1, kernels="torch", fuse_projections="on")]
    outputs = []
    with caplog.at_level("INFO", logger="dcp_compile"):
        for model in models:
            table = RequestTable(5, 64, 2048, PAGE)
            prefill = table.extend_batch(list(range(5)), PROMPTS)
            outputs.append([model(*prefill.args(), host_metadata=prefill.host)])
            if model is models[1]:
                torch._dynamo.reset()  # a new trace over the parameters the first compile saw
            batch = table.extend_batch(DECODE_ROWS[0], [[10]] * len(DECODE_ROWS[0]))
            outputs[-1].append(model(*batch.args(), host_metadata=batch.host))
    for got, want in zip(*outputs):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len(_reports(models[1])) == 2 and {r.sites("fuse_projections") for r in _reports(models[1])} == {0}
    assert {name: p.data_ptr() for name, p in regional.named_parameters()} == pointers
    assert "not inside compile regions" in caplog.text


def test_a_layer_kind_called_once_stays_a_region():
    """One dense MLA layer, then MoE ones (Kimi-K2's and Moonlight's first_k_dense_replace = 1):
    the dense layer's region has one call, which torch 2.13 would inline into the step (its MLA
    site then outside every region, refused); it stays a region, and the logits are the plain
    model's. Each kind of layer is lowered once: two FlashInfer sites, against one a layer."""
    cfg = dataclasses.replace(preset("tiny"), layer_types=("mla",) * 4,
                              moe=MoEConfig(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                            n_shared_experts=1, first_k_dense_replace=1))
    outputs, sites = [], []
    for on in (True, False):
        model = dcp_compile.apply(MLAModel(cfg, 512, max_requests=3, page_size=PAGE, regions=on), 1,
                                  kernels="flashinfer")
        table = RequestTable(3, 64, 512, PAGE)
        batch = table.extend_batch([0, 1, 2], [[1, 2], [3] * 9, [4]])
        step = [model(*batch.args(), host_metadata=batch.host)]
        batch = table.extend_batch([0, 2], [[5], [6]])
        step.append(model(*batch.args(), host_metadata=batch.host))
        outputs.append(step)
        sites.append({r.sites("lower_flashinfer_attention") for r in _reports(model)})
    for got, want in zip(*outputs):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # two kinds, one lowering each (three where dynamo traces a region's first call apart, torch 2.10)
    assert max(sites[0]) <= 3 and sites[1] == {4}
    # kept for the compiled steps only: the process's other compiles keep dynamo's setting
    assert getattr(torch._dynamo.config, "inline_single_use_invoke_subgraph", True)


def test_npu_regions_give_each_layer_its_own_kv_parts_and_skip_what_the_plain_step_skips(npu_emulator):
    """The NPU lowering keeps a layer's latent and rope rows as two tensors (the split layout),
    which a region's calls pass each their own; it reads the page table and lengths from the
    host, so its graphs leave them unread, while the linear-attention layer and the code around
    the regions read the others: a runner must copy those with regions as without."""
    skipped, outputs = [], []
    for on in (True, False):
        model = dcp_compile.apply(MLAModel(preset("tiny-512"), 2048, max_requests=5, page_size=16,
                                           dtype=torch.bfloat16, device=npu_emulator, regions=on), 1, kernels="npu")
        table = RequestTable(5, 64, 2048, 16)
        prefill = table.extend_batch(list(range(5)), PROMPTS)
        outputs.append([model(*prefill.to(npu_emulator).args(), host_metadata=prefill.host)])
        skipped.append(unread_inputs(dcp_compile.state(model).host_slot.fed))
        for step, rows in enumerate(DECODE_ROWS[:2]):
            batch = table.extend_batch(rows, [[10 + step]] * len(rows))
            outputs[-1].append(model(*batch.to(npu_emulator).args(), host_metadata=batch.host))
    for got, want in zip(*outputs):
        torch.testing.assert_close(got.cpu(), want.cpu(), atol=1e-5, rtol=1e-5)
    assert skipped[0] == skipped[1] and "req_to_token" in skipped[0] and "positions" not in skipped[0], skipped


def test_mla_layers_inside_and_outside_regions_are_refused(monkeypatch):
    model = MLAModel(preset("tiny"), 2048, max_requests=5, page_size=PAGE, regions=True)
    region = mla._layer_region
    monkeypatch.setattr(mla, "_layer_region", lambda layer, *args: layer(*args) if layer is model.layers[-1]
                        else region(layer, *args))
    applied = dcp_compile.apply(model, 1, kernels="torch", inner_compile="eager")
    prefill = RequestTable(5, 64, 2048, PAGE).extend_batch(list(range(5)), PROMPTS)
    with pytest.raises(ValueError, match="outside its compile regions"):
        applied(*prefill.args(), host_metadata=prefill.host)


# --- the cache rule inside a region ---------------------------------------------------------------


@torch.compiler.nested_compile_region
def _writes(cache, latent, rope, loc):
    ops.mla_kv_write(cache, latent, rope, loc)
    return latent + 1


@torch.compiler.nested_compile_region
def _indexes(cache, latent, rope, loc):
    cache[loc] = torch.cat([latent, rope], dim=-1)
    return latent + 1


def _check(layer, caches, operands):
    """Capture `layer` called once per operand (cache or not) and run the cache rule over it."""
    def step(latent, rope, loc, *tensors):
        for tensor in tensors:
            latent = layer(tensor, latent, rope, loc)
        return latent

    def backend(gm, example_inputs):
        check_cache_use(gm.graph, example_inputs, caches, regions=regions.find_regions(gm))
        return gm.forward

    latent, rope, loc = torch.randn(2, 8), torch.randn(2, 4), torch.tensor([1, 2])
    try:
        torch.compile(step, backend=backend, fullgraph=True)(latent, rope, loc, *operands)
    except torch._dynamo.exc.BackendCompilerFailed as exc:
        raise exc.inner_exception from None


def test_the_cache_rule_holds_inside_a_region():
    torch._dynamo.reset()
    caches = [torch.zeros(8, 12), torch.zeros(8, 12)]
    _check(_writes, caches, caches)  # each layer's cache through the canonical write: allowed
    with pytest.raises(CacheMisuseError, match="only dcp_compile.ops.mla_kv_write"):
        _check(_indexes, caches, caches)
    with pytest.raises(CacheMisuseError, match="in some of its calls and not in others"):
        _check(_writes, caches, [caches[0], torch.zeros(8, 12)])


# --- what moves out of a region -------------------------------------------------------------------


@torch.compiler.nested_compile_region
def _accumulates(x, lens, state):
    scale = lens.float() + 1  # the same in every call: moves out
    state.add_(x)  # a layer's own state, written
    seen = state * 2  # reads what the region writes: stays
    return seen * scale[:, None] + x


def test_what_every_call_computes_alike_runs_once_and_state_stays_in_the_region():
    torch._dynamo.reset()
    moved = []

    def step(x, lens, *states):
        for state in states:
            x = _accumulates(x, lens, state)
        return x

    def backend(gm, example_inputs):
        found = regions.find_regions(gm)
        written = regions.written_operands(gm, found)
        for region in map(regions.own_region, found):
            holders = region.placeholders()
            common = region.common_operands()
            invariant = {holders[i]: v for i, v in common.items() if isinstance(v, torch.fx.Node) and v not in written}
            hoisted = regions.hoist_invariants(gm, region, invariant)
            moved.extend(str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method"))
            sources = [holders.index(h) if h in holders else hoisted[h] for h in region.placeholders()]
            regions.replace_calls(gm, region, region.module.forward, sources)
        gm.recompile()
        return gm.forward

    x, lens = torch.randn(3, 4), torch.tensor([1, 2, 3])
    states, reference = [torch.zeros(3, 4) for _ in range(3)], [torch.zeros(3, 4) for _ in range(3)]
    got = torch.compile(step, backend=backend, fullgraph=True)(x, lens, *states)
    torch.testing.assert_close(got, step(x, lens, *reference))
    for state, want in zip(states, reference):  # every call wrote its own state
        torch.testing.assert_close(state, want)
    assert "float" in moved and not any("add_" in name or "mul" in name for name in moved), moved
