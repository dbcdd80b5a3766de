"""The NPU lowering end to end on ranks of the emulated npu device (HCCL over gloo), on the
stand-ins of FIA and npu_attention_update, in bf16, against dcp_size=1 under the same lowering;
decode and verify steps replayed from NPU graphs too.

Lengths mix 1, lengths below N (empty shards) and lengths crossing FIA blocks of 16; every batch
carries a padded row (empty on every shard). The match tolerance is derived in
dcp_compile/harness/scenario.half_precision_tolerance; greedy tokens must agree except at near-ties
within that tolerance (none were flipped when this was written, see the closing figures).

The default kernels are native (npu_kernels='native': npu_scatter_pa_kv_cache and aten ops the
device runs); one case runs npu_kernels='triton', whose kernels (KV writes, metadata, gather-kv
attention, window attention, pack) run under the Triton interpreter off the hardware.
"""

from __future__ import annotations

import pytest

from dcp_compile.harness.scenario import Scenario

pytestmark = pytest.mark.usefixtures("npu_emulator")  # tests/conftest.py: the ranks inherit it

# 3 layers (2 MLA layers sharing the local metadata, 1 linear-attention one): short prefills on 2
# CI cores (the npu_kernels='triton' case runs every Triton kernel of every layer in the interpreter).
NPU = dict(kernels="npu", model="tiny-512", dtype="bfloat16", block_size=16, device="npu", layers=3)
CASES = [  # Scenario arguments: a Scenario on device="npu" needs the emulated device, made by the fixture
    # Verify with scripted accept/reject; k = 1 with 12 heads (FIA runs 16, padded) (k = 7,
    # page-interleaved, is replayed from NPU graphs below).
    dict(mode="verify", draft_len=1, dcp_size=2, tp_size=2, batch=3, contexts=(1, 2, 40), steps=3, seed=13,
         num_heads=12),
    # Extend: chunks of 37 (more than FIA's 16 queries): FIA over pieces of 16 (native), then FIA decode.
    dict(mode="extend", chunk=37, dcp_size=2, tp_size=2, batch=3, contexts=(1, 40, 60), steps=2, seed=16),
    # With the Triton kernels (A2/A3 with a paired triton-ascend): a chunk of 37 through gather-kv,
    # then a decode step; under the Triton interpreter here, so one of each.
    dict(mode="extend", chunk=37, dcp_size=2, tp_size=2, batch=3, contexts=(1, 40, 60), steps=1, seed=16,
         options=(("npu_kernels", "triton"),)),
]
# The `matrix` tier (--matrix; tests/conftest.py). DCP 4: 4 ranks on 2 CI cores, a spawn of its
# own. By default DCP 4 runs on the torch path (test_dcp_equivalence.py, test_modes.py),
# npu_attention_update merges 3 sources (tests/npu/test_standin.py), verify k = 16 runs through this
# lowering at dcp_size 1 (tests/npu/test_lowering.py, test_a5_options.py), and everything else here
# at DCP 2.
MATRIX_CASES = [
    dict(dcp_size=4, tp_size=4, batch=4, contexts=(1, 3, 40, 17), steps=2, seed=12),
    dict(mode="verify", draft_len=16, dcp_size=4, tp_size=4, batch=3, contexts=(2, 3, 40), steps=2, seed=15),
]
GRAPH_CASES = [
    # Decode and verify steps replayed from NPU graphs (GraphRunner, NPUGraphs): the lengths change
    # every step and the block tables as requests cross pages; the rows are padded to the runner's
    # bucket; prefill runs eagerly. Verify k = 7 with pages of 16 interleaved (each page on one rank).
    dict(dcp_size=2, tp_size=2, batch=5, contexts=(1, 3, 40, 33, 17), steps=5, seed=11, graphs=True),
    dict(mode="verify", draft_len=7, dcp_size=2, tp_size=2, batch=4, contexts=(1, 5, 40, 20), steps=3, seed=14,
         interleave=16, graphs=True),
    # The same with the MLA layers a compile region (dcp_compile/regions.py): each call passes its
    # layer's split KV parts, the batch's metadata computed once outside the region.
    dict(mode="verify", draft_len=7, dcp_size=2, tp_size=2, batch=4, contexts=(1, 5, 40, 20), steps=3, seed=14,
         interleave=16, graphs=True, regions=True),
    # Two kinds of MLA layer, each a compile region: a dense layer, then two MoE ones (DeepSeek-V3,
    # Kimi-K2), so three FIA calls a graph, each updated before every replay (one update per kind
    # of region failed the first replay).
    dict(model="tiny-512-moe", dcp_size=2, tp_size=2, batch=3, contexts=(1, 17, 40), steps=3, seed=18, graphs=True,
         regions=True),
]


def case_id(case: dict) -> str:
    return (f"{case.get('mode', 'decode')}-k{case.get('draft_len', 1)}-tp{case['tp_size']}-dcp{case['dcp_size']}"
            f"-I{case.get('interleave', 1)}" + ("-graphs" if case.get("graphs") else "")
            + ("-regions" if case.get("regions") else "") + (f"-{case['model']}" if "model" in case else "")
            + "".join(f"-{value}" for _, value in case.get("options", ())))


def check_matches_dcp_size_one(scenario: Scenario, result: dict) -> None:
    assert result["emulated"] and result["device"] == "npu"
    assert result["finite"]
    assert result["outputs_match"] and result["max_abs_diff"] < result["tolerance"]
    assert result["tokens_match"]
    assert sum(result["tokens_stored_per_dcp_rank"]) == result["tokens_total"]
    assert result["pass_summary"]["lower_npu_attention"] > 0
    triton = dict(scenario.options).get("npu_kernels") == "triton"
    assert result["pass_summary"].get("lower_native_kernels", 0) == 0 if triton else \
        result["pass_summary"]["lower_native_kernels"] > 0
    # At most one compile per (batch shape, strategy), whatever the lengths did: FIA's graphs are
    # static per shape, the gather-kv ones symbolic (one serves several shapes).
    assert 0 < result["graphs_captured"] <= result["graph_keys"]


NPU_SCENARIOS = [{**NPU, **case} for case in CASES + MATRIX_CASES + GRAPH_CASES]
"""Run by tests/conftest.py, in one spawn per TP size with the other modules' cases."""


@pytest.mark.parametrize("case", CASES + [pytest.param(case, marks=pytest.mark.matrix) for case in MATRIX_CASES],
                         ids=case_id)
def test_npu_lowering_matches_dcp_size_one(case, npu_scenario_results):
    scenario = Scenario(**{**NPU, **case})
    result = npu_scenario_results[scenario]
    check_matches_dcp_size_one(scenario, result)
    assert result["graph_replays"] == 0
    if scenario.mode == "extend":  # chunks over 16 queries: FIA over pieces (native), gather-kv (triton)
        triton = dict(scenario.options).get("npu_kernels") == "triton"
        assert result["strategy_counts"].get("gather-kv", 0) >= 1 if triton else "gather-kv" not in result["strategy_counts"]


@pytest.mark.parametrize("case", GRAPH_CASES, ids=case_id)
def test_npu_graph_replays_match_dcp_size_one(case, npu_scenario_results):
    scenario = Scenario(**{**NPU, **case})
    result = npu_scenario_results[scenario]
    check_matches_dcp_size_one(scenario, result)
    assert result["graph_replays"] == scenario.steps  # every decode / verify step replayed a graph
    assert result["device_graphs_captured"] == 1  # one bucket, one strategy: captured once, replayed after
    # A replayed step reads nothing back from the device, and every op of its run is one torch_npu
    # runs on the device (the emulator's op coverage and sync count: docs/ascend.md §16, §17).
    assert result["host_syncs_per_step"] == 0
    assert result["ops_off_device"] == []
    # Every functional collective's work is waited, replays' too (a replay that ran the collective
    # again without waiting on its new output kept each work and its tensors: 2 a replay).
    assert result["collective_works_unwaited"] == 0
