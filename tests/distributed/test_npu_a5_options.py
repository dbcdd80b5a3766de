"""The NPU lowering's A5 options end to end on ranks of the emulated npu device, against dcp_size=1
with the default options (nd, FIA v1, split verify), in bf16: every combination of KV format
(nd, nz), FIA version (1, 2) and verify scheme (split, mask).

In CI: each of the 8 combinations verifies k = 7 at DCP 2, replayed from NPU graphs while the
lengths change; decode at DCP 4, verify k = 16 at DCP 4 and k = 1 at DCP 2 under the A5
combination (nz, v2) and the masked verify. The whole matrix (decode at DCP 2 and 4 per format
and version, verify k = 1, 7, 16 per combination): DCP_COMPILE_FULL_MATRIX=1.

Blocks are FIA's 128 rows (NZ takes no other); lengths mix 1 (empty shards), a request crossing
a block and a padded row in every batch. The Triton kernels run in Triton's interpreter.
"""

from __future__ import annotations

import itertools
import os

import pytest

from dcp_compile.harness.scenario import Scenario, compare_all

pytestmark = pytest.mark.usefixtures("npu_emulator")

NPU = dict(kernels="npu", model="tiny-512", dtype="bfloat16", block_size=128, device="npu")
FORMATS, VERSIONS, VERIFY = ("nd", "nz"), (1, 2), ("split", "mask")
FULL = os.environ.get("DCP_COMPILE_FULL_MATRIX") == "1"


def options(kv_format: str, version: int, verify: str) -> dict:
    return dict(npu_kv_format=kv_format, fia_version=version, npu_verify=verify)


VERIFY_DCP2 = dict(mode="verify", dcp_size=2, tp_size=2, batch=3, contexts=(1, 130, 40), steps=2, seed=21)
DECODE_DCP4 = dict(dcp_size=4, tp_size=4, batch=4, contexts=(1, 3, 130, 40), steps=2, seed=22)
CASES = [dict(**VERIFY_DCP2, draft_len=7, graphs=True, **options(*combo))
         for combo in itertools.product(FORMATS, VERSIONS, VERIFY)]
CASES += [
    dict(**DECODE_DCP4, **options("nz", 2, "split")),
    dict(**{**DECODE_DCP4, "mode": "verify"}, draft_len=16, **options("nz", 2, "mask")),
    dict(**VERIFY_DCP2, draft_len=1, **options("nz", 2, "mask")),
]
if FULL:
    CASES += [dict(**{**DECODE_DCP4, "dcp_size": dcp, "tp_size": dcp}, **options(f, v, "split"))
              for dcp, f, v in itertools.product((2, 4), FORMATS, VERSIONS) if (dcp, f, v) != (4, "nz", 2)]
    CASES += [dict(**{**DECODE_DCP4, "mode": "verify", "dcp_size": dcp, "tp_size": dcp}, draft_len=k,
                   **options(*combo))
              for dcp, k, combo in itertools.product((2, 4), (1, 16), itertools.product(FORMATS, VERSIONS, VERIFY))
              if (dcp, k, combo) not in ((4, 16, ("nz", 2, "mask")),)]


def case_id(case: dict) -> str:
    return (f"{case.get('mode', 'decode')}-k{case.get('draft_len', 1)}-dcp{case['dcp_size']}-{case['npu_kv_format']}"
            f"-v{case['fia_version']}-{case['npu_verify']}" + ("-graphs" if case.get("graphs") else ""))


@pytest.fixture(scope="module")
def results(npu_emulator):
    """Every case's result, from one spawn per TP size."""
    return dict(zip(map(case_id, CASES), compare_all([Scenario(**case, **NPU) for case in CASES])))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_option_combination_matches_dcp_size_one(case, results):
    scenario = Scenario(**case, **NPU)
    result = results[case_id(case)]
    assert result["emulated"] and result["device"] == "npu" and result["finite"]
    assert result["outputs_match"] and result["max_abs_diff"] < result["tolerance"]
    assert result["tokens_match"]
    assert sum(result["tokens_stored_per_dcp_rank"]) == result["tokens_total"]
    assert result["pass_summary"]["lower_npu_attention"] > 0
    assert result["kv_layout"] == ("nz" if case["npu_kv_format"] == "nz" else "split")
    if scenario.graphs:
        assert result["graph_replays"] == scenario.steps and result["device_graphs_captured"] == 1
