"""`dcp-compile doctor --device npu`: every assumption the NPU lowering makes, checked on this
machine's ops, one check at a time, with the values measured, so that the first owner of an Ascend
machine can say exactly which facts hold there and which options are safe.

    run(only=None) -> report (a dict: JSON for a bug report; report.render prints it as tables)

On an Ascend NPU (torch_npu, CANN) the checks run the real ops; with DCP_COMPILE_NPU_EMULATOR=1
and no torch_npu they run the stand-ins on the emulated device (dcp_compile/testing), which is
what CI runs to check the checks themselves (a stand-in made to depart from a fact,
DCP_COMPILE_STANDIN_PLANT, must FAIL its check). Every check compares the op with dcp_compile's
torch reference or with the op's documented contract, never with a stand-in. CHECKS lists them;
docs/ascend.md §20 gives each with its sources, and what the emulator cannot model of it.
"""

from __future__ import annotations

import os
import platform
import time
import traceback
from dataclasses import asdict
from datetime import datetime, timezone
from importlib import metadata

import torch

from dcp_compile.lowering.npu import versions
from dcp_compile.doctor.npu import attention, environment, graphs, hccl, kv_write
from dcp_compile.doctor.npu import options as settings
from dcp_compile.doctor.npu.checks import Check, Context, first_line

SCHEMA = "dcp_compile.doctor/1"
NATIVE, NZ, FIA_V2 = "npu_kernels='native'", "npu_kv_format='nz'", "fia_version=2"
GRAPHS, GRAPHS_DCP = "--graphs", "--graphs with dcp_size > 1"

CHECKS = (
    Check("empty-shard-lse", "FIA gives out 0 and lse +inf for a request with kv_len 0 (inferred; the lowering masks "
                             "such rows by their lengths anyway)", "§7.2",
          "ops-transformer arch22/fia_kernel_nonquant_mla.h @ 359e786a (DEAL_ZERO), fia_public_define.h @ ccd18608",
          (), attention.check_empty_shard_lse),
    Check("lse-base", "FIA's softmax_lse is the natural-log logsumexp of the scaled scores, as the merge of partials "
                      "reads it", "§2.3",
          "torch_npu FIA docstring (outputs); op-plugin torch_npu-npu_attention_update.md; SGLang npu/attention/dcp.py "
          "is_lse_base_on_e", ("dcp_size > 1",), attention.check_lse_base),
    Check("tnd-more-queries-than-keys", "TND, sparse_mode 0, no mask: every query of a row sees all of its kv_len "
                                        "keys, also with more queries than keys (the split verify's prefix, the "
                                        "native pieces)", "§6.1, §6.4, §13",
          "ops-transformer fused_infer_attention_score_tiling_check_feature.cpp @ c29bc106, e197ec56",
          ("npu_verify='split'", NATIVE), attention.check_tnd_more_queries_than_keys),
    Check("tnd-zero-query-pieces", "TND lists with zero-query pieces (the last cumulative count repeated, KV length "
                                   "0), as the native lowering pads a batch to its graph's piece count: the real "
                                   "pieces are unaffected", "§5.3, §19.1",
          "op-plugin torch_npu-npu_fused_infer_attention_score.md @ 517f2e7d (TND lists cumulative, non-decreasing)",
          (NATIVE,), attention.check_tnd_zero_query_pieces),
    Check("fia-few-heads", "FIA's MLA path serves 1, 2 and 4 query heads", "§4.2",
          "op-plugin FIA doc and v2 docstring (1..128 heads); SGLang ascend_backend.py @ 009c6808 (>= 8)",
          ("fewer than 8 query heads per FIA call",), attention.check_few_heads),
    Check("update-all-empty", "npu_attention_update after dcp_npu.split_partials' guard merges a row whose every shard "
                              "is empty to 0", "§7.4, §8.2",
          "SGLang npu/attention/dcp.py @ 2022ebe9; op-plugin torch_npu-npu_attention_update.md",
          ("dcp_size > 1",), attention.check_update_all_empty),
    Check("block-sizes", "FIA takes block sizes 16 and 128 (the 2026 sizes too, for fia_block_sizes='cann-2026')",
          "§4.5", "ops-transformer CheckFeatureMlaNoquantPa @ c29bc106, CheckFeatureBlockSize @ e197ec56",
          (settings.BACK_END,), attention.check_block_sizes),
    Check("strided-keys", "contiguous latent and rope caches give what strided views of packed rows give, without the "
                          "auto-contiguous copy", "§11.1",
          "ops-transformer fused_infer_attention_score_def.cpp (AutoContiguous); op-plugin op_api_common.cpp",
          (), attention.check_strided_keys),
    Check("nz-cache", "FIA v1 and v2 read an NZ latent and rope cache [blocks, 1, D/16, 128, 16], LSE included",
          "§11.4, §15.1", "torch_npu 2.14.0 _op_plugin_docs.py (MLA with NZ); hicann/ops-nn "
          "kv_rms_norm_rope_cache_b16_pa.h @ 9740742c (the NZ order)", (NZ,), attention.check_nz_cache),
    Check("fia-v2-layouts", "FIA v2 in BSND_NBSD and TND_NTD (cumulative actual_seq_qlen) gives out [N, B, S, D] / "
                            "[N, T, D] and the LSE in the input layout", "§15.2",
          "torch_npu 2.14.0 v2 docstring; _meta_registrations.py infer_lse_out_shape", (FIA_V2,),
          attention.check_fia_v2_layouts),
    Check("masked-verify", "FIA v1 and v2 in BSND with a rank-local causal mask [B, 1, S, W], sparse_mode 0",
          "§6.4, §15.3", "ops-transformer tiling check @ e197ec56 (modes 0, 3, 4, 9 for MLA); SGLang dcp_metadata.py "
          "@ 564300b1 (the mask)", ("npu_verify='mask'",), attention.check_masked_verify),
    Check("kv-write-int32-slots", "npu_scatter_pa_kv_cache ('Norm') reads an int32 slot_mapping as int32: each token "
                                  "lands at its slot, no other row changes", "§17, §20.2",
          "op-plugin torch_npu-npu_scatter_pa_kv_cache.md @ 517f2e7d; ops-transformer scatter_pa_kv_cache_nd.h @ "
          "3b632b4f (GlobalTensor<int32_t>)", (NATIVE,), kv_write.check_int32_slots),
    Check("kv-write-pa-nz", "npu_scatter_pa_kv_cache(cache_mode='PA_NZ') writes where the NZ layout says, on this SoC "
                            "and CANN", "§18.4, §20.2",
          "aclnnScatterPaKvCache.md @ e5b0ac51 (ND only on Ascend950); hicann ops-transformer @ da7cb684, doc @ "
          "107749eb (PA_NZ on Ascend950)", (NZ,), kv_write.check_pa_nz),
    Check("kv-write-dummy-slot", "tokens another rank owns and padded rows, written to one valid reserved slot (once "
                                 "or repeated), change that slot and nothing else", "§17, §20.2",
          "op-plugin torch_npu-npu_scatter_pa_kv_cache.md @ 517f2e7d (slots in [0, blocks x block - 1]; repeats "
          "undefined); SGLang memory_pool_npu.py (dummy slot 0)", (NATIVE,), kv_write.check_dummy_slot),
    Check("native-kv-write", "the native lowering's KV write (dcp_npu.slot_mapping, dcp_npu.scatter_kv_cache: int32 "
                             "slots, the reserved block for tokens it does not keep, calls of at most the cache's "
                             "slots) stores what reference.kv_write stores, ND and NZ", "§17, §19.1",
          "op-plugin torch_npu-npu_scatter_pa_kv_cache.md @ 517f2e7d; ops-transformer scatter_pa_kv_cache_tiling.cpp "
          "@ 001b95e5 (numBlocks * blockSize > numTokens)", (NATIVE,), kv_write.check_native_kv_write),
    Check("graph-update-names", "NPUGraph.update(cpu_update_input=...) takes actual_seq_lengths_kv and "
                                "actual_seq_lengths and the replay uses them", "§9.3",
          "torch_npu _npugraph_handlers/ifa_handler.py (2.14.0); Ascend/pytorch docs/zh/developer_notes/npugraph.md",
          (GRAPHS,), graphs.check_graph_update_names),
    Check("v2-graph-update-names", "NPUGraph.update refreshes a captured FIA v2 call's actual_seq_kvlen, by v2's name",
          "§9.3, §15.2", "torch_npu 2.14.0 _npugraph_handlers/ifa_handler.py (_IFAv2DefaultHandler)",
          ("--graphs with fia_version=2",), graphs.check_v2_graph_update_names),
    Check("fia-update-count", "NPUGraph.update with one dict per recorded FIA call updates each call; fewer dicts "
                              "than calls are refused", "§9.3, §17, §20.3",
          "torch_npu 2.13.0 npu/graphs.py:534-553 (update_capture_record); v2.10.0-26.0.0 graphs.py:270-288",
          (GRAPHS,), graphs.check_fia_update_count),
    Check("capture-lengths-one", "FIA captured with every KV length 1, updated to lengths with 0, gives the updated "
                                 "attention and out 0 for the empty rows", "§17",
          "vllm-ascend model_runner_v1 (captures from a dummy run of lengths >= 1)", (GRAPHS,),
          graphs.check_capture_lengths_one),
    Check("native-step-on-device", "every op of a native decode and split-verify step runs on the NPU: no CPU "
                                   "fallback, the NPU-graph capture succeeds, the replays equal eager",
          "§16, §17, §19", "Ascend/pytorch docs/zh/developer_notes/npugraph.md:40 (only aclnn ops in graphs); "
          "op-plugin op_plugin_functions.yaml @ 517f2e7d", (NATIVE,), graphs.check_native_step_on_device),
    Check("torchair-symint-lengths", "torchair with the FIA lengths as SymInt inputs: no recompile per step and the "
                                     "values refreshed", "§9.4",
          "torchair _acl_concrete_graph/acl_graph.py @ fced8842 (updated_param_keys)", ("inner_compile='torchair'",),
          graphs.check_torchair_symint_lengths),
    Check("hccl-in-graphs", "HCCL all-gather and all-to-all (with split lists) replay inside a captured NPU graph, "
                            "2 ranks", "§10.3",
          "torchair docs npugraph_ex/basic/communication_graph.md; vllm-ascend context_parallel/common_cp.py:158",
          (GRAPHS_DCP,), hccl.check_collectives_in_graphs),
    Check("all-to-all-no-splits-in-graphs", "dist.all_to_all_single without split lists (HCCL's AlltoAll, "
                                            "dcp_npu.all_to_all) replays inside a captured NPU graph, 2 ranks",
          "§17, §19.1", "torch_npu ProcessGroupHCCL.cpp:7014, 7067 (alltoall_base); vllm-ascend common_cp.py @ "
          "0170adde", (GRAPHS_DCP,), hccl.check_collectives_in_graphs),
    Check("hccl-expansion-mode", "HCCL_OP_EXPANSION_MODE: AIV, or HCCL collectives capture without it", "§20.4",
          "vllm-ascend .agents/skills/vllm-ascend-model-adapter/references/troubleshooting.md @ 2d3285e7 (507903)",
          (GRAPHS_DCP,), environment.check_hccl_expansion_mode),
    Check("driver-version", f"the Ascend driver (HDK) is {environment.HDK_MIN} or later, as NPU-graph capture asks",
          "§20.4", "vllm-ascend vllm_ascend/compilation/acl_graph.py (_OLD_HDK_CAPTURE_ERROR_MARKERS); op-plugin "
          "torch_npu-utils-get_cann_version.md @ c63749c7 (module='DRIVER')", (GRAPHS,),
          environment.check_driver_version),
)


def names() -> list[str]:
    return [check.name for check in CHECKS]


def setup() -> Context:
    """The npu device the checks run on: torch_npu's, or (DCP_COMPILE_NPU_EMULATOR=1 without
    torch_npu) the emulated one with the stand-ins."""
    from dcp_compile.lowering.npu import ensure_ops
    from dcp_compile.runtime import devices

    if not devices.npu_available():
        raise RuntimeError(f"--device npu checks the Ascend ops, and torch_npu is not installed here: "
                           f"{devices.NPU_INSTALL_HINT} (or set {devices.EMULATOR_ENV}=1 to check the stand-ins on the "
                           f"emulated device)")
    emulated = devices.emulated_npu()
    if emulated:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    devices.require_torch_npu("dcp-compile doctor --device npu")
    ensure_ops()
    if torch.npu.device_count() < 1:
        raise RuntimeError("torch_npu sees no NPU here (check ASCEND_RT_VISIBLE_DEVICES and npu-smi info)")
    torch.npu.set_device(0)
    return Context(torch.device("npu", 0), emulated)


def run(only=None, command: str = "", plant: str | None = None) -> dict:
    """Run the checks (`only`: their names; default all) in CHECKS' order and return the report.
    `command` and `plant` are recorded, not acted on (the caller plants)."""
    started = time.perf_counter()
    context = setup()
    for check in CHECKS:
        if only is not None and check.name not in only:
            continue
        result = check.result()
        began = time.perf_counter()
        try:
            check.run(result, context)
        except Exception as exc:  # an assumption that errors is not established
            result.verdict, result.detail = "FAIL", first_line(exc, 300)
            result.measured["traceback"] = traceback.format_exc(limit=4)[-1200:]
        if result.verdict == "FAIL" and not result.unsafe:
            result.unsafe = list(check.gates)
        result.seconds = round(time.perf_counter() - began, 2)
        context.results[check.name] = result
    results = context.results
    deployment = versions.deployment()
    counts = {verdict: sum(r.verdict == verdict for r in results.values()) for verdict in ("PASS", "FAIL", "SKIP")}
    driver = results["driver-version"].measured.get("driver") if "driver-version" in results else None
    return {
        "schema": SCHEMA,
        "command": command,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "mode": "emulator" if context.emulated else "hardware",
        "plant": plant,
        "machine": {"host": platform.node(), "platform": platform.platform(), "npus": torch.npu.device_count()},
        "versions": _versions(),
        "deployment": {**deployment._asdict(), "driver": driver},
        "environment": {name: value for name, value in sorted(os.environ.items())
                        if name.startswith(("DCP_COMPILE_", "HCCL_", "ASCEND_RT_VISIBLE"))},
        "checks": [asdict(result) for result in results.values()],
        **settings.judge(CHECKS, results, deployment),
        "summary": {"passed": counts["PASS"], "failed": counts["FAIL"], "skipped": counts["SKIP"],
                    "seconds": round(time.perf_counter() - started, 1)},
    }


def _versions() -> dict:
    found = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("torch_npu", "triton", "triton-ascend", "dcp_compile"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found
