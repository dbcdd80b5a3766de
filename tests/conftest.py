"""The suite's tiers, its shared spawns and its emulated device.

Tiers (README "Tests"). Each test gets its cost markers here, from its folder, its module or its
fixtures, never on the test itself: `spawn` (starts processes: ranks, a CLI run, a script),
`emulator` (the emulated npu device), `interpreter` (Triton kernels under the Triton interpreter,
in this process or in its ranks), `slow` (over 20 s alone on the 2-core machine: the quick tier is
`-m "not slow"`), `gpu` (needs a CUDA GPU), `matrix` (the whole option matrix, whose cases the
default run covers another way: deselected unless `--matrix` is given or -m names it). Markers are strict
(pyproject.toml), and the table is checked: a test that starts a process or launches a Triton
kernel under the interpreter in this process without its marker fails, naming the entry to add.

Without a GPU, Triton kernels run under the interpreter. The variable must be set before
anything (dynamo, inductor, a test module) imports triton, so it is set here, first.

`npu_emulator`: the emulated `npu` device (dcp_compile/testing/npu_emulator) for the tests of
the NPU path. It sets DCP_COMPILE_NPU_EMULATOR=1 for the rest of the session (ranks spawned by a
test inherit it, and install the device themselves) and installs the device in this process
(torch_npu's device instead, where torch_npu is installed).

`scenario_results`, `npu_scenario_results`: one spawn per (TP size, device) for the Scenario cases
the selected tests use. A module declares its cases as `GLOO_SCENARIOS` (Scenarios on gloo CPU
ranks) or `NPU_SCENARIOS` (the arguments of Scenarios on ranks of the emulated npu device: such a
Scenario can only be made once the npu_emulator fixture has made the device). A test uses the
case it is parametrized with; a test with no such parameter uses its module's cases that no
parametrized test claims. Each fixture runs them all in one `compare_all`, so the ranks' start,
imports and first compiles are paid once per TP size rather than once per module (about 10 s a
spawn of 2 ranks on 2 CPU cores, more for 4). A test looks its result up by its Scenario."""

from __future__ import annotations

import multiprocessing.process
import os
import re
import subprocess
import sys
from collections import defaultdict

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

MARKERS = {
    "spawn": "starts processes: ranks (a process group), a CLI run or a script",
    "emulator": "runs on the emulated npu device (dcp_compile/testing/npu_emulator)",
    "interpreter": "runs Triton kernels under the Triton interpreter, in this process or in its ranks",
    "slow": "over 20 s alone on the 2-core machine; the quick tier is -m 'not slow'",
    "gpu": "needs a CUDA GPU (skipped without one)",
    "matrix": "the whole option matrix, whose cases the default run covers another way; runs with --matrix",
}

# Markers by node-id prefix: a folder ("tests/gpu/"), a module, or a test (its name without
# parameters, or one parametrization; * matches any text). `emulator` comes from the npu_emulator fixture and `spawn`
# from the shared-spawn fixtures as well; the check below keeps `spawn` and `interpreter` honest.
BY_PREFIX = {
    "gpu": ["tests/gpu/"],
    "spawn": [
        "tests/bench/test_report.py", "tests/bench/test_step_script.py", "tests/bench/test_serve_warmup_script.py",
        "tests/checkpoints/test_oracle.py",
        "tests/checkpoints/test_cli.py::test_demo_dcp2_tp2_on_a_transformers_checkpoint_matches_transformers",
        "tests/checkpoints/test_memory.py::test_a_rank_allocates_its_share_not_the_checkpoint",
        "tests/cli/test_demo_inputs.py::test_a_terminated_or_killed_cli_leaves_no_process_behind",
        "tests/cli/test_demo_inputs.py::test_the_program_exits_130_however_often_ctrl_c_is_pressed",
        "tests/contract/test_contract.py::test_outer_torch_compile_keeps_dcp_on",
        "tests/distributed/", "tests/faults/",
        "tests/hf/test_compiled_step.py::test_a_tripped_batch_guard_fails_every_rank_and_latches_on_cpu",
        "tests/hf/test_compiled_step.py::test_a_tripped_batch_guard_is_flagged_raised_at_the_next_step_and_latches_on_the_npu",
        "tests/hf/test_transformers_distributed.py", "tests/hf/test_decode_graphs.py", "tests/hf/test_failure_rule.py",
        "tests/hf/test_assisted_generation.py::test_assisted_generate_at_dcp_two_gives_transformers_tokens",
        "tests/hf/test_assisted_generation.py::test_two_rows_are_refused_on_every_rank_and_the_model_serves_on",
        "tests/hf/test_assisted_generation.py::test_hybrid_assisted_generate_at_dcp_two_gives_the_plain_greedy_tokens",
        "tests/npu/test_failure_rule.py",
        "tests/lowering/test_outside_lowering.py::test_a_back_end_registered_outside_the_package_runs_dcp_equal_to_dcp_size_one",
        "tests/lowering/test_outside_lowering.py::test_demo_and_dump_take_its_flag",
        "tests/npu/test_empty_shards.py::test_dcp_two_with_garbage_on_empty_shards_matches_dcp_size_one",
        "tests/npu/test_emulator_fidelity.py::test_hccl_counts_all_to_all_calls_with_split_lists",
        "tests/npu/test_graphs.py::test_npu_smoke_script_runs_on_the_standins",
        "tests/npu/test_doctor.py::test_every_check_passes_or_skips_on_the_emulator_with_its_source",
        "tests/ops/test_triton_kernels.py::test_import_does_not_need_triton",
    ],
    "interpreter": [
        "tests/ops/test_triton_kernels.py", "tests/ops/test_triton_folded_attention.py", "tests/ops/test_skinny_matmul.py",
        "tests/test_triton_lowering.py", "tests/lowering/test_folded_verify.py",
        "tests/npu/test_a5_options.py::test_nz_round_trip_element_by_element",
        "tests/passes/test_lower_projections.py::test_the_lowered_products_compile_under_inductor",
        "tests/passes/test_lower_projections.py::test_the_reference_model_runs_its_projections_through_the_kernel_with_cublas_numbers",
        "tests/test_debug_checks.py::test_the_triton_writer_drops_an_out_of_pool_location_and_the_step_fails",
        # in the ranks
        "tests/hf/test_decode_graphs.py",
        "tests/distributed/test_modes.py::test_mode_matches_dcp_size_one[verify-tp2-dcp2-I1-gather-q-triton]",
        "tests/distributed/test_npu_lowering.py::test_npu_lowering_matches_dcp_size_one[extend-k1-tp2-dcp2-I1-triton]",
    ],
    # Tests that are not `spawn` and took over 2.5 s of the whole suite's run (setup included) on
    # the 2-core machine, and the Triton kernels' interpreter unit tests (112 tests, 45 s in all);
    # every `spawn` test is slow too, but for QUICK_SPAWNS.
    "slow": [
        "tests/ops/test_triton_kernels.py",
        "tests/cli/test_dump.py::test_a_long_context_dump_of_a_real_model_fits_the_limits",
        "tests/contract/test_contract.py::test_unpadded_prefills_of_500_lengths_compile_a_few_graphs_at_dcp_size_one",
        "tests/flashinfer/test_lowering.py::test_dcp1_prefill_decode_verify_match_the_reference_and_plan_every_step",
        "tests/flashinfer/test_lowering.py::test_inductor_equals_eager_at_dcp1_and_plans_every_step",
        "tests/hf/test_caches_and_generate.py::test_two_live_caches_and_a_generate_keep_their_own_kv",
        "tests/hf/test_assisted_generation.py::test_assisted_generate_at_dcp_one_gives_transformers_tokens",
        "tests/hf/test_caches_and_generate.py::test_generate_without_an_attention_mask_sees_the_padding",
        "tests/hf/test_caches_and_generate.py::test_a_thousand_prompt_lengths_compile_two_graphs",
        "tests/hf/test_transformers_dcp1.py::test_changed_pattern_runs_unchanged_at_dcp_size_one",
        "tests/hf/test_transformers_dcp1.py::test_bf16_generate_matches_transformers_under_the_near_tie_rule",
        "tests/hf/test_regions.py::test_each_kind_of_layer_is_absorbed_once_and_the_tokens_are_transformers",
        "tests/hf/test_regions.py::test_the_npu_lowering_replays_regional_decode_steps_from_npu_graphs",
        "tests/hf/test_regions.py::test_a_mask_that_reads_the_tokens_is_left_as_it_is_inside_a_region",
        "tests/hf/test_regions.py::test_a_step_without_a_cache_runs_the_layers_as_they_are",
        "tests/hf/test_transformers_dcp1.py::test_a_hybrid_model_serves_a_left_padded_batch[regions]",
        # the quick tier keeps one DeepSeek-V3 and one V2 variant of the front end's generate
        *(f"tests/hf/test_transformers_dcp1.py::test_generate_matches_transformers[{variant}]" for variant in
          ("v3-eager", "v3-qlora-rotate-half-yarn", "v2-sdpa-qlora", "glm4-moe-lite", "minicpm3-eager", "youtu",
           "sarvam-mla", "kimi-linear")),
        # the quick tier keeps DCP 2
        "tests/npu/test_native_lowering.py::test_a_native_graph_holds_no_triton_op[*-dcp1]",
        # the quick tier checks the decode and split-verify graphs' calls against each release
        "tests/npu/test_release_snapshots.py::test_every_npu_call_of_a_native_graph_matches_the_releases_schema_and_meta_function[extend-*]",
        "tests/npu/test_release_snapshots.py::test_every_npu_call_of_a_native_graph_matches_the_releases_schema_and_meta_function[verify-7-mask-*]",
        "tests/npu/test_a5_options.py::test_each_combination_equals_the_default",
        "tests/npu/test_defects.py::test_debug_checks_skip_inside_the_capture_and_the_runner_checks_between_replays",
        "tests/npu/test_defects.py::test_each_replay_reads_the_block_table_of_its_own_step",
        "tests/npu/test_defects.py::test_regions_of_two_kinds_of_layer_replay_with_one_fia_update_per_layer",
        "tests/npu/test_empty_shards.py::test_garbage_from_fia_on_empty_requests_changes_no_logit",
        "tests/npu/test_graphs.py::test_runner_pushes_the_current_fia_lengths_before_every_replay",
        "tests/npu/test_graphs.py::test_torchair_is_handed_symbolic_fia_lengths",
        "tests/npu/test_kv_layout.py::test_fia_reads_the_split_pool_without_a_copy_and_it_holds_the_same_kv",
        "tests/npu/test_lowering.py::test_lowered_decode_verify_and_long_chunks_match_the_reference",
        "tests/npu/test_lowering.py::test_masked_verify_serves_rows_of_unequal_query_counts_and_masks_rows_of_equal_ones",
        "tests/npu/test_lowering.py::test_one_graph_per_batch_shape_over_changing_lengths",
        "tests/npu/test_replay_fia_capture.py::test_a_capture_sees_lengths_of_at_least_one_and_a_replay_after_update_matches_eager",
        "tests/npu/test_verify_commit.py::test_verify_replayed_from_an_npu_graph_commits_only_the_accepted_drafts",
        "tests/passes/test_fuse_projections.py::test_under_inductor_the_fused_model_matches_the_unfused_one_and_a_second_start_loads_the_aot_cache",
        "tests/passes/test_lower_projections.py::test_the_lowered_products_compile_under_inductor",
        "tests/passes/test_regions.py::test_a_regional_model_gives_the_plain_models_logits_from_one_lowering_of_its_layer",
        "tests/passes/test_regions.py::test_asked_to_fuse_projections_a_regional_model_leaves_its_weights_and_compiles_every_graph",
        "tests/passes/test_regions.py::test_a_layer_kind_called_once_stays_a_region",
        "tests/runtime/test_concurrent_steps.py::test_two_threads_get_the_logits_of_a_sequential_run",
        "tests/runtime/test_verify_commit.py::test_verify_commits_only_the_accepted_drafts_at_dcp_size_one",
        "tests/test_api.py::test_inductor_inner_compile_matches_eager",
        "tests/test_batch_guard.py::test_a_refused_batch_writes_no_kv",
        "tests/test_recurrent_state.py::test_a_reused_slot_starts_afresh",
        "tests/test_triton_lowering.py::test_triton_lowered_model_matches_reference",
    ],
}
# The spawns of the quick tier: each back end's lowering at DCP 2 once, end to end on 2 ranks
# against dcp_size=1 (the shared gloo spawn and the shared npu spawn run just these).
QUICK_SPAWNS = [
    "tests/distributed/test_dcp_equivalence.py::test_dcp_matches_dcp_size_one[tp2-dcp2-I1]",
    "tests/distributed/test_modes.py::test_mode_matches_dcp_size_one[verify-tp2-dcp2-I1-gather-q-triton]",
    "tests/flashinfer/test_lowering.py::test_dcp2_matches_dcp1[decode-I1-P8]",
    "tests/distributed/test_npu_lowering.py::test_npu_graph_replays_match_dcp_size_one[decode-k1-tp2-dcp2-I1-graphs]",
    # the combination sweep's case in the shared npu spawn: two kinds of layer, regions, graphs, NZ, masked verify
    "tests/distributed/test_npu_sweep.py::test_sampled_canonical_case_at_dcp_two_matches_dcp_size_one"
    "[canonical-dense-then-moe-verify-regions-graphs-nz-v1-mask-dcp2]",
]
BY_FIXTURE = {
    "npu_emulator": ("emulator",),
    "scenario_results": ("spawn",),
    "dcp_two": ("spawn",),  # tests/contract/test_contract.py
    "npu_scenario_results": ("spawn", "emulator"),
}


def pytest_addoption(parser):
    parser.addoption("--matrix", action="store_true",
                     help="also run the tests marked matrix (the whole NPU option matrix, DCP 4 on the emulator)")


def pytest_configure(config):
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    _ProcessWatch.install()


def _matches(nodeid: str, prefix: str) -> bool:
    if "*" in prefix:
        return re.fullmatch(".*".join(map(re.escape, prefix.split("*"))), nodeid) is not None
    if prefix.endswith("/"):
        return nodeid.startswith(prefix)
    return nodeid == prefix or nodeid.startswith(prefix + "::") or nodeid.startswith(prefix + "[")


def _tiers(item: pytest.Item) -> set[str]:
    names = {name for name, prefixes in BY_PREFIX.items() if any(_matches(item.nodeid, p) for p in prefixes)}
    for fixture, markers in BY_FIXTURE.items():
        if fixture in item.fixturenames:
            names.update(markers)
    if "spawn" in names and item.nodeid not in QUICK_SPAWNS:
        names.add("slow")
    return names


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark every item (before -m and -k select); keep every collected item for the scenario
    claims; deselect the matrix cases unless --matrix or -m names them."""
    for item in items:
        for name in sorted(_tiers(item)):
            item.add_marker(name)
    config.stash[_COLLECTED] = list(items)
    if not any("::" in arg for arg in config.args):  # whole modules were collected
        _check_entries(items)
    if not config.getoption("--matrix") and "matrix" not in (config.getoption("markexpr") or ""):
        matrix = [item for item in items if item.get_closest_marker("matrix") is not None]
        if matrix:
            config.hook.pytest_deselected(items=matrix)
            items[:] = [item for item in items if item.get_closest_marker("matrix") is None]


_COLLECTED = pytest.StashKey[list]()


def _check_entries(items) -> None:
    """An entry of the tables whose module was collected names at least one of its tests."""
    files = {item.nodeid.split("::")[0] for item in items}
    entries = [entry for prefixes in BY_PREFIX.values() for entry in prefixes] + QUICK_SPAWNS
    stale = [entry for entry in entries if entry.split("::")[0] in files and "::" in entry
             and not any(_matches(item.nodeid, entry) for item in items)]
    if stale:
        raise pytest.UsageError(f"tests/conftest.py names tests that do not exist: {stale}")


# --- The check: a test that starts a process or interprets a Triton kernel carries its marker ----

class _ProcessWatch:
    """Counts, per running test, the processes it starts (multiprocessing, or a Python
    subprocess) and the Triton kernels it launches under the interpreter in this process."""

    current: str | None = None
    started: dict[str, int] = defaultdict(int)
    interpreted: dict[str, int] = defaultdict(int)
    installed = False

    @classmethod
    def install(cls) -> None:
        if cls.installed:
            return
        cls.installed = True
        process_start, popen_init = multiprocessing.process.BaseProcess.start, subprocess.Popen.__init__

        def start(self, *args, **kwargs):
            cls._count(cls.started)
            return process_start(self, *args, **kwargs)

        def init(self, args, *rest, **kwargs):
            argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
            if argv and str(argv[0]) == sys.executable:
                cls._count(cls.started)
            return popen_init(self, args, *rest, **kwargs)

        multiprocessing.process.BaseProcess.start = start
        subprocess.Popen.__init__ = init

    @classmethod
    def watch_interpreter(cls) -> None:
        """Once triton's interpreter is loaded (by a test's imports), count its launches."""
        interpreter = sys.modules.get("triton.runtime.interpreter")
        if interpreter is None or getattr(interpreter.GridExecutor.__call__, "_dcp_watched", False):
            return
        launch = interpreter.GridExecutor.__call__

        def call(self, *args, **kwargs):
            cls._count(cls.interpreted)
            return launch(self, *args, **kwargs)

        call._dcp_watched = True
        interpreter.GridExecutor.__call__ = call

    @classmethod
    def _count(cls, counter) -> None:
        if cls.current is not None and not _called_from(_COMPILERS):
            counter[cls.current] += 1


def pytest_collection_finish(session):
    _ProcessWatch.watch_interpreter()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _ProcessWatch.watch_interpreter()
    _ProcessWatch.current = item.nodeid
    try:
        yield
    finally:
        _ProcessWatch.current = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when != "teardown" or report.failed:
        return
    missing = [marker for marker, counter in (("spawn", _ProcessWatch.started), ("interpreter", _ProcessWatch.interpreted))
               if counter.get(item.nodeid) and item.get_closest_marker(marker) is None]
    if missing:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} {' and '.join(_DID[m] for m in missing)} but is not marked "
                           f"{' and '.join(missing)}: add it to BY_PREFIX in tests/conftest.py")


# Not counted: the compilers' own processes (inductor's workers, its C++ compiler and its checks
# that a compiled library loads).
_COMPILERS = ("torch._inductor", "triton.")


def _called_from(packages: tuple[str, ...]) -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith(packages):
            return True
        frame = frame.f_back
    return False


_DID = {"spawn": "starts processes", "interpreter": "launches Triton kernels under the interpreter"}


# --- Fixtures ---------------------------------------------------------------------------------------

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


def _claims(value, case) -> bool:
    """Whether a test's parameter `value` is the declared `case` (a Scenario, or for NPU cases the
    arguments of one, which a test's parameter may give in part)."""
    if isinstance(value, dict) and isinstance(case, dict):
        return value.items() <= case.items()
    return type(value) is type(case) and value == case


def _selected_cases(session: pytest.Session, declared_name: str, fixture: str) -> list:
    """The `declared_name` cases the selected tests that use `fixture` need, in declaration order."""
    collected = session.config.stash.get(_COLLECTED, session.items)
    by_module = defaultdict(list)
    for item in collected:
        by_module[getattr(item, "module", None)].append(item)
    needed = []
    for module in dict.fromkeys(getattr(item, "module", None) for item in session.items if fixture in item.fixturenames):
        declared = list(getattr(module, declared_name, ()))
        claimed = {i for item in by_module[module] for value in _params(item) for i, case in enumerate(declared)
                   if _claims(value, case)}
        for item in (item for item in session.items if getattr(item, "module", None) is module
                     and fixture in item.fixturenames):
            own = {i for value in _params(item) for i, case in enumerate(declared) if _claims(value, case)}
            needed.extend(declared[i] for i in sorted(own or set(range(len(declared))) - claimed))
    unique = []
    for case in needed:
        if case not in unique:
            unique.append(case)
    return unique


def _params(item: pytest.Item) -> list:
    callspec = getattr(item, "callspec", None)
    return list(callspec.params.values()) if callspec is not None else []


def _compare(scenarios: list) -> dict:
    from dcp_compile.harness.scenario import compare_all  # imports triton: after TRITON_INTERPRET above

    results = dict(zip(scenarios, compare_all(scenarios))) if scenarios else {}
    _SPAWN_SECONDS.extend((scenario, result["seconds"]) for scenario, result in results.items())
    return results


_SPAWN_SECONDS: list = []


@pytest.fixture(scope="session")
def scenario_results(request) -> dict:
    """compare() of the GLOO_SCENARIOS cases the selected tests use, by Scenario."""
    return _compare(_selected_cases(request.session, "GLOO_SCENARIOS", "scenario_results"))


@pytest.fixture(scope="session")
def npu_scenario_results(request, npu_emulator) -> dict:
    """compare() of the NPU_SCENARIOS cases the selected tests use, by Scenario (the ranks inherit
    the emulated device)."""
    from dcp_compile.harness.scenario import Scenario

    cases = _selected_cases(request.session, "NPU_SCENARIOS", "npu_scenario_results")
    return _compare([Scenario(**arguments) for arguments in cases])


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """With --durations (CI): the shared spawns' scenarios, slowest first (rank 0's seconds, the
    spawn itself not included), since --durations charges them all to the first test of a spawn."""
    if not _SPAWN_SECONDS or not config.getoption("durations"):
        return
    total = sum(seconds for _, seconds in _SPAWN_SECONDS)
    terminalreporter.write_sep("=", f"shared spawns: {len(_SPAWN_SECONDS)} scenarios, {total:.0f} s on rank 0")
    for scenario, seconds in sorted(_SPAWN_SECONDS, key=lambda pair: -pair[1])[:10]:
        fields = {k: v for k, v in vars(scenario).items() if v != type(scenario).__dataclass_fields__[k].default}
        terminalreporter.write_line(f"{seconds:6.1f}s {fields}")
