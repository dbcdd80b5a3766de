"""bench.lib.result's reader on the committed results: those written before the one schema are
read into it with every figure kept, each prints its tables, and issue 10's targets come out of
bench.lowerings' and bench.dcp_step's results together."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from bench.lib import result as results
from bench.lib import tables

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = sorted((ROOT / "bench" / "results").glob("*.json"))


def _leaves(value) -> Counter:
    """Every scalar of a JSON value, wherever it sits (as JSON text, so NaN counts like any figure)."""
    if isinstance(value, dict):
        return sum((_leaves(v) for v in value.values()), Counter())
    if isinstance(value, list):
        return sum((_leaves(v) for v in value), Counter())
    return Counter([json.dumps(value)])


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.name)
def test_a_committed_result_reads_into_the_schema_with_every_figure(path):
    raw = json.loads(path.read_text())
    result = results.read(path)
    assert result["schema"] == results.SCHEMA and set(result) == {
        "schema", "benchmark", "command", "date", "machine", "versions", "run", "rows"}
    assert result["benchmark"] in tables.TABLES or result["benchmark"] in {
        "attention_sweep", "batch_guard", "compile_regions", "decode_gemms", "hf_compile_regions", "load_test", "location_guard", "npu_replay_h2d", "npu_verify_cost", "rebuild_memory",
        "skinny_matmul", "verify_window"}
    assert all(isinstance(row["part"], str) for row in result["rows"])
    missing = _leaves(raw) - _leaves(result)
    assert not missing, f"figures lost reading {path.name}: {missing}"
    assert results.upgrade(result) is result
    assert tables.lines(result)


def test_the_benchmarks_of_the_committed_results():
    names = {path.name: results.read(path)["benchmark"] for path in COMMITTED}
    assert names["step_h200.json"] == names["step_fuse_h200.json"] == "step"  # merged runs: named by their commands
    assert names["step_profile_h200.json"] == "profile_step"
    assert names["lowerings_triton_request_path_h200.json"] == "lowerings"
    assert names["npu_verify_cost.json"] == "npu_verify_cost" and names["load_test_cpu.json"] == "load_test"


def test_a_result_of_another_schema_is_refused():
    with pytest.raises(ValueError, match="is not 'dcp_compile.bench/1'"):
        results.upgrade({"schema": "dcp_compile.bench/0", "rows": []})


def test_a_new_result_records_the_command_and_the_parts():
    result = results.start("kernels", ["--out", "x.json"])
    results.add(result, "attention", {"heads": 32, "seconds": 1e-4})
    results.add(result, results.MAIN, {"batch": 4})
    assert result["command"].endswith("-m bench.kernels --out x.json")
    assert results.rows(result, "attention") == [{"heads": 32, "seconds": 1e-4}]
    assert results.parts(result) == ["attention", "cases"] and result["versions"]["torch"]


def test_a_written_result_names_no_path_of_its_machine(tmp_path):
    """write() keeps a path in the repository relative to it, an installed package's under
    <site-packages>, and any other absolute path as <local>/ and its last part."""
    result = results.start("step", ["--out", "/root/out/r/step.json", "--table", str(ROOT / "bench/results/x.json")])
    result["run"].update(cache="/tmp/dcp_step_inductor_k0sfqx7s", warning="/opt/venv/lib/python3.12/site-packages/torch/x.py:3",
                         url="https://example.org/a/b", ratio="3/4")
    results.write(result, tmp_path / "step.json")
    written = json.loads((tmp_path / "step.json").read_text())
    assert written["command"].endswith("-m bench.step --out <local>/step.json --table bench/results/x.json")
    assert written["run"] == dict(cache="<local>/dcp_step_inductor_k0sfqx7s", warning="<site-packages>/torch/x.py:3",
                                  url="https://example.org/a/b", ratio="3/4")


def test_no_committed_result_or_log_names_a_path_of_its_machine():
    texts = {path: path.read_text() for path in sorted((ROOT / "bench" / "results").rglob("*"))
             if path.is_file() and path.suffix != ".png"}
    assert len(texts) > 50
    local = [str(path.relative_to(ROOT)) for path, text in texts.items() if results.portable(text) != text]
    assert not local, f"local paths in {local}: python -m bench.lib.result bench/results rewrites them"


def test_the_report_prints_the_speed_targets_across_two_results():
    done = subprocess.run([sys.executable, "-m", "bench.report", "bench/results/lowerings_h200.json",
                           "bench/results/dcp_step_h200x2.json"], capture_output=True, text=True, check=True, cwd=ROOT)
    assert "| 32 | 4 | 1 | memory | 141 | 363, 39%, 39% | 165, 85%, 85% |" in done.stdout
    assert "| layer DCP2/DCP1 <= 0.55 (decode, 128k, batch 64) |" in done.stdout
