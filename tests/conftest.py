"""Without a GPU, Triton kernels run under the interpreter. The variable must be set before
anything (dynamo, inductor, a test module) imports triton, so it is set here, first.

`npu_emulator`: the emulated `npu` device (dcp_compile/testing/npu_emulator) for the tests of
the NPU path. It sets DCP_COMPILE_NPU_EMULATOR=1 for the rest of the session (ranks spawned by a
test inherit it, and install the device themselves) and installs the device in this process
(torch_npu's device instead, where torch_npu is installed).

`scenario_results`, `npu_scenario_results`: one spawn per (TP size, device) for the Scenario cases
of every module the session collected. A module declares its cases as `GLOO_SCENARIOS`
(Scenarios on gloo CPU ranks) or `NPU_SCENARIOS` (the arguments of Scenarios on ranks of the
emulated npu device: such a Scenario can only be made once the npu_emulator fixture has made the
device); each fixture runs them all in one `compare_all`, so the ranks' start, imports and first
compiles are paid once per TP size rather than once per module (about 10 s a spawn of 2 ranks on
2 CPU cores, more for 4). A test looks its result up by its Scenario."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def npu_emulator():
    from dcp_compile.runtime import devices

    previous = os.environ.get(devices.EMULATOR_ENV)
    os.environ[devices.EMULATOR_ENV] = "1"
    devices.require_torch_npu("the tests of the NPU path")
    yield torch.device("npu", 0)
    if previous is None:
        os.environ.pop(devices.EMULATOR_ENV)
    else:
        os.environ[devices.EMULATOR_ENV] = previous


def _declared(session: pytest.Session, name: str) -> list:
    """The `name` lists of the collected modules that have one, in collection order."""
    modules = dict.fromkeys(getattr(item, "module", None) for item in session.items)
    return [case for module in modules if hasattr(module, name) for case in getattr(module, name)]


def _compare(scenarios) -> dict:
    from dcp_compile.harness.scenario import compare_all  # imports triton: after TRITON_INTERPRET above

    scenarios = list(dict.fromkeys(scenarios))
    return dict(zip(scenarios, compare_all(scenarios)))


@pytest.fixture(scope="session")
def scenario_results(request) -> dict:
    """compare() of every collected module's GLOO_SCENARIOS, by Scenario."""
    return _compare(_declared(request.session, "GLOO_SCENARIOS"))


@pytest.fixture(scope="session")
def npu_scenario_results(request, npu_emulator) -> dict:
    """compare() of every collected module's NPU_SCENARIOS, by Scenario (the ranks inherit the
    emulated device)."""
    from dcp_compile.harness.scenario import Scenario

    return _compare(Scenario(**arguments) for arguments in _declared(request.session, "NPU_SCENARIOS"))
