"""FP8 block-quantized checkpoints: the test quantizes the tiny DeepSeek-V3 checkpoint itself
(float8_e4m3fn, one fp32 weight_scale_inv per 128 x 128 block; the tiny matrices have partial last
blocks, and at TP 2 a rank's rows start inside a block), then checks the dequantized load."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dcp_compile.models import load_pretrained
from dcp_compile.runtime.parallel import ParallelState
from tests.checkpoints import oracle

QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


@pytest.fixture(scope="module")
def fp8_folders(v3, tmp_path_factory):
    """(the FP8 checkpoint in one model.safetensors, the same weights dequantized by this test in fp32,
    the largest relative error quantization gave a matrix)."""
    tensors = {}
    for shard in sorted(v3.folder.glob("*.safetensors")):
        tensors.update(load_file(shard))
    quantized, dequantized, partial, weight_error = {}, {}, 0, 0.0
    for name, tensor in tensors.items():
        if oracle.is_quantized_weight(name, tensor):
            values, scale = oracle.quantize_fp8(tensor)
            quantized[name], quantized[f"{name}_scale_inv"] = values, scale
            dequantized[name] = oracle.dequantize_fp8(values, scale)
            partial += any(n % 128 for n in tensor.shape) and max(tensor.shape) > 128
            weight_error = max(weight_error, float((dequantized[name] - tensor).norm() / tensor.norm()))
        else:
            quantized[name] = dequantized[name] = tensor
    assert partial >= 3, "the tiny model must have matrices with a whole and a partial block"
    config = json.loads((v3.folder / "config.json").read_text())
    fp8 = tmp_path_factory.mktemp("fp8")
    save_file(quantized, str(fp8 / "model.safetensors"))
    (fp8 / "config.json").write_text(json.dumps({**config, "quantization_config": QUANTIZATION_CONFIG}))
    reference = tmp_path_factory.mktemp("fp8-dequantized")
    save_file(dequantized, str(reference / "model.safetensors"))
    shutil.copy(v3.folder / "config.json", reference / "config.json")
    return fp8, reference, weight_error


@pytest.mark.parametrize("tp_size", [1, 2])
def test_dequantized_weights_equal_the_tests_own_dequantization(fp8_folders, tp_size):
    fp8, reference, _ = fp8_folders
    for tp_rank in range(tp_size):
        par = ParallelState(tp_size=tp_size, tp_rank=tp_rank)  # weights only: no process group is needed
        loaded = dict(load_pretrained(fp8, kv_capacity=64, par=par).named_parameters())
        expected = dict(load_pretrained(reference, kv_capacity=64, par=par).named_parameters())
        assert loaded.keys() == expected.keys()
        for name, param in loaded.items():
            assert torch.equal(param, expected[name]), f"TP {tp_size} rank {tp_rank}: {name}"
    bf16 = load_pretrained(fp8, kv_capacity=64, dtype=torch.bfloat16)
    w_uk = dict(load_pretrained(reference, kv_capacity=64).named_parameters())["layers.1.attn.w_uk"]
    assert bf16.layers[1].attn.w_uk.dtype == torch.bfloat16
    assert torch.equal(bf16.layers[1].attn.w_uk, w_uk.to(torch.bfloat16))


def test_fp8_logits_are_within_quantization_error(fp8_folders, v3):
    """Each quantized matrix is off by weight_error (relative; e4m3 keeps 3 mantissa bits). To first
    order, a chain of matrices is off by the sum of theirs: the dense first layer's path to the
    logits (q_a, q_b, kv_a, kv_b, o_proj, then the MLP) crosses fewer than 8. The MoE layers are left
    out: a routing choice near a tie flips under any perturbation, and the logits jump with it."""
    fp8, _, weight_error = fp8_folders
    _, logits = oracle.greedy(load_pretrained(fp8, kv_capacity=512, num_layers=1), v3.prompts, steps=0)
    _, unquantized = oracle.greedy(load_pretrained(v3.folder, kv_capacity=512, num_layers=1), v3.prompts, steps=0)
    relative = float((logits[0] - unquantized[0]).norm() / unquantized[0].norm())
    assert 0.01 < weight_error < 0.07
    assert weight_error / 10 < relative < 8 * weight_error


@pytest.mark.parametrize("suffix, index, value", [("", (130, 17), float("nan")), ("_scale_inv", (0, 0), float("inf"))],
                         ids=["nan-in-the-float8-values", "inf-in-the-scales"])
def test_a_non_finite_float8_weight_or_scale_names_the_tensor(fp8_folders, tmp_path, suffix, index, value):
    fp8, _, _ = fp8_folders
    folder = tmp_path / "fp8"
    shutil.copytree(fp8, folder)
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    tensors = load_file(folder / "model.safetensors")
    assert tensors[name].dtype == torch.float8_e4m3fn
    tensors[name + suffix][index] = value
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=re.escape(f"tensor {name + suffix} in {folder / 'model.safetensors'} is not "
                                                   f"finite: element {list(index)} is {value}")):
        load_pretrained(folder, kv_capacity=64)
