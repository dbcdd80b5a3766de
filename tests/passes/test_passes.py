"""Pass-level tests: finders (with negative cases), op counts before and after each pass,
idempotence, hybrid layers left alone, debug checks, and the pass switches."""

from __future__ import annotations

import pytest
import torch

import dcp_compile
from dcp_compile.lowering import registry
from dcp_compile.models.config import preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.passes import PassConfig, PassManager
from dcp_compile.passes import sites
from dcp_compile.ops import targets
from tests.harness import capture, run_passes, tiny_graph

MLA_LAYERS = 3  # the tiny preset: mla, linear, mla, mla


@pytest.fixture(scope="module")
def graph():
    return tiny_graph()


def test_finders_match_canonical_ops(graph):
    assert len(sites.find_attention_sites(graph.graph)) == MLA_LAYERS
    assert len(sites.find_kv_writes(graph.graph)) == MLA_LAYERS
    assert sites.find_local_metadata(graph.graph) == {}


def test_finders_ignore_other_attention():
    """Attention not written with dcp:: ops (SDPA here) is not an MLA site."""

    def sdpa_model(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    gm = capture(sdpa_model, *(torch.randn(1, 2, 4, 8) for _ in range(3)))
    assert sites.find_attention_sites(gm.graph) == []
    assert sites.find_kv_writes(gm.graph) == []
    _, report, _ = run_passes(gm, dcp_size=2)
    assert report.sites("shard_kv_write") == 0 and report.sites("gather_q_attention") == 0


def test_op_counts_before_and_after(graph):
    _, report, rec = run_passes(graph, dcp_size=2)
    assert report.summary()["shard_kv_write"] == MLA_LAYERS
    assert report.summary()["local_metadata"] == 1
    assert report.summary()["gather_q_attention"] == MLA_LAYERS

    before, after = rec.ops("shard_kv_write", "before"), rec.ops("shard_kv_write", "after")
    assert before["dcp::mla_kv_write"] == MLA_LAYERS and "dcp::sharded_kv_write" not in before
    assert after["dcp::sharded_kv_write"] == MLA_LAYERS and "dcp::mla_kv_write" not in after

    assert rec.ops("local_metadata", "after")["dcp::local_metadata"] == 1  # shared by all layers

    after = rec.ops("gather_q_attention", "after")
    assert "dcp::mla_attention" not in after
    for op in ("dcp::mla_partial_attention", "dcp::pack_partials", "dcp::merge_partials",
               "_c10d_functional::all_gather_into_tensor", "_c10d_functional::all_to_all_single"):
        assert after[op] == MLA_LAYERS, op
    assert after["_c10d_functional::wait_tensor"] == 2 * MLA_LAYERS


def test_passes_are_idempotent(graph):
    once, _, rec_once = run_passes(graph, dcp_size=4)
    _, report, rec_twice = run_passes(once, dcp_size=4)
    assert all(report.sites(name) == 0 for name in ("shard_kv_write", "local_metadata", "gather_q_attention"))
    assert rec_twice.ops("verify", "after") == rec_once.ops("verify", "after")


def test_dcp_size_one_only_gets_the_batch_guard(graph):
    gm, report, rec = run_passes(graph, dcp_size=1)
    assert all(r.sites == 0 for r in report.records if r.name not in ("guard_batch", "verify"))
    assert report.sites("guard_batch") == 1  # one per distinct metadata, shared by the layers
    before, after = rec.ops("check_locations", "before"), rec.ops("verify", "after")
    assert after - before == {"dcp::guard_batch": 1, "getitem": 4} and not before - after


@pytest.mark.parametrize("dcp_size", [1, 2])
def test_every_attention_reads_guarded_metadata(graph, dcp_size):
    gm, _, _ = run_passes(graph, dcp_size=dcp_size)
    guards = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is targets.GUARD_BATCH]
    assert len(guards) == 1
    guard = guards[0]
    writes = sites.find_kv_writes(gm.graph, sharded=dcp_size > 1)
    out_loc = next(n for n in gm.graph.nodes if n.op == "placeholder" and "out_loc" in n.name)
    assert guard.args[3] is out_loc  # padded rows are checked against the KV write locations
    # ...before the first of them, and every write takes the guard's copy (a padded row's token writes location 0)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    assert all(w.loc.args == (guard, 3) and order[guard] < order[w.node] for w in writes)
    assert guard.args[4] == 128 * dcp_size  # the pool's logical capacity
    outputs = {user for user in guard.users}
    consumers = ([s.node for s in sites.find_attention_sites(gm.graph)] if dcp_size == 1 else
                 [n for n in gm.graph.nodes if n.op == "call_function" and n.target is targets.LOCAL_METADATA])
    assert consumers and all(set(node.args) & outputs for node in consumers)
    unguarded = {n for n in gm.graph.nodes if n.op == "placeholder" and ("req_to_token" in n.name or "seq_lens" in n.name)}
    assert all(not (set(node.args) & unguarded) for node in consumers)


def test_hybrid_linear_attention_layers_untouched():
    gm = tiny_graph(layer_types=("linear", "linear", "linear", "mla"))
    linear_before = [n for n in gm.graph.nodes if "linear_attention" in str(n.target)]
    rewritten, report, rec = run_passes(gm, dcp_size=2)
    linear_after = [n for n in rewritten.graph.nodes if "linear_attention" in str(n.target)]
    assert len(linear_before) == len(linear_after) == 3
    for a, b in zip(linear_before, linear_after):
        assert [str(x) for x in a.args] == [str(x) for x in b.args]
    assert report.sites("gather_q_attention") == 1


def test_gathered_heads_and_exchange_shapes(graph):
    gm, _, _ = run_passes(graph, dcp_size=2)
    partial = next(n for n in gm.graph.nodes if n.target is targets.PARTIAL_ATTENTION)
    out, lse = partial.meta["val"]
    tokens = partial.args[6].meta["val"].shape[0]
    assert out.shape == (tokens, 8 * 2, 32) and lse.shape == (tokens, 16) and lse.dtype == torch.float32
    merged = next(n for n in gm.graph.nodes if n.target is targets.MERGE_PARTIALS)
    assert merged.meta["val"].shape == (tokens, 8, 32)


def test_debug_checks_guard_every_write(graph):
    _, report, rec = run_passes(graph, dcp_size=2, debug_checks=True)
    assert report.sites("check_locations") == MLA_LAYERS
    after = rec.ops("verify", "after")
    assert after["dcp::check_locations"] == MLA_LAYERS
    _, report, _ = run_passes(graph, dcp_size=2, debug_checks=False)
    assert report.sites("check_locations") == 0


def test_disabling_a_pass(graph):
    _, report, rec = run_passes(graph, dcp_size=2, disabled=("shard_kv_write",))
    assert rec.ops("verify", "after")["dcp::mla_kv_write"] == MLA_LAYERS


def test_unknown_or_mandatory_pass_names_are_rejected():
    with pytest.raises(ValueError, match="unknown pass"):  # every back end's passes are known to the registry
        registry.check_pass_names(("shard_everything",))
    registry.check_pass_names(("lower_projections", "split_kv_cache"))
    with pytest.raises(ValueError, match="unknown pass"):
        dcp_compile.apply(MLAModel(preset("tiny"), 64), 1, disabled_passes=("shard_everything",))
    with pytest.raises(ValueError, match="cannot be disabled"):
        PassManager(PassConfig(), disabled=("verify",))


def test_rewrite_without_group_is_an_error(graph):
    with pytest.raises(RuntimeError, match="process group name"):
        PassManager(PassConfig(dcp_size=2)).run(__import__("copy").deepcopy(graph))


def test_rewritten_graph_is_well_typed(graph):
    gm, _, _ = run_passes(graph, dcp_size=2)
    gm.graph.lint()
    for node in gm.graph.nodes:
        if node.op == "call_function":
            assert "val" in node.meta, node.format_node()


def test_gather_kv_strategy_op_counts(graph):
    gm, report, rec = run_passes(graph, dcp_size=2, attention_strategy="gather-kv")
    assert report.sites("gather_kv_attention") == MLA_LAYERS and report.sites("gather_q_attention") == 0
    after = rec.ops("verify", "after")
    assert "dcp::mla_attention" not in after
    assert after["dcp::gathered_kv_metadata"] == 1  # shared by all layers
    assert after["dcp::gather_local_rows"] == MLA_LAYERS
    assert after["_c10d_functional::all_gather_into_tensor"] == MLA_LAYERS
    assert "_c10d_functional::all_to_all_single" not in after and "dcp::merge_partials" not in after
    _, again, _ = run_passes(gm, dcp_size=2, attention_strategy="gather-kv")
    assert again.sites("gather_kv_attention") == 0


def test_replicated_q_strategy_op_counts(graph):
    """Every rank holds every head (a TP-1 model): each site attends over the local shard for all
    heads and all-gathers its packed (out, lse) for the merge; no Q all-gather, no all-to-all.
    Numerics on 2 ranks: tests/distributed/test_replicated_q.py."""
    gm, report, rec = run_passes(graph, dcp_size=2, attention_strategy="replicated-q")
    assert report.sites("replicated_q_attention") == MLA_LAYERS and report.sites("gather_q_attention") == 0
    after = rec.ops("verify", "after")
    assert "dcp::mla_attention" not in after
    for op in ("dcp::mla_partial_attention", "dcp::pack_partials", "dcp::merge_partials",
               "_c10d_functional::all_gather_into_tensor"):
        assert after[op] == MLA_LAYERS, op
    assert "_c10d_functional::all_to_all_single" not in after
    _, again, _ = run_passes(gm, dcp_size=2, attention_strategy="replicated-q")
    assert again.sites("replicated_q_attention") == 0


def test_metadata_check_once_per_graph(graph):
    _, report, rec = run_passes(graph, dcp_size=2, debug_checks=True)
    assert report.sites("check_metadata") == 1
    assert rec.ops("verify", "after")["dcp::check_metadata"] == 1


@pytest.mark.parametrize("strategy", ["gather-q", "gather-kv"])
def test_lowering_to_triton_swaps_targets(graph, strategy):
    """Forced Triton lowering (the CPU graph runs them under the interpreter in the kernel tests)."""
    gm, report, rec = run_passes(graph, dcp_size=2, attention_strategy=strategy, kernels="triton")
    after = rec.ops("verify", "after")
    assert after["dcp_triton::sharded_kv_write"] == MLA_LAYERS
    assert after["dcp_triton::mla_partial_attention"] == MLA_LAYERS
    assert not any(k in after for k in ("dcp::sharded_kv_write", "dcp::mla_partial_attention", "dcp::pack_partials"))
    if strategy == "gather-q":
        assert after["dcp_triton::local_metadata"] == 1
        assert after["dcp_triton::pack_partials"] == after["dcp_triton::merge_partials"] == MLA_LAYERS


def test_lowering_at_dcp_one_replaces_canonical_ops(graph):
    _, report, rec = run_passes(graph, dcp_size=1, kernels="triton")
    after = rec.ops("verify", "after")
    assert "dcp::mla_attention" not in after and "dcp::mla_kv_write" not in after
    assert after["dcp_triton::mla_partial_attention"] == MLA_LAYERS


def test_auto_lowering_leaves_cpu_graphs_on_reference_kernels(graph):
    _, report, _ = run_passes(graph, dcp_size=2, kernels="auto")
    assert report.sites("lower_kernels") == 0
