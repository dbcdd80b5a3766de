"""The tiers' machinery in tests/conftest.py: which declared scenarios a selection spawns, how
table entries match node ids, and that the markers are registered and strict."""

from __future__ import annotations

from types import ModuleType, SimpleNamespace

import pytest

from tests import conftest

DECLARED = [dict(mode="decode", dcp_size=2, seed=1), dict(mode="verify", dcp_size=2, seed=2),
            dict(mode="decode", dcp_size=4, seed=3)]


def _item(module, params=None, fixture="npu_scenario_results"):
    return SimpleNamespace(module=module, fixturenames=[fixture],
                           callspec=SimpleNamespace(params=params) if params is not None else None)


def _session(collected, selected):
    stash = {conftest._COLLECTED: collected}
    return SimpleNamespace(items=selected, config=SimpleNamespace(stash=SimpleNamespace(get=lambda key, default: stash.get(key, default))))


def test_a_selection_spawns_only_the_cases_its_tests_use():
    module = ModuleType("declaring")
    module.NPU_SCENARIOS = DECLARED
    first, third = _item(module, {"case": dict(mode="decode", seed=1)}), _item(module, {"case": DECLARED[2]})
    unparametrized = _item(module)  # uses the cases no parametrized test claims: the verify one
    collected = [first, third, unparametrized]
    assert conftest._selected_cases(_session(collected, [third]), "NPU_SCENARIOS", "npu_scenario_results") == [DECLARED[2]]
    assert conftest._selected_cases(_session(collected, [unparametrized]), "NPU_SCENARIOS",
                                     "npu_scenario_results") == [DECLARED[1]]
    assert conftest._selected_cases(_session(collected, collected), "NPU_SCENARIOS",
                                     "npu_scenario_results") == [DECLARED[0], DECLARED[2], DECLARED[1]]
    assert conftest._selected_cases(_session(collected, []), "NPU_SCENARIOS", "npu_scenario_results") == []


def test_a_case_is_claimed_by_equal_values_or_by_a_part_of_its_arguments():
    assert conftest._claims(dict(seed=1), DECLARED[0]) and not conftest._claims(dict(seed=2), DECLARED[0])
    assert conftest._claims(DECLARED[0], dict(DECLARED[0])) and not conftest._claims("decode", DECLARED[0])


@pytest.mark.parametrize("nodeid, entry, matches", [
    ("tests/gpu/test_flashinfer.py::test_x", "tests/gpu/", True),
    ("tests/npu/test_a.py::test_b[x-dcp1]", "tests/npu/test_a.py", True),
    ("tests/npu/test_a.py::test_b[x-dcp1]", "tests/npu/test_a.py::test_b", True),
    ("tests/npu/test_a.py::test_bc", "tests/npu/test_a.py::test_b", False),
    ("tests/npu/test_a.py::test_b[x-dcp1]", "tests/npu/test_a.py::test_b[*-dcp1]", True),
    ("tests/npu/test_a.py::test_b[x-dcp2]", "tests/npu/test_a.py::test_b[*-dcp1]", False),
])
def test_an_entry_names_a_folder_a_module_a_test_or_a_pattern(nodeid, entry, matches):
    assert conftest._matches(nodeid, entry) is matches


def test_the_markers_are_registered_and_strict(pytestconfig):
    registered = {line.split(":")[0] for line in pytestconfig.getini("markers")}
    assert set(conftest.MARKERS) <= registered
    assert pytestconfig.getoption("strict_markers")


def test_every_quick_spawn_is_a_spawn_test_and_every_other_spawn_is_slow(request):
    spawns = [item for item in request.session.config.stash.get(conftest._COLLECTED, [])
              if item.get_closest_marker("spawn") is not None]
    if not spawns:
        pytest.skip("no spawn test collected in this session")
    for item in spawns:
        assert (item.get_closest_marker("slow") is None) == (item.nodeid in conftest.QUICK_SPAWNS), item.nodeid
