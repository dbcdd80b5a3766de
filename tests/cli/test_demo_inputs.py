"""The demo checks its inputs in the parent, before any rank starts, with one line and exit 2;
and a CLI killed with SIGTERM leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

import dcp_compile
from dcp_compile.cli.main import main
from dcp_compile.models.config import preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.harness.scenario import Driver, Scenario
from dcp_compile.runtime import devices


@pytest.mark.parametrize("args, message", [
    (["--model", "nosuch"], "unknown model 'nosuch'"),
    (["--tp-size", "3"], "tp_size 3 does not split model tiny"),
    (["--interleave", "3", "--page-size", "4"], "interleave size 3 must divide the page size 4"),
    (["--context", "5000"], "the pool holds 4095"),
    (["--page-size", "3"], "page_size (--page-size, default the interleave) 3 must divide the KV pool's 4096 rows "
                           "(kv_rows) and be a multiple of the interleave 1"),
    (["--kernels", "flashinfer", "--page-size", "2", "--dcp-size", "4", "--tp-size", "4"],
     "--page-size 2 does not suit kernels='flashinfer': the FlashInfer lowering (its CSR page list) reads each rank's "
     "KV as whole local blocks: page size 2 with interleave 1 over dcp_size 4"),
    (["--kernels", "npu", "--block-size", "7"],
     "--block-size 7 does not suit kernels='npu': FIA's block size must be 16 or 128 (docs/ascend.md §4.5)"),
    (["--kernels", "npu", "--block-size", "2048"], "--block-size 2048 does not suit kernels='npu': FIA's block size must be 16 or 128"),
    (["--kernels", "npu", "--block-size", "48"], "--block-size 48 does not suit kernels='npu': FIA's block size must be 16 or 128"),
    (["--kernels", "npu", "--block-size", "64"], "--block-size 64 does not suit kernels='npu': FIA's block size must be "
                                                 "16 or 128 (docs/ascend.md §4.5); page size 128 over dcp_size 2 with "
                                                 "interleave 1 gives 64; a CANN built from ops-transformer of 2026 or "
                                                 "later takes any multiple of 16 up to 1024: "
                                                 "apply(..., fia_block_sizes='cann-2026')"),
    (["--timeout", "0"], "timeout must be a finite number of seconds > 0 and at most 31536000 (a year), got 0.0"),
    (["--timeout", "inf"], "timeout must be a finite number of seconds > 0 and at most 31536000 (a year), got inf"),
    (["--timeout", "nan"], "timeout must be a finite number of seconds > 0 and at most 31536000 (a year), got nan"),
    (["--timeout", "1e300"], "timeout must be a finite number of seconds > 0 and at most 31536000 (a year), got 1e+300"),
])
def test_bad_demo_input_is_one_line_and_exit_2_before_any_rank(args, message, capsys, monkeypatch):
    from dcp_compile.harness import scenario

    monkeypatch.setattr(scenario, "spawn", lambda *a, **k: pytest.fail("a rank was started"))
    assert main(["demo", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


@pytest.mark.parametrize("args, line", [
    (["--pad-rows", "100000000"], "argument --pad-rows: must be an int in [0, 1024], got '100000000'"),
    (["--layers", "100000"], "argument --layers: must be an int in [1, 256], got '100000'"),
    (["--layers", "0"], "argument --layers: must be an int in [1, 256], got '0'"),
    (["--seed", str(2**64)], f"argument --seed: must be an int in [0, 4294967295], got '{2**64}'"),
    (["--seed", "-1"], "argument --seed: must be an int in [0, 4294967295], got '-1'"),
    (["--tp-size", "0"], "argument --tp-size: must be an int >= 1, got '0'"),
    (["--tp-size", "two"], "argument --tp-size: must be an int >= 1, got 'two'"),
    (["--page-size", "0"], "argument --page-size: must be an int >= 1, got '0'"),
    (["--interleave", "0"], "argument --interleave: must be an int >= 1, got '0'"),
    (["--kernels", "npu", "--block-size", "0"], "argument --block-size: must be an int >= 1, got '0'"),
    (["--draft-len", "17"], "argument --draft-len: must be an int in [1, 16], got '17'"),
    (["--steps", "-1"], "argument --steps: must be an int >= 0, got '-1'"),
    (["--timeout", "soon"], "argument --timeout: must be a number, got 'soon'"),
    (["--mode", "prefill"], "argument --mode: invalid choice: 'prefill' (choose from 'decode', 'verify', 'extend')"),
])
def test_a_flag_out_of_its_bounds_is_one_line_naming_it_and_exit_2(args, line, capsys, monkeypatch):
    """Refused while the arguments are parsed: no usage block, nothing spawned (--pad-rows
    100000000 was 52 GB in every rank, --tp-size 0 ran at the DCP size, a seed past 64 bits
    failed in the ranks naming no flag)."""
    _no_rank(monkeypatch)
    assert main(["demo", *args]) == 2
    assert capsys.readouterr().err == f"dcp-compile demo: error: {line} (see dcp-compile demo --help)\n"


def test_the_flags_help_states_the_bounds(capsys):
    assert main(["demo", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for bound in ("0..1024 (default 1)", "1..256", "0..4294967295", "tensor-parallel ranks to spawn, >= 1"):
        assert bound in text


def test_an_unwritable_dcp_compile_dump_is_refused_before_any_rank(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("DCP_COMPILE_DUMP", str(blocker / "dump"))
    _no_rank(monkeypatch)
    assert main(["demo"]) == 2
    assert capsys.readouterr().err == (f"dcp-compile demo: error: cannot write to DCP_COMPILE_DUMP folder "
                                       f"{blocker / 'dump'}: Not a directory\n")


def _no_rank(monkeypatch):
    from dcp_compile.harness import scenario

    monkeypatch.setattr(scenario, "spawn", lambda *a, **k: pytest.fail("a rank was started"))


def test_cuda_without_a_gpu_is_refused_before_any_rank(capsys, monkeypatch):
    _no_rank(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["demo", "--device", "cuda"]) == 2
    assert capsys.readouterr().err == ("dcp-compile demo: error: --device cuda needs a CUDA GPU, and torch finds none "
                                       "here (torch.cuda.is_available() is False)\n")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["demo", "--device", "cuda", "--dcp-size", "2", "--tp-size", "2"]) == 2
    assert capsys.readouterr().err == ("dcp-compile demo: error: --device cuda spawns one rank per GPU: --tp-size 2 "
                                       "needs 2 GPUs, this host has 1\n")


@pytest.mark.skipif(devices.torch_npu_installed(), reason="torch_npu ships torchair")
@pytest.mark.parametrize("kernels", [["--kernels", "npu"], []], ids=["npu", "auto"])
def test_inner_compile_torchair_without_torchair_is_refused_before_any_rank(kernels, npu_emulator, capsys, monkeypatch):
    _no_rank(monkeypatch)
    assert main(["demo", "--device", "npu", *kernels, "--inner-compile", "torchair"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dcp-compile demo: error: --kernels npu: inner_compile='torchair' needs torchair, which ships "
                          "with torch_npu") and "inner_compile='eager'" in err and err.count("\n") == 1


def test_triton_kernels_on_cpu_need_the_interpreter_and_triton(capsys, monkeypatch):
    from dcp_compile.lowering import triton as triton_kernels

    _no_rank(monkeypatch)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert main(["demo", "--kernels", "triton"]) == 2
    assert capsys.readouterr().err == ("dcp-compile demo: error: --kernels triton: on the CPU the Triton kernels run in "
                                       "Triton's interpreter, which is off: set TRITON_INTERPRET=1 (no Triton driver "
                                       "runs on the CPU)\n")
    monkeypatch.setattr(triton_kernels, "available", lambda: False)
    assert main(["demo", "--kernels", "triton"]) == 2
    assert capsys.readouterr().err == ("dcp-compile demo: error: --kernels triton: it needs the triton package (pip "
                                       "install triton)\n")


def test_decode_reserves_one_token_a_step_and_verify_k():
    Scenario(batch=1, contexts=(4000,), steps=14)
    Scenario(mode="extend", batch=1, contexts=(4000,), chunk=512, steps=14)
    with pytest.raises(ValueError, match=r"the contexts need up to 4098 KV locations \(1 requests of up to 4098 tokens\); "
                                         r"the pool holds 4095"):
        Scenario(mode="verify", batch=1, contexts=(4000,), steps=14, draft_len=7)


FILLS_THE_POOL = Scenario(batch=1, contexts=(247,), steps=8, kv_rows=256)  # 255 usable locations
GLOO_SCENARIOS = [FILLS_THE_POOL]
"""Run by tests/conftest.py, in one spawn per TP size with the other modules' cases."""


def test_a_decode_run_may_fill_the_pool_to_its_last_location(scenario_results):
    scenario = FILLS_THE_POOL
    result = scenario_results[scenario]
    assert result["tokens_total"] == scenario.kv_rows - 1 and result["tokens_match"] and result["outputs_match"]


# Demo commands on the emulated npu device that once failed in the ranks. Their Scenarios run in the
# shared npu spawn (tests/conftest.py); the test runs the CLI on the flags, which must build the same
# Scenario, with the spawn's result as its comparison.
NPU_DEMO = ["--device", "npu", "--kernels", "npu"]
DEMO_COMMANDS = [
    # npu_verify='mask' over a prefill of 5 tokens and a padded row's 1: 6 tokens over 2 rows of
    # unequal query counts, which a graph lowered for rows of 3 queries each does not serve
    (["--npu-verify", "mask", "--block-size", "16", "--batch", "1", "--context", "5", "--steps", "1"],
     dict(options=(("npu_verify", "mask"),), block_size=16, batch=1, contexts=(5,), steps=1)),
    # FIA blocks of 64, which only fia_block_sizes='cann-2026' allows: the dcp_size=1 baseline's too
    (["--fia-block-sizes", "cann-2026", "--block-size", "64", "--batch", "1", "--context", "5", "--steps", "1",
      "--layers", "1"],
     dict(options=(("fia_block_sizes", "cann-2026"),), block_size=64, batch=1, contexts=(5,), steps=1, layers=1)),
]
NPU_SCENARIOS = [dict(kernels="npu", device="npu", **case) for _, case in DEMO_COMMANDS]
"""Run by tests/conftest.py, in one spawn per TP size with the other modules' cases."""


@pytest.mark.parametrize("args, case", DEMO_COMMANDS, ids=["npu-verify-mask", "fia-block-sizes-cann-2026"])
def test_a_demo_command_on_the_npu_exits_0_with_a_match(args, case, npu_scenario_results, monkeypatch):
    from dcp_compile.cli import demo

    monkeypatch.setattr(demo, "compare", lambda scenario: npu_scenario_results[scenario])
    assert main(["demo", *NPU_DEMO, *args]) == 0
    result = npu_scenario_results[Scenario(kernels="npu", device="npu", **case)]
    assert result["tokens_match"] and result["outputs_match"] and result["emulated"]
    assert {name: result[name] for name, _ in case["options"]} == dict(case["options"])


def test_the_baseline_takes_the_deployments_options_not_those_under_test(npu_emulator):
    """The dcp_size=1 baseline runs the NPU back end with its defaults, but for the options that
    say what the deployment accepts (fia_block_sizes): without those its blocks can be refused."""
    options = dict(fia_block_sizes="cann-2026", npu_verify="mask", npu_kv_format="nd", fia_version=2)
    scenario = Scenario(kernels="npu", device="npu", block_size=64, options=options)
    assert scenario.baseline_kernels == "npu" and scenario.baseline_options == (("fia_block_sizes", "cann-2026"),)
    assert Scenario(kernels="npu", device="npu", options=dict(npu_verify="mask")).baseline_options == ()
    assert Scenario(kernels="triton", options=dict(verify_attention="folded")).baseline_options == ()  # the torch baseline


def test_the_drivers_request_table_knows_the_vocabulary():
    vocab = preset("tiny").vocab_size
    model = dcp_compile.apply(MLAModel(preset("tiny"), kv_capacity=64, max_requests=2), 1)
    driver = Driver(model, Scenario(dcp_size=1, tp_size=1, batch=2, contexts=(3,), steps=1, kv_rows=64), vocab)
    with pytest.raises(ValueError, match=rf"request 1's token id {vocab} is outside the vocabulary \[0, {vocab}\)"):
        driver.table.extend_batch([0, 1], [[1, 2], [vocab]])


def _marked_processes(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as environ:
                if marker.encode() in environ.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
@pytest.mark.parametrize("sig, exit_code, gone_within_s", [(signal.SIGTERM, 143, 15), (signal.SIGKILL, -signal.SIGKILL, 5)],
                         ids=["SIGTERM", "SIGKILL"])
def test_a_terminated_or_killed_cli_leaves_no_process_behind(sig, exit_code, gone_within_s):
    """SIGTERM: the CLI stops its ranks. SIGKILL runs no cleanup: the ranks die with their parent."""
    marker = f"DCP_TEST_MARKER={uuid.uuid4()}"
    env = {**os.environ, "DCP_TEST_MARKER": marker.split("=", 1)[1]}
    cli = subprocess.Popen([sys.executable, "-m", "dcp_compile.cli.main", "demo", "--steps", "100"], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while len(_marked_processes(marker)) < 3 and time.time() < deadline:  # the CLI and its 2 ranks
        time.sleep(0.2)
    assert len(_marked_processes(marker)) >= 3
    cli.send_signal(sig)
    assert cli.wait(timeout=30) == exit_code
    deadline = time.time() + gone_within_s
    while _marked_processes(marker) and time.time() < deadline:
        time.sleep(0.2)
    assert _marked_processes(marker) == []


def _main_not_interrupted(argv) -> int:
    """main(argv), where a Ctrl-C that escapes it fails the test rather than stopping the session."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped main()")


def test_ctrl_c_while_the_subcommands_are_imported_exits_130_with_one_line(capsys, monkeypatch):
    """Ctrl-C during the CLI's own imports (build_parser imports each subcommand's module) was a
    traceback and death by SIGINT (rc -2); Ctrl-C before main() runs, while `import dcp_compile`
    loads torch, still is (see dcp_compile/cli/main.py)."""
    import importlib

    from dcp_compile.cli import main as cli_main

    real_import = importlib.import_module

    def interrupted_import(name, *args):
        if name.startswith("dcp_compile.cli."):
            os.kill(os.getpid(), signal.SIGINT)
        return real_import(name, *args)

    handler = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(cli_main.importlib, "import_module", interrupted_import)
    assert _main_not_interrupted(["demo"]) == 130
    assert capsys.readouterr().err == "dcp-compile: interrupted\n"
    assert signal.getsignal(signal.SIGINT) is handler  # a caller's handler is back


def test_a_second_ctrl_c_does_not_cut_the_ranks_cleanup_short(capsys, monkeypatch):
    from dcp_compile.cli import demo

    cleaned_up = []

    def compare(scenario):
        try:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the ranks run
            time.sleep(10)
        finally:
            os.kill(os.getpid(), signal.SIGINT)  # again, while the launcher stops them
            time.sleep(0.01)
            cleaned_up.append(True)

    monkeypatch.setattr(demo, "compare", compare)
    assert _main_not_interrupted(["demo"]) == 130
    assert cleaned_up == [True]
    assert capsys.readouterr().err == "dcp-compile demo: interrupted\n"


INTERRUPTED_PROGRAM = """
import atexit, os, signal, sys, time
from dcp_compile.cli import demo, main

def compare(scenario):
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the ranks run
    time.sleep(10)

def ctrl_c_at_exit():
    os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C while the interpreter exits
    time.sleep(0.1)

demo.compare = compare
atexit.register(ctrl_c_at_exit)
sys.argv = ["dcp-compile", "demo"]
sys.exit(main.main())
"""


def test_the_program_exits_130_however_often_ctrl_c_is_pressed():
    """main() as the program (no argv): a Ctrl-C after main() returned, while the interpreter
    exits, was a traceback or death by SIGINT (rc -2) instead of 130."""
    done = subprocess.run([sys.executable, "-c", INTERRUPTED_PROGRAM], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (130, "dcp-compile demo: interrupted\n")


@pytest.mark.parametrize("error, line", [
    (ZeroDivisionError("integer division or modulo by zero"), "ZeroDivisionError: integer division or modulo by zero"),
    (OSError(28, "No space left on device"), "OSError: [Errno 28] No space left on device"),
    (KeyError("weight_map"), "KeyError: 'weight_map'"),
    (ValueError(""), "ValueError"),
    (RuntimeError("first line\nsecond line"), "first line"),
])
def test_any_error_exits_2_with_one_line(error, line, capsys, monkeypatch):
    from dcp_compile.cli import demo

    monkeypatch.setattr(demo, "compare", lambda scenario: (_ for _ in ()).throw(error))
    assert main(["demo"]) == 2
    assert capsys.readouterr().err == f"dcp-compile demo: error: {line}\n"


def test_a_scenarios_layer_kinds_and_dcp_size_one_settings_are_checked_up_front():
    assert Scenario(model="tiny-512", layer_types=["mla", "mla"]).model_config().layer_types == ("mla", "mla")
    for bad in (dict(layer_types=()), dict(layer_types=("mla", "dense")), dict(layer_types=("mla",), layers=2)):
        with pytest.raises(ValueError, match="layer_types must be a non-empty list of 'mla' and 'linear'"):
            Scenario(**bad)
    with pytest.raises(ValueError, match="configured_at_dcp_size_one is for dcp_size 1"):
        Scenario(dcp_size=2, configured_at_dcp_size_one=True)
