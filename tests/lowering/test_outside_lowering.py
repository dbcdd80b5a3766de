"""The lowering interface is real: a back end defined in the tests (reference_paged.py), with no
change to the package, serves attention at DCP 2 over gloo, equal to dcp_size=1; and the
dump's shape-only capture picks the strategy a real run picks (FlashInfer, chunks over 16)."""

from __future__ import annotations

import json

import dcp_compile
from dcp_compile.cli.main import main as cli_main
from dcp_compile.harness.scenario import Scenario, run_on_rank, summarize
from dcp_compile.runtime.launch import spawn
from tests.lowering import reference_paged

SCENARIOS = [
    Scenario(kernels=reference_paged.NAME, dcp_size=2, tp_size=2, batch=5, contexts=(1, 3, 20, 50, 17), steps=3, seed=5),
    Scenario(kernels=reference_paged.NAME, mode="verify", draft_len=5, dcp_size=2, tp_size=2, batch=3,
             contexts=(2, 30, 9), steps=2, seed=6),
    Scenario(kernels="flashinfer", mode="extend", chunk=20, page_size=8, dcp_size=2, tp_size=2, batch=3,
             contexts=(30, 45, 3), steps=1, seed=7),
]


def _runs(rank: int, world: int) -> list[dict]:
    """Every scenario on this rank (the child imports this module, which registers the back end)."""
    return [run_on_rank(rank, world, scenario) for scenario in SCENARIOS]


def test_a_back_end_registered_outside_the_package_runs_dcp_equal_to_dcp_size_one():
    ranks = spawn(_runs, 2)
    for index in (0, 1):
        result = summarize(SCENARIOS[index], [r[index] for r in ranks])
        assert result["finite"] and result["tokens_match"] and result["outputs_match"], result
        assert result["max_abs_diff"] < 1e-5
        assert result["pass_summary"]["lower_reference_paged"] > 0
        assert sum(result["tokens_stored_per_dcp_rank"]) == result["tokens_total"]
    extend = summarize(SCENARIOS[2], [r[2] for r in ranks])
    assert extend["tokens_match"] and extend["strategy_counts"]["gather-kv"] >= 1  # 20-token chunks: gather-kv

    state = dcp_compile.DCPConfig(kernels=reference_paged.NAME)
    assert state.kernels == reference_paged.NAME  # the config takes a registered name


def test_dump_picks_the_strategy_a_real_run_picks(tmp_path):
    """FlashInfer at DCP 2 serves at most 16 queries a row: a 20-token chunk goes to gather-kv,
    in the dump's capture as in the real run above."""
    assert cli_main(["dump", "--kernels", "flashinfer", "--mode", "extend", "--chunk", "20", "--context", "30",
                     "--dcp-size", "2", "--page-size", "8", "--layers", "1", "--dtype", "float32",
                     "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "dump.json").read_text())
    assert report["attention_strategy"]["strategy"] == "gather-kv", report["attention_strategy"]
