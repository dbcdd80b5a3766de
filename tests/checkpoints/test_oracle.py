"""load_pretrained against transformers: fp32 logits to 1e-4 relative and identical greedy tokens,
through a mixed-length prefill and 16 decode steps, at TP 1, 2 and 4, and under DCP 2 (both
checkpoints) and DCP 4 (DeepSeek-V3's: the one with every feature, and the costliest run here).

The multi-rank runs are one spawn per TP size (gloo), each running all of its checks; the tests
below read their results."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass

import pytest

from dcp_compile.models import load_pretrained
from dcp_compile.runtime.launch import spawn
from tests.checkpoints import oracle

MODEL_TYPES = ("deepseek_v3", "deepseek_v2")


def assert_matches(run, reference, label: str) -> None:
    tokens, logits = run
    relative = oracle.max_relative_diff(logits, reference.logits)
    assert relative < oracle.REL_TOLERANCE, f"{label}: logits differ from transformers' by {relative:.2e} (relative)"
    assert tokens == reference.tokens, f"{label}: greedy tokens differ from transformers'"


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_tp1_matches_transformers(references, model_type):
    reference = references[model_type]
    model = load_pretrained(reference.folder, kv_capacity=512)
    assert_matches(oracle.greedy(model, reference.prompts), reference, f"{model_type} TP 1")
    assert model.cfg.has_dense_layers and model.cfg.has_moe_layers
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["MLP", "MoE", "MoE", "MoE"]


VARIANTS = {
    # transformers saves no lm_head: the head is the embedding
    "tied-embeddings": ("deepseek_v2", dict(tie_word_embeddings=True)),
    # rope dims stored in rotate-half order: nothing to permute
    "rope-not-interleaved": ("deepseek_v3", dict(rope_interleave=False)),
    # Moonlight's shape: V3 without q-LoRA and without rope scaling, one expert group
    "moonlight-like": ("deepseek_v3", dict(q_lora_rank=None, rope_scaling=None, n_group=1, topk_group=1)),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_variants_match_transformers(tmp_path, variant):
    model_type, changes = VARIANTS[variant]
    model = oracle.write_checkpoint(model_type, tmp_path, seed=2, num_hidden_layers=2, **changes)
    prompts = oracle.prompts()
    tokens, logits = oracle.transformers_greedy(model, prompts, steps=4)
    loaded = load_pretrained(tmp_path, kv_capacity=512)
    assert_matches(oracle.greedy(loaded, prompts, steps=4), _Run(tokens, logits), variant)
    if changes.get("tie_word_embeddings"):
        assert "lm_head.weight" not in (tmp_path / "model.safetensors.index.json").read_text()
        assert loaded.lm_head is loaded.embed


def test_kimi_k2_reads_as_deepseek_v3(v3, tmp_path):
    """Kimi-K2's model_type is kimi_k2, its architecture DeepSeek-V3's (transformers has no kimi_k2 type)."""
    folder = tmp_path / "kimi"
    shutil.copytree(v3.folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    assert_matches(oracle.greedy(load_pretrained(folder, kv_capacity=512), v3.prompts), v3, "kimi_k2")


@dataclass
class _Run:
    tokens: list
    logits: list


def _spawn_tp(references, world_size: int, dcp_sizes: dict[str, tuple[int, ...]]) -> list[dict]:
    folders = {model_type: str(references[model_type].folder) for model_type in MODEL_TYPES}
    return spawn(oracle.tp_ranks_worker, world_size, folders, oracle.prompts(), dcp_sizes)


@pytest.fixture(scope="module")
def tp2_runs(references):
    return _spawn_tp(references, 2, {"deepseek_v3": (2,), "deepseek_v2": (2,)})


@pytest.fixture(scope="module")
def tp4_runs(references):
    return _spawn_tp(references, 4, {"deepseek_v3": (4,)})


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_tp2_matches_transformers(tp2_runs, references, model_type):
    for rank, runs in enumerate(tp2_runs):
        assert_matches(runs[(model_type, "tp")], references[model_type], f"{model_type} TP 2 rank {rank}")


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_dcp2_matches_transformers(tp2_runs, references, model_type):
    for rank, runs in enumerate(tp2_runs):
        assert_matches(runs[(model_type, "dcp2")], references[model_type], f"{model_type} DCP 2 x TP 2 rank {rank}")


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_tp4_matches_transformers(tp4_runs, references, model_type):
    for rank, runs in enumerate(tp4_runs):
        assert_matches(runs[(model_type, "tp")], references[model_type], f"{model_type} TP 4 rank {rank}")


def test_dcp4_matches_transformers(tp4_runs, v3):
    for rank, runs in enumerate(tp4_runs):
        assert_matches(runs[("deepseek_v3", "dcp4")], v3, f"deepseek_v3 DCP 4 x TP 4 rank {rank}")
