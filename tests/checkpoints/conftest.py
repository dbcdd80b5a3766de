"""Session fixtures: the tiny checkpoints transformers writes, and transformers' greedy runs on
them (built once, shared by every test of this folder)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.checkpoints import oracle


@dataclass
class Reference:
    """A checkpoint folder and transformers' greedy run of oracle.prompts() on it."""

    model_type: str
    folder: Path
    prompts: list[list[int]]
    tokens: list[list[int]]
    logits: list[torch.Tensor]
    hf_model: torch.nn.Module


def _reference(model_type: str, tmp_path_factory) -> Reference:
    folder = tmp_path_factory.mktemp(model_type)
    model = oracle.write_checkpoint(model_type, folder)
    prompts = oracle.prompts()
    tokens, logits = oracle.transformers_greedy(model, prompts)
    return Reference(model_type, folder, prompts, tokens, logits, model)


@pytest.fixture(scope="session")
def v3(tmp_path_factory) -> Reference:
    return _reference("deepseek_v3", tmp_path_factory)


@pytest.fixture(scope="session")
def v2(tmp_path_factory) -> Reference:
    return _reference("deepseek_v2", tmp_path_factory)


@pytest.fixture(scope="session")
def references(v3, v2) -> dict[str, Reference]:
    return {"deepseek_v3": v3, "deepseek_v2": v2}
