"""`dcp-compile demo --checkpoint` and `dcp-compile dump --checkpoint` on folders transformers wrote."""

from __future__ import annotations

import json
import shutil

import pytest

from dcp_compile.cli import demo
from dcp_compile.cli.main import main
from dcp_compile.harness.scenario import Scenario, request_prompts
from tests.checkpoints import oracle

MOE_LAYERS = 3


def test_demo_dcp2_tp2_on_a_transformers_checkpoint_matches_transformers(v3, capsys):
    """The issue's acceptance command; its greedy tokens are transformers' too."""
    assert main(["demo", "--checkpoint", str(v3.folder), "--dcp-size", "2", "--tp-size", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["tokens_match"] is True and result["outputs_match"] is True and result["finite"] is True
    assert result["pass_summary"]["shard_kv_write"] == 4 * result["graphs_captured"]
    scenario = Scenario(checkpoint=str(v3.folder))
    prompts = request_prompts(scenario, oracle.VOCAB)
    assert [len(p) for p in prompts] == result["contexts"] == [1, 3, 17, 64]
    expected, _ = oracle.transformers_greedy(v3.hf_model, prompts, steps=scenario.steps)
    assert result["generated"] == expected


@pytest.fixture
def with_tokenizer(v3, tmp_path):
    """The V3 folder plus a word-level tokenizer.json: word 'w<i>' is token i."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path / "with-tokenizer"
    shutil.copytree(v3.folder, folder)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(oracle.VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def _fake_compare(seen: list):
    """Stands in for the ranks: records the scenario, 'generates' each prompt reversed."""
    def compare(scenario):
        seen.append(scenario)
        generated = [list(reversed(p)) for p in request_prompts(scenario, scenario.model_config().vocab_size)]
        return {"tokens_match": True, "outputs_match": True, "finite": True, "near_tie_flips": 0, "max_abs_diff": 0.0,
                "tolerance": 1e-5, "contexts": scenario.lengths, "tokens_stored_per_dcp_rank": [1, 1], "tokens_total": 2,
                "kv_rows_per_rank": 1, "kv_capacity_ratio": 2.0, "kv_rows_lost": 0, "pass_summary": {},
                "graphs_captured": 0, "strategy_counts": {}, "last_strategy_reason": None, "seconds": 0.0,
                "generated": generated, "tokens": generated, "device": scenario.device, "emulated": False,
                "graph_replays": 0, "device_graphs_captured": 0, "inner_compile": "eager"}
    return compare


def test_prompt_ids_set_every_request(v3, capsys, monkeypatch):
    seen = []
    monkeypatch.setattr(demo, "compare", _fake_compare(seen))
    assert main(["demo", "--checkpoint", str(v3.folder), "--prompt-ids", "5,17,2", "--batch", "3", "--json"]) == 0
    (scenario,) = seen
    assert scenario.prompt_ids == (5, 17, 2) and scenario.lengths == [3, 3, 3]
    assert request_prompts(scenario, oracle.VOCAB) == [[5, 17, 2]] * 3
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["generated"] == [[2, 17, 5]] * 3 and "generated_text" not in result


def test_prompt_text_goes_through_the_checkpoints_tokenizer(with_tokenizer, capsys, monkeypatch):
    seen = []
    monkeypatch.setattr(demo, "compare", _fake_compare(seen))
    assert main(["demo", "--checkpoint", str(with_tokenizer), "--prompt", "w5 w17 w2 w200", "--batch", "2", "--json"]) == 0
    assert seen[0].prompt_ids == (5, 17, 2, 200)
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["generated_text"] == ["w200 w2 w17 w5"] * 2


def test_dump_captures_a_checkpoints_model_with_its_moe_layers(v3, tmp_path, capsys):
    out = tmp_path / "dump"
    assert main(["dump", "--checkpoint", str(v3.folder), "--out", str(out), "--tp-size", "2", "--dcp-size", "2"]) == 0
    summary = json.loads((out / "dump.json").read_text())
    assert summary["mla_sites"] == summary["mla_sites_rewritten"] == 4
    assert summary["spec"]["checkpoint"] == str(v3.folder) and summary["command"].startswith(
        f"dcp-compile dump --checkpoint {v3.folder} ")
    ops = json.loads((out / "graph00" / "passes.json").read_text())["passes"][0]["ops_before"]
    # noaux_tc with groups: top-2 per group, top groups, top experts, in each MoE layer; one
    # all-reduce per attention and per MLP/MoE block.
    assert ops["topk"] == 3 * MOE_LAYERS and ops["sigmoid"] == MOE_LAYERS
    assert ops["_c10d_functional::all_reduce"] == 2 * 4
    capsys.readouterr()
    assert main(["dump", "--checkpoint", str(v3.folder), "--out", str(tmp_path / "bad"), "--tp-size", "3"]) == 2
    assert "config.json: num_attention_heads 8 does not split over tp_size 3" in capsys.readouterr().err
