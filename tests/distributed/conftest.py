"""One spawn per (TP size, device) for the Scenario cases of every module here.

A module declares its cases as `SCENARIOS` (Scenarios on gloo CPU ranks) or `NPU_SCENARIOS` (the
arguments of Scenarios on ranks of the emulated npu device: such a Scenario can only be made once
the npu_emulator fixture has made the device). The session fixtures below run the cases of every
module the session collected in one `compare_all` each, so the ranks' start, imports and first
compiles are paid once per TP size rather than once per module (about 10 s a spawn of 2 ranks on 2
CPU cores, more for 4). A test looks its result up by its Scenario."""

from __future__ import annotations

import pytest

from dcp_compile.harness.scenario import Scenario, compare_all


def _declared(session: pytest.Session, name: str) -> list:
    """The `name` lists of the collected modules that have one, in collection order."""
    modules = dict.fromkeys(item.module for item in session.items if hasattr(item.module, name))
    return [case for module in modules for case in getattr(module, name)]


def _compare(scenarios) -> dict[Scenario, dict]:
    scenarios = list(dict.fromkeys(scenarios))
    return dict(zip(scenarios, compare_all(scenarios)))


@pytest.fixture(scope="session")
def scenario_results(request) -> dict[Scenario, dict]:
    """compare() of every collected module's SCENARIOS, by Scenario."""
    return _compare(_declared(request.session, "SCENARIOS"))


@pytest.fixture(scope="session")
def npu_scenario_results(request, npu_emulator) -> dict[Scenario, dict]:
    """compare() of every collected module's NPU_SCENARIOS, by Scenario (the ranks inherit the
    emulated device from the npu_emulator fixture of tests/conftest.py)."""
    return _compare(Scenario(**arguments) for arguments in _declared(request.session, "NPU_SCENARIOS"))
