"""`dcp-compile doctor --device npu`, the command a hardware owner runs first: on the emulated
device every check passes or skips with a reason, each with its source; a stand-in made to depart
from a fact FAILs that check (exit 1) and makes the settings it gates unsafe; bad flags exit 2 with
one line; and the checks of the machine around the ops (HCCL's expansion mode, the driver version)
judge what they read."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dcp_compile.cli.main import main
from dcp_compile.doctor import npu as doctor
from dcp_compile.doctor.npu import environment, options
from dcp_compile.doctor.npu.checks import Context, Result
from dcp_compile.runtime.devices import EMULATOR_ENV
from dcp_compile.testing.npu_standin import PLANT_ENV

ROOT = Path(__file__).resolve().parents[2]
SKIPPED_ON_THE_EMULATOR = {"torchair-symint-lengths": "needs torchair", "driver-version": "no Ascend driver"}


def _doctor(capsys, *flags) -> tuple[int, dict]:
    code = main(["doctor", "--device", "npu", "--json", *flags])
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_every_check_passes_or_skips_on_the_emulator_with_its_source(tmp_path):
    """The run CI makes: a process of its own, as a hardware owner types it."""
    out = tmp_path / "doctor.json"
    env = {name: value for name, value in os.environ.items() if name != PLANT_ENV} | {EMULATOR_ENV: "1"}
    done = subprocess.run([sys.executable, "-m", "dcp_compile.cli.main", "doctor", "--device", "npu", "--json",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == report and report["schema"] == doctor.SCHEMA
    assert report["mode"] == "emulator" and report["exit_status"] == 0 and report["plant"] is None
    checks = {check["name"]: check for check in report["checks"]}
    assert list(checks) == doctor.names()
    for name, check in checks.items():
        assert check["source"]["doc"].startswith("docs/ascend.md §") and check["source"]["upstream"], name
        assert check["verdict"] == ("SKIP" if name in SKIPPED_ON_THE_EMULATOR else "PASS"), (name, check)
        assert name in done.stderr
    for name, reason in SKIPPED_ON_THE_EMULATOR.items():
        assert reason in checks[name]["detail"]
    measured = {name: check["measured"] for name, check in checks.items()}
    assert measured["empty-shard-lse"]["lse_kv_len_0"] == [float("inf")]
    assert measured["lse-base"]["matches_base_e"] and not measured["lse-base"]["matches_base_2"]
    assert measured["strided-keys"]["standin_copies_of_strided_views"] == ["key", "value", "key_rope"]
    assert measured["native-step-on-device"]["ops_falling_back_to_the_cpu"] == []
    assert measured["fia-update-count"]["2 dicts for 3 calls (must be refused)"].startswith("refused")
    assert measured["kv-write-int32-slots"]["int32_rows_wrong"] == []
    assert set(measured["hccl-in-graphs"]) == {"rank0_all_gather", "rank0_all_to_all", "rank1_all_gather",
                                               "rank1_all_to_all"}
    settings = {row["setting"]: row for row in report["settings"]}
    assert {name for name, row in settings.items() if row["verdict"] != "safe"} == {
        "--graphs", "inner_compile='torchair'", "npu_kernels='triton'"}  # a skipped check's, or no check's
    assert report["recommended"] == {"npu_kernels": "native", "npu_kv_format": "nd", "fia_version": 1,
                                     "npu_verify": "split", "fia_block_sizes": "cann-2025"}
    assert report["deployment"]["soc"] == "Ascend910B3" and report["summary"]["failed"] == 0
    assert not re.search(r"│ +(FAIL|unsafe) +│", done.stderr) and "0 FAIL" in done.stderr


def test_a_planted_empty_shard_lse_fails_its_check_only_and_exits_1(capsys):
    code, report = _doctor(capsys, "--plant", "empty-shard-lse", "--only", "empty-shard-lse,lse-base")
    assert code == 1 and report["exit_status"] == 1 and report["plant"] == "empty-shard-lse"
    checks = {check["name"]: check for check in report["checks"]}
    assert {name: check["verdict"] for name, check in checks.items()} == {"empty-shard-lse": "FAIL", "lse-base": "PASS"}
    assert checks["empty-shard-lse"]["measured"]["lse_kv_len_0"] == [float("-inf")]
    assert PLANT_ENV not in os.environ  # the plant lasts for the run only


def test_a_planted_nz_off_by_one_fails_the_nz_check_and_makes_the_nz_cache_unsafe(capsys):
    code, report = _doctor(capsys, "--plant", "nz-off-by-one", "--only", "nz-cache,fia-v2-layouts,kv-write-pa-nz")
    assert code == 1
    verdicts = {check["name"]: check["verdict"] for check in report["checks"]}
    assert verdicts == {"nz-cache": "FAIL", "fia-v2-layouts": "PASS", "kv-write-pa-nz": "PASS"}  # FIA's read only
    settings = {row["setting"]: row for row in report["settings"]}
    assert settings["npu_kv_format='nz'"]["verdict"] == "unsafe"
    assert settings["npu_kv_format='nz'"]["unsafe"] == ["nz-cache FAILed (docs/ascend.md §11.4, §15.1)"]
    assert settings["npu_kv_format='nd'"]["verdict"] == "safe" and report["recommended"]["npu_kv_format"] == "nd"


@pytest.mark.parametrize("flags, error", [
    ([], "the following arguments are required: --device"),
    (["--device", "cuda"], "argument --device: invalid choice: 'cuda'"),
    (["--device", "npu", "--only", "lse-base,no-such-check"], "unknown checks ['no-such-check']"),
    (["--device", "npu", "--plant", "no-such-plant"], "--plant 'no-such-plant': choose one of"),
    (["--device", "npu", "--out", "/no/such/folder/doctor.json"], "must name a file in an existing folder"),
    (["--device", "npu", "--plant", "empty-shard-lse", "without the emulator"], "it needs the emulated device"),
    (["--device", "npu", "without the emulator"], "torch_npu is not installed here"),
])
def test_bad_input_exits_2_with_one_line(capsys, monkeypatch, flags, error):
    if flags and flags[-1] == "without the emulator":
        flags = flags[:-1]
        monkeypatch.delenv(EMULATOR_ENV)
    assert main(["doctor", *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("dcp-compile doctor: error: ") and error in captured.err


def test_every_check_has_its_sources_and_gates_known_settings_and_is_listed_in_the_docs():
    table = (ROOT / "docs" / "ascend.md").read_text().split("### §20.1", 1)[1].split("\n### ", 1)[0]
    listed = re.findall(r"^\| `([a-z0-9-]+)` \|", table, flags=re.MULTILINE)
    assert listed == doctor.names()
    for check in doctor.CHECKS:
        assert check.doc.startswith("§") and check.upstream and check.relies, check.name
        assert set(check.gates) <= set(options.known_settings()), check.name


def _expansion(captures: dict[str, str]) -> Result:
    context = Context(device=None, emulated=True, results={name: Result(name, "", {}, verdict) for name, verdict
                                                           in captures.items()})
    result = Result("hccl-expansion-mode", "", {})
    environment.check_hccl_expansion_mode(result, context)
    return result


def test_the_hccl_expansion_mode_is_judged_by_this_runs_captures(monkeypatch):
    both = dict.fromkeys(environment.HCCL_CAPTURE_CHECKS, "PASS")
    monkeypatch.setenv(environment.EXPANSION_ENV, "aiv")
    assert _expansion({}).verdict == "PASS"
    monkeypatch.delenv(environment.EXPANSION_ENV)
    passed = _expansion(both)
    assert passed.verdict == "PASS" and "507903" in passed.detail
    failed = _expansion({**both, "hccl-in-graphs": "FAIL"})
    assert failed.verdict == "FAIL" and "export HCCL_OP_EXPANSION_MODE=AIV" in failed.detail
    monkeypatch.setenv(environment.EXPANSION_ENV, "HOST")
    unjudged = _expansion({})
    assert unjudged.verdict == "SKIP" and "HCCL_OP_EXPANSION_MODE=HOST" in unjudged.detail


def test_the_driver_version_is_read_where_torch_npu_or_the_driver_keeps_it_and_compared_with_hdk_25_5_1(tmp_path):
    info = tmp_path / "version.info"
    info.write_text("Version=24.1.rc2\nascendhal_version=7.35.19\n")
    assert environment.driver_version(lambda: "25.5.1", info, "no-such-npu-smi") == (
        "25.5.1", 'torch.npu.utils.get_cann_version(module="DRIVER")')
    assert environment.driver_version(lambda: "", info, "no-such-npu-smi") == ("24.1.rc2", str(info))
    version, why = environment.driver_version(lambda: "", tmp_path / "missing.info", "no-such-npu-smi")
    assert version is None and "gave ''" in why and "missing.info" in why and "no no-such-npu-smi on PATH" in why
    assert environment.hdk_verdict("24.1.rc2")[0] == "FAIL" and "25.5.1" in environment.hdk_verdict("24.1.rc2")[1]
    assert [environment.hdk_verdict(v)[0] for v in ("25.5.rc1", "25.5.0", "25.5.1", "25.5.1.2", "26.0.rc1", "x")] == [
        "FAIL", "FAIL", "PASS", "PASS", "PASS", "SKIP"]
