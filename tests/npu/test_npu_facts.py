"""bench.npu_facts, the probe a hardware owner runs first: on the stand-ins every fact that can
be checked here passes, and a stand-in made to depart from a fact is reported as FAIL with a
non-zero exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.lib import result as results

ROOT = Path(__file__).resolve().parents[2]


def _probe(*args):
    env = {k: v for k, v in os.environ.items() if k != "DCP_COMPILE_STANDIN_PLANT"}
    done = subprocess.run([sys.executable, "-m", "bench.npu_facts", "--standin", "--json", *args],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["schema"] == results.SCHEMA and result["benchmark"] == "npu_facts"
    return done.returncode, {**result["run"], "facts": results.rows(result, "facts")}, done.stderr


def test_every_fact_passes_on_the_standins(tmp_path):
    out = tmp_path / "facts.json"
    code, result, stderr = _probe("--out", str(out))
    assert code == 0, stderr
    statuses = {fact["name"]: fact["status"] for fact in result["facts"]}
    assert len(statuses) == 18 and result["failed"] == 0
    assert statuses == {**{name: "PASS" for name in statuses}, "torchair-symint-lengths": "SKIP"}  # needs torch_npu
    assert results.rows(results.read(out), "facts") == result["facts"]
    facts = {fact["name"]: fact["measured"] for fact in result["facts"]}
    assert facts["empty-shard-lse"]["lse_kv_len_0"] == [float("inf")]
    assert facts["lse-base"]["matches_base_e"] and not facts["lse-base"]["matches_base_2"]
    assert facts["strided-keys"]["standin_copies_of_strided_views"] == ["key", "value", "key_rope"]
    assert facts["native-step-on-device"]["ops_falling_back_to_the_cpu"] == []
    assert result["mode"] == "standin" and "| PASS" not in stderr and "FAIL" not in stderr


def test_a_planted_empty_shard_lse_is_reported_and_fails_the_run():
    code, result, stderr = _probe("--plant", "empty-shard-lse", "--only", "empty-shard-lse,lse-base")
    assert code == 1
    statuses = {fact["name"]: fact["status"] for fact in result["facts"]}
    assert statuses == {"empty-shard-lse": "FAIL", "lse-base": "PASS"}
    assert result["facts"][0]["measured"]["lse_kv_len_0"] == [float("-inf")]
    assert result["plant"] == "empty-shard-lse" and "FAIL" in stderr


def test_a_planted_nz_off_by_one_fails_the_nz_fact_only():
    code, result, stderr = _probe("--plant", "nz-off-by-one", "--only", "nz-cache,fia-v2-layouts")
    assert code == 1
    statuses = {fact["name"]: fact["status"] for fact in result["facts"]}
    assert statuses == {"nz-cache": "FAIL", "fia-v2-layouts": "PASS"}  # the ND v2 layouts read no NZ index
