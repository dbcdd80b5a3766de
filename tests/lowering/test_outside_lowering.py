"""The lowering interface is real: a back end defined in the tests (reference_paged.py), with no
change to the package, declares its own options, KV layout and op, and serves attention at DCP 2
over gloo equal to dcp_size=1, through apply, the demo and the dump with its own flag; and the
dump's shape-only capture picks the strategy a real run picks (FlashInfer, chunks over 16)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dcp_compile
from dcp_compile.cli.main import main as cli_main
from dcp_compile.harness.scenario import Scenario, run_on_rank, summarize
from dcp_compile.lowering import registry
from dcp_compile.lowering.base import Unsupported
from dcp_compile.models.config import preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.runtime.launch import spawn
from tests.lowering import reference_paged

ROOT = Path(__file__).resolve().parents[2]
SPLIT = (("reference_paged_layout", "split"),)
SCENARIOS = [
    Scenario(kernels=reference_paged.NAME, dcp_size=2, tp_size=2, batch=5, contexts=(1, 3, 20, 50, 17), steps=3, seed=5),
    Scenario(kernels=reference_paged.NAME, mode="verify", draft_len=5, dcp_size=2, tp_size=2, batch=3,
             contexts=(2, 30, 9), steps=2, seed=6),
    Scenario(kernels="flashinfer", mode="extend", chunk=20, page_size=8, dcp_size=2, tp_size=2, batch=3,
             contexts=(30, 45, 3), steps=1, seed=7),
    Scenario(kernels=reference_paged.NAME, mode="verify", draft_len=4, dcp_size=2, tp_size=2, batch=4,
             contexts=(1, 3, 40, 17), steps=2, seed=8, pad_rows=1, options=SPLIT),
]


def _runs(rank: int, world: int) -> list[dict]:
    """Every scenario on this rank (the child imports this module, which registers the back end)."""
    return [run_on_rank(rank, world, scenario) for scenario in SCENARIOS]


def test_a_back_end_registered_outside_the_package_runs_dcp_equal_to_dcp_size_one():
    ranks = spawn(_runs, 2)
    for index in (0, 1, 3):
        result = summarize(SCENARIOS[index], [r[index] for r in ranks])
        assert result["finite"] and result["tokens_match"] and result["outputs_match"], result
        assert result["max_abs_diff"] < 1e-5
        assert result["pass_summary"]["lower_reference_paged"] > 0
        assert sum(result["tokens_stored_per_dcp_rank"]) == result["tokens_total"]
    extend = summarize(SCENARIOS[2], [r[2] for r in ranks])
    assert extend["tokens_match"] and extend["strategy_counts"]["gather-kv"] >= 1  # 20-token chunks: gather-kv
    split = summarize(SCENARIOS[3], [r[3] for r in ranks])
    assert split["kv_layout"] == "reference-split"  # its own option chose its own layout
    assert split["pass_summary"]["split_kv_cache"] > 0

    state = dcp_compile.DCPConfig(kernels=reference_paged.NAME)
    assert state.kernels == reference_paged.NAME  # the config takes a registered name


def test_its_options_and_layout_are_its_own():
    model = MLAModel(preset("tiny"), 512, max_requests=2, page_size=128)
    applied = dcp_compile.apply(model, 1, kernels=reference_paged.NAME, reference_paged_layout="split")
    state = dcp_compile.state(applied)
    assert state.config.options == reference_paged.ReferencePagedOptions("split")
    assert isinstance(model.kv_pool.layout, reference_paged.ReferenceSplitLayout)
    assert [tuple(part.shape) for part in model.kv_pool.parts(0)] == [(512, 32), (512, 8)]
    assert registry.option_owners("reference_paged_layout") == [reference_paged.NAME]
    with pytest.raises(ValueError, match="reference_paged_layout='split' is an option of kernels='reference-paged'; "
                                         "kernels='torch' does not read it"):
        dcp_compile.apply(MLAModel(preset("tiny"), 512, max_requests=2), 1, kernels="torch",
                          reference_paged_layout="split")
    with pytest.raises(ValueError, match="reference_paged_layout must be one of"):
        reference_paged.ReferencePagedOptions("nz")
    with pytest.raises(ValueError, match="are not kernels='torch''s"):  # another back end's Options, whole
        dcp_compile.apply(MLAModel(preset("tiny"), 512, max_requests=2), 1, kernels="torch",
                          options=reference_paged.ReferencePagedOptions("split"))
    with pytest.raises(Unsupported, match="its graphs run under inner_compile 'eager' or 'inductor', not 'torchair'"):
        dcp_compile.apply(MLAModel(preset("tiny"), 512, max_requests=2, page_size=128), 1, kernels=reference_paged.NAME,
                          inner_compile="torchair")


def _cli(*args: str) -> subprocess.CompletedProcess:
    """The CLI in a fresh process, which finds the back end through DCP_COMPILE_BACKENDS."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), registry.PLUGINS_ENV: "tests.lowering.reference_paged"}
    return subprocess.run([sys.executable, "-m", "dcp_compile.cli.main", *args], capture_output=True, text=True, env=env,
                          timeout=600, cwd=ROOT)


def test_demo_and_dump_take_its_flag(tmp_path):
    demo = _cli("demo", "--kernels", reference_paged.NAME, "--reference-paged-layout", "split", "--batch", "3",
                "--context", "1,3,40", "--steps", "2", "--layers", "2", "--json")
    assert demo.returncode == 0, demo.stderr[-3000:]
    result = json.loads(demo.stdout.strip().splitlines()[-1])
    assert result["tokens_match"] and result["outputs_match"] and result["dcp_size"] == 2
    assert result["kv_layout"] == "reference-split" and result["max_abs_diff"] < 1e-5
    dump = _cli("dump", "--kernels", reference_paged.NAME, "--reference-paged-layout", "split", "--dcp-size", "2",
                "--layers", "2", "--out", str(tmp_path))
    assert dump.returncode == 0, dump.stderr[-3000:]
    report = json.loads((tmp_path / "dump.json").read_text())
    assert "--reference-paged-layout split" in report["command"]
    lowered = (tmp_path / "graph00").glob("*-split_kv_cache.after.py")
    text = next(lowered).read_text()
    assert "tests_reference_paged.attention" in text and "dcp_kv_latent_0" in text


def test_dump_picks_the_strategy_a_real_run_picks(tmp_path):
    """FlashInfer at DCP 2 serves at most 16 queries a row: a 20-token chunk goes to gather-kv,
    in the dump's capture as in the real run above."""
    assert cli_main(["dump", "--kernels", "flashinfer", "--mode", "extend", "--chunk", "20", "--context", "30",
                     "--dcp-size", "2", "--page-size", "8", "--layers", "1", "--dtype", "float32",
                     "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "dump.json").read_text())
    assert report["attention_strategy"]["strategy"] == "gather-kv", report["attention_strategy"]


def test_auto_checks_options_against_the_devices_back_ends():
    """kernels='auto' with a back-end option: the demo's early check takes the back end 'auto'
    falls back to on the device (triton on CUDA, whose options FlashInfer shares), not torch."""
    from dcp_compile.workload import Workload

    class OnCuda(Workload):
        device_type = "cuda"

    assert registry.auto_choices("cuda") == ("flashinfer", "triton")
    assert OnCuda(options={"skinny_matmuls": "off"}).lowering().name == "triton"
    with pytest.raises(ValueError, match="is an option of kernels='triton'; kernels='torch' does not read it"):
        Workload(options={"skinny_matmuls": "off"})
    assert dcp_compile.DCPConfig(options={"b": 1, "a": 2}) == dcp_compile.DCPConfig(options=(("b", 1), ("a", 2)))
    with pytest.raises(ValueError, match="hashable"):
        dcp_compile.DCPConfig(options={"a": [1]})
