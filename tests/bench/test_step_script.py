"""bench.step in its smoke mode (CPU, 2 tiny layers): the JSON a GPU run writes, with its floor
arithmetic checked against the shapes, and bench.report's table of it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.lib import result as results

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ("lowering", "inner_compile", "context", "batch", "k", "step_seconds", "floor_seconds", "fraction_of_floor",
          "compile_seconds")


def test_step_bench_smoke_writes_every_case_with_its_floor(tmp_path):
    out = tmp_path / "step.json"
    subprocess.run([sys.executable, "-m", "bench.step", "--smoke", "--out", str(out)], check=True, cwd=ROOT,
                   timeout=600, capture_output=True)
    result = results.read(out)
    assert result["schema"] == results.SCHEMA and result["benchmark"] == "step"
    assert result["command"].endswith(f"-m bench.step --smoke --out <local>/{out.name}")  # no path of this machine
    cases, run = results.rows(result), result["run"]
    assert [(r["k"], r["batch"]) for r in cases] == [(1, 2), (7, 2)]
    for row in cases:
        assert all(field in row for field in FIELDS) and "error" not in row
        assert row["step_seconds"] > 0 and row["compile_seconds"] > 0
        layers, batch, k = row["layers"], row["batch"], row["k"]
        assert row["kv_bytes"] == layers * batch * row["context"] * (512 + 64) * 2
        memory = (row["weight_bytes"] + row["kv_bytes"]) / run["copy_bytes_per_s"]
        compute = row["flops"] / run["matmul_flops_per_s"]
        assert row["floor_seconds"] == max(memory, compute)
        assert row["fraction_of_floor"] == row["floor_seconds"] / row["step_seconds"]
        assert row["flops"] > 2 * row["weight_bytes"] // 2 * batch * k  # 2 FLOPs a bf16 weight and token, and attention
    (compile_row,) = results.rows(result, "compile")
    assert compile_row["cold_seconds"] > 0 and compile_row["warm_seconds"] > 0
    report = subprocess.run([sys.executable, "-m", "bench.report", str(out)], check=True, cwd=ROOT,
                            capture_output=True, text=True).stdout
    assert "| torch + eager | 256 | 2 | 7 |" in report and "cold compile" in report


def test_profile_bench_smoke_sums_each_case_by_kernel_class(tmp_path):
    out = tmp_path / "profile.json"
    subprocess.run([sys.executable, "-m", "bench.profile_step", "--smoke", "--out", str(out)], check=True,
                   cwd=ROOT, timeout=600, capture_output=True)
    cases = results.rows(results.read(out))
    assert [(c["k"], c["batch"]) for c in cases] == [(1, 2), (3, 2)]
    for case in cases:
        for part in (case["step"], case["attention_layer_alone"]):
            assert part["step_seconds"] > 0 and part["kernels_per_step"] > 0
            assert sum(part["classes_seconds"].values()) == pytest.approx(part["kernel_seconds"])
            assert part["top_kernels"] and all(k["seconds_per_step"] >= 0 for k in part["top_kernels"])
    assert "compile_phases_seconds" in cases[0]
