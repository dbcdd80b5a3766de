"""The NPU lowering's A5 options end to end on ranks of the emulated npu device, against dcp_size=1
with the default options (nd, FIA v1, split verify), in bf16: every combination of KV format
(nd, nz), FIA version (1, 2) and verify scheme (split, mask).

In CI (about 25 s a case on 2 cores, so two): verify k = 7 at DCP 2 replayed from NPU graphs
while the lengths change, under (nz, v2, mask), every option away from its default, and decode at
DCP 2 under (nz, v2). The defaults at DCP 2 are test_npu_lowering.py's; at dcp_size 1, (nz, v2,
mask) against the default over a row crossing NZ blocks, with k = 16 under the mask among its
steps: tests/npu/test_a5_options.py. In the `matrix` tier (`--matrix`, tests/conftest.py; its log:
bench/results/npu_a5_matrix_emulator.log): verify k = 7 under graphs for all 8 combinations (among
them (nz, v1, split) and (nd, v2, split), in CI until the test command was cut to its budget),
k = 1 and 16 at DCP 2 for all 8, decode at DCP 2 and 4 for each (format, version), k = 16 at DCP 4
under the mask with v1 and v2.

Blocks are FIA's 128 rows (NZ takes no other); lengths mix 1 and 3 (empty shards) with 40, and
every batch carries a padded row. Contexts stay inside one block per rank, to keep the Triton
interpreter's prefill short: rows crossing NZ blocks are tested in one process
(tests/npu/test_a5_options.py, a 140-token row over blocks of 128, and the NZ round trip).
"""

from __future__ import annotations

import itertools

import pytest

from dcp_compile.harness.scenario import Scenario

pytestmark = pytest.mark.usefixtures("npu_emulator")

NPU = dict(kernels="npu", model="tiny-512", dtype="bfloat16", block_size=128, device="npu")
FORMATS, VERSIONS, VERIFY = ("nd", "nz"), (1, 2), ("split", "mask")


def options(kv_format: str, version: int, verify: str) -> dict:
    """The NPU back end's options of a case (Scenario.options: values by name, sorted)."""
    return dict(options=tuple(sorted(dict(npu_kv_format=kv_format, fia_version=version, npu_verify=verify).items())))


# 3 layers: 2 MLA layers (the mask and the NZ views are shared or per layer), and 1 linear one
VERIFY_DCP2 = dict(mode="verify", dcp_size=2, tp_size=2, batch=3, contexts=(1, 3, 40), steps=2, seed=21, layers=3)
DECODE_DCP4 = dict(dcp_size=4, tp_size=4, batch=3, contexts=(1, 3, 40), steps=2, seed=22, layers=3)
ALL = list(itertools.product(FORMATS, VERSIONS, VERIFY))
CI_GRAPH_COMBOS = [("nz", 2, "mask")]
CASES = [dict(**VERIFY_DCP2, draft_len=7, graphs=True, **options(*combo)) for combo in CI_GRAPH_COMBOS]
CASES += [dict(**{**DECODE_DCP4, "dcp_size": 2, "tp_size": 2}, **options("nz", 2, "split"))]
MATRIX_CASES = [dict(**VERIFY_DCP2, draft_len=7, graphs=True, **options(*combo))
                for combo in ALL if combo not in CI_GRAPH_COMBOS]
# decode reads no verify scheme: one per (format, version)
MATRIX_CASES += [dict(**{**DECODE_DCP4, "dcp_size": dcp, "tp_size": dcp}, **options(f, v, "split"))
                 for dcp, f, v in itertools.product((2, 4), FORMATS, VERSIONS) if (dcp, f, v) != (2, "nz", 2)]
MATRIX_CASES += [dict(**VERIFY_DCP2, draft_len=1, **options(*combo)) for combo in ALL]
# k = 16 over short contexts goes to gather-kv (the cost model): a longer row keeps it on FIA
MATRIX_CASES += [dict(**{**VERIFY_DCP2, "contexts": (1, 3, 200)}, draft_len=16, **options(*combo)) for combo in ALL]
MATRIX_CASES += [dict(**{**DECODE_DCP4, "mode": "verify"}, draft_len=16, **options(*combo))
                 for combo in (("nz", 2, "mask"), ("nd", 1, "mask"))]


def case_id(case: dict) -> str:
    option = dict(case["options"])
    return (f"{case.get('mode', 'decode')}-k{case.get('draft_len', 1)}-dcp{case['dcp_size']}-{option['npu_kv_format']}"
            f"-v{option['fia_version']}-{option['npu_verify']}" + ("-graphs" if case.get("graphs") else ""))


NPU_SCENARIOS = [dict(**case, **NPU) for case in CASES + MATRIX_CASES]
"""Run by tests/conftest.py, in one spawn per TP size with the other modules' cases."""


@pytest.mark.parametrize("case", CASES + [pytest.param(case, marks=pytest.mark.matrix) for case in MATRIX_CASES],
                         ids=case_id)
def test_option_combination_matches_dcp_size_one(case, npu_scenario_results):
    scenario = Scenario(**case, **NPU)
    result = npu_scenario_results[scenario]
    assert result["emulated"] and result["device"] == "npu" and result["finite"]
    assert result["outputs_match"] and result["max_abs_diff"] < result["tolerance"]
    assert result["tokens_match"]
    assert sum(result["tokens_stored_per_dcp_rank"]) == result["tokens_total"]
    assert result["pass_summary"]["lower_npu_attention"] > 0
    assert result["kv_layout"] == ("nz" if dict(case["options"])["npu_kv_format"] == "nz" else "split")
    if scenario.graphs:
        assert result["graph_replays"] == scenario.steps and result["device_graphs_captured"] == 1
