"""A NaN or inf weight is an error naming the tensor, the file and the element, found while the
load copies the weights (no extra pass over them): in the file, in a rank's slice only, made by
the conversion to the model's dtype, or in a float8 weight or its scales."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dcp_compile.models import load_pretrained
from dcp_compile.runtime.parallel import ParallelState


@pytest.fixture
def copy_of_v3(v3, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(v3.folder, folder)
    return folder


def set_element(folder, name: str, index: tuple[int, ...], value: float) -> str:
    """Write `value` at `index` of tensor `name` in its shard; return the shard's path."""
    shard = folder / json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(shard)
    tensors[name][index] = value
    save_file(tensors, str(shard))
    return str(shard)


@pytest.mark.parametrize("name, index, value", [
    ("model.layers.2.self_attn.kv_b_proj.weight", (5, 3), float("nan")),
    ("model.layers.0.input_layernorm.weight", (7,), float("inf")),
    ("model.layers.3.mlp.experts.5.up_proj.weight", (23, 0), float("-inf")),
    ("model.embed_tokens.weight", (255, 63), float("nan")),
])
def test_a_nan_or_inf_weight_names_tensor_file_and_element(copy_of_v3, name, index, value):
    shard = set_element(copy_of_v3, name, index, value)
    with pytest.raises(ValueError, match=re.escape(f"tensor {name} in {shard} is not finite: element {list(index)} is "
                                                   f"{value}")):
        load_pretrained(copy_of_v3, kv_capacity=64)


def test_each_rank_checks_the_slice_it_reads(copy_of_v3):
    """down_proj [hidden, intermediate] is split by columns: the inf is in rank 1's columns only."""
    name = "model.layers.0.mlp.down_proj.weight"
    width = json.loads((copy_of_v3 / "config.json").read_text())["intermediate_size"] // 2
    shard = set_element(copy_of_v3, name, (3, width + 2), float("inf"))
    load_pretrained(copy_of_v3, kv_capacity=64, par=ParallelState(tp_size=2, tp_rank=0))
    with pytest.raises(ValueError, match=re.escape(f"tensor {name} in {shard} is not finite: element [3, {width + 2}] "
                                                   "is inf")):
        load_pretrained(copy_of_v3, kv_capacity=64, par=ParallelState(tp_size=2, tp_rank=1))


def test_a_weight_beyond_the_model_dtypes_range_is_named(copy_of_v3):
    name = "model.layers.1.self_attn.o_proj.weight"
    shard = set_element(copy_of_v3, name, (0, 1), 1e5)
    assert torch.isfinite(load_pretrained(copy_of_v3, kv_capacity=64, dtype=torch.bfloat16).layers[1].attn.o_proj).all()
    with pytest.raises(ValueError, match=re.escape(f"tensor {name} in {shard} is not finite in torch.float16, the model's "
                                                   "dtype: element [0, 1] is 100000.0, beyond its range")):
        load_pretrained(copy_of_v3, kv_capacity=64, dtype=torch.float16)


def test_finite_weights_whose_sum_overflows_load(copy_of_v3):
    """The check's float32 sum overflows here; the elements themselves are finite."""
    name = "model.layers.1.self_attn.o_proj.weight"
    set_element(copy_of_v3, name, (0, 1), 3e38)
    set_element(copy_of_v3, name, (2, 5), 3e38)
    o_proj = load_pretrained(copy_of_v3, kv_capacity=64).layers[1].attn.o_proj
    assert o_proj[0, 1] == o_proj[2, 5] == torch.tensor(3e38) and torch.isfinite(o_proj).all()
