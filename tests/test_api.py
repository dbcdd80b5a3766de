"""apply(): baseline behaviour and clear, early errors for bad input."""

from __future__ import annotations

import pytest
import torch

import dcp_compile
from dcp_compile import DCPConfig
from dcp_compile.models.config import preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.runtime.batch import RequestTable
from dcp_compile.runtime.parallel import ParallelState, validate_sizes


def _model(**kw):
    return MLAModel(preset("tiny"), kv_capacity=64, max_requests=2, **kw)


def test_dcp_size_one_is_the_plain_model():
    eager, compiled = _model(seed=3), dcp_compile.apply(_model(seed=3), 1)
    table_a, table_b = RequestTable(2, 16, 64), RequestTable(2, 16, 64)
    batch_a = table_a.extend_batch([0, 1], [[3, 4, 5], [6]], pad_rows=1)
    batch_b = table_b.extend_batch([0, 1], [[3, 4, 5], [6]], pad_rows=1)
    torch.testing.assert_close(compiled(*batch_b.args()), eager(*batch_a.args()), atol=0, rtol=0)
    summary = dcp_compile.state(compiled).pass_summary()
    assert summary["shard_kv_write"] == 0 and summary["gather_q_attention"] == 0


@pytest.mark.parametrize("dcp_size", [0, -1])
def test_dcp_size_below_one(dcp_size):
    with pytest.raises(ValueError, match="dcp_size"):
        dcp_compile.apply(_model(), dcp_size)


def test_dcp_size_must_divide_tp_size():
    with pytest.raises(ValueError, match="must divide tp_size"):
        validate_sizes(tp_size=4, dcp_size=3, world_size=4)
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        dcp_compile.apply(_model(), 2)  # one process, no process group: that is said first


def test_tp_size_must_divide_world():
    with pytest.raises(ValueError, match="divide the world size"):
        validate_sizes(tp_size=3, dcp_size=1, world_size=4)


def test_heads_that_tp_cannot_split():
    with pytest.raises(ValueError, match="heads do not split over tp_size 3"):
        _model(par=ParallelState(tp_size=3, tp_rank=0))


def test_model_without_mla_sites():
    with pytest.raises(ValueError, match="no MLA sites"):
        dcp_compile.apply(torch.nn.Linear(4, 4), 1)
    all_linear = MLAModel(preset("tiny").replace(layer_types=("linear", "linear")), kv_capacity=64)
    with pytest.raises(ValueError, match="no MLA sites"):
        dcp_compile.apply(all_linear, 1)


def test_unsupported_cache_dtype():
    with pytest.raises(TypeError, match="unsupported KV cache dtype"):
        _model(dtype=torch.float64)


def test_unknown_pass_name_in_config():
    with pytest.raises(ValueError, match="unknown pass"):
        dcp_compile.apply(_model(), 1, disabled_passes=("no_such_pass",))


@pytest.mark.parametrize("field,value", [("inner_compile", "tvm"), ("kernels", "cuda"), ("interleave", 0)])
def test_config_validation(field, value):
    with pytest.raises(ValueError, match=field):
        DCPConfig(**{field: value})


def test_out_of_range_location_is_caught_in_debug_mode():
    compiled = dcp_compile.apply(_model(), 1, debug_checks=True)
    batch = RequestTable(2, 16, 64).extend_batch([0], [[1, 2]])
    batch.out_loc[1] = 64  # the pool has locations 0..63
    with pytest.raises(IndexError, match="KV write location 64 is outside the pool"):
        compiled(*batch.args())


def test_model_contract_needs_parallel_state():
    model = _model()
    del model.parallel
    with pytest.raises(ValueError, match="parallel"):
        dcp_compile.apply(model, 1)


def test_positions_inconsistent_with_seq_lens_are_caught_in_debug_mode():
    compiled = dcp_compile.apply(_model(), 1, debug_checks=True)
    batch = RequestTable(2, 16, 64).extend_batch([0, 1], [[1, 2], [3]])
    batch.positions[1] = 5  # request 0 has 2 tokens
    with pytest.raises(ValueError, match="positions must lie in"):
        compiled(*batch.args())


def test_interleave_must_divide_page_size():
    with pytest.raises(ValueError, match="must divide the page size"):
        dcp_compile.apply(_model(), 1, interleave=4)
    model = MLAModel(preset("tiny"), kv_capacity=64, page_size=8)
    dcp_compile.apply(model, 1, interleave=4)
    assert model.kv_pool.interleave == 4


def test_unknown_attention_strategy():
    with pytest.raises(ValueError, match="attention_strategy"):
        dcp_compile.apply(_model(), 1, attention_strategy="gather-all")


def test_graph_runner_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from dcp_compile.runtime.graph_runner import GraphRunner

    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        GraphRunner(lambda *a: None)


def test_nccl_without_gpu_is_a_clear_error(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from dcp_compile.runtime.launch import init_from_env

    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="no CUDA GPU or NCCL"):
        init_from_env("nccl")


def test_inductor_inner_compile_matches_eager():
    """The rewritten graph also goes through inductor (custom ops, mutation, functional collectives)."""

    def run(inner):
        model = dcp_compile.apply(_model(seed=2), 1, inner_compile=inner, debug_checks=True)
        table = RequestTable(2, 16, 64)
        first = model(*table.extend_batch([0, 1], [[1, 2, 3], [4]], pad_rows=1).args())
        return first, model(*table.extend_batch([0, 1], [[5], [6]], pad_rows=1).args())

    for got, expected in zip(run("inductor"), run("eager")):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_inner_compile_auto_is_each_back_ends_fastest_measured():
    """auto: inductor for the CUDA kernels (bench/results/step_h200.json), eager elsewhere; apply records it."""
    from types import SimpleNamespace

    from dcp_compile.lowering import registry

    assert dcp_compile.DCPConfig().inner_compile == "auto"
    assert dcp_compile.state(dcp_compile.apply(_model(), 1)).config.inner_compile == "eager"  # a CPU pool
    cuda, cpu = SimpleNamespace(device=torch.device("cuda")), SimpleNamespace(device=torch.device("cpu"))
    assert {name: registry.get(name).inner_compile(cuda) for name in ("torch", "triton", "flashinfer", "npu")} == {
        "torch": "eager", "triton": "inductor", "flashinfer": "inductor", "npu": "eager"}
    assert {registry.get(name).inner_compile(cpu) for name in ("triton", "flashinfer")} == {"eager"}


def test_resharding_a_pool_that_holds_kv_is_an_error():
    """apply() on a model whose pool already holds KV used to wipe it silently."""
    model = _model()
    table = RequestTable(2, 16, 64)
    model(*table.extend_batch([0], [[3, 4, 5]]).args())  # eager: writes KV
    with pytest.raises(RuntimeError, match="already holds KV"):
        dcp_compile.apply(model, 1)


@pytest.mark.parametrize("fields, message", [
    (dict(dcp_size=True), "dcp_size must be an integer"),
    (dict(interleave=True), "interleave must be an integer"),
])
def test_bools_are_not_sizes(fields, message):
    with pytest.raises(ValueError, match=message):
        DCPConfig(**fields)


@pytest.mark.parametrize("args, message", [
    ((1, -8, 16, 8), "capacity must be >= 2"),
    ((1, 64, -16, 8), "kv_lora_rank must be >= 1"),
    ((1, 64, 16, 8.5), "rope_dim must be an int"),
])
def test_pool_sizes_are_checked(args, message):
    from dcp_compile.runtime.kv_pool import MLAKVPool

    with pytest.raises(ValueError, match=message):
        MLAKVPool(*args)


def test_an_unwritable_dump_folder_fails_at_apply(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("DCP_COMPILE_DUMP", str(blocker / "dump"))
    with pytest.raises(ValueError, match="cannot write to dump folder"):
        dcp_compile.apply(_model(), 1)
