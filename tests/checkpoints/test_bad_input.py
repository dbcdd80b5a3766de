"""Bad checkpoints and bad sizes: each a ValueError that names the file, tensor or field, raised
before any weight is used (and, through the demo, before any rank starts)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from safetensors.torch import load_file, save_file

from dcp_compile.cli.main import main
from dcp_compile.models import load_pretrained
from dcp_compile.models.hf_config import read_config
from dcp_compile.runtime.parallel import ParallelState


@pytest.fixture
def copy_of_v3(v3, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(v3.folder, folder)
    return folder


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))


def test_missing_shard_names_the_file(copy_of_v3):
    index = json.loads((copy_of_v3 / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (copy_of_v3 / shard).unlink()
    with pytest.raises(ValueError, match=f"checkpoint shard .*{shard} is missing: model.safetensors.index.json lists it"):
        load_pretrained(copy_of_v3, kv_capacity=64)


def _bad_json_header(data: bytes) -> bytes:
    return (16).to_bytes(8, "little") + b"{not json, at a" + data[23:]


@pytest.mark.parametrize("damage, message", [
    (lambda data: data[: len(data) // 2], r"is truncated: tensor .* ends at byte \d+ of the data, which holds \d+ bytes"),
    (lambda data: b"\xff" * len(data), r"is not a safetensors file, or is truncated: its header length "
                                        r"18446744073709551615 exceeds the \d+ bytes that follow it"),
    (lambda data: data[:5], r"is not a safetensors file: 5 bytes, fewer than the header length's 8"),
    (_bad_json_header, r"is not a safetensors file: its header is not JSON"),
], ids=["truncated", "garbage", "shorter-than-8-bytes", "header-not-json"])
def test_damaged_shard_names_the_file_before_any_weight_is_read(copy_of_v3, damage, message, capsys, monkeypatch):
    from dcp_compile.harness import scenario

    index = json.loads((copy_of_v3 / "model.safetensors.index.json").read_text())
    shard = copy_of_v3 / sorted(set(index["weight_map"].values()))[1]
    shard.write_bytes(damage(shard.read_bytes()))
    with pytest.raises(ValueError, match=f"{shard} {message}"):
        load_pretrained(copy_of_v3, kv_capacity=64)
    monkeypatch.setattr(scenario, "spawn", lambda *a, **k: pytest.fail("a rank was started"))
    assert main(["demo", "--checkpoint", str(copy_of_v3)]) == 2
    assert str(shard) in capsys.readouterr().err


def _header(shard) -> tuple[dict, bytes]:
    """A safetensors file's JSON header and the data after it."""
    data = shard.read_bytes()
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + length]), data[8 + length:]


def _write_with_header(shard, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    shard.write_bytes(len(text).to_bytes(8, "little") + text + data)


def _refused_before_any_rank(folder, message, capsys, monkeypatch) -> None:
    from dcp_compile.harness import scenario

    monkeypatch.setattr(scenario, "spawn", lambda *a, **k: pytest.fail("a rank was started"))
    assert main(["demo", "--checkpoint", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dcp-compile demo: error: ") and message in err and err.count("\n") == 1, err


def test_index_that_maps_a_tensor_to_the_wrong_shard_names_index_and_shard(copy_of_v3, capsys, monkeypatch):
    index_path = copy_of_v3 / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.layers.2.self_attn.kv_b_proj.weight"
    wrong = next(file for file in sorted(set(index["weight_map"].values())) if file != index["weight_map"][name])
    index["weight_map"][name] = wrong
    index_path.write_text(json.dumps(index))
    message = f"{index_path} maps tensor {name} to {copy_of_v3 / wrong}, which does not hold it (1 such tensors)"
    with pytest.raises(ValueError, match=re.escape(message)):
        load_pretrained(copy_of_v3, kv_capacity=64)
    _refused_before_any_rank(copy_of_v3, message, capsys, monkeypatch)


def test_shard_whose_tensors_overlap_names_the_file(copy_of_v3, capsys, monkeypatch):
    """A tensor moved back into the bytes of the tensor before it (its size unchanged): safetensors
    refuses the file with an error that names no file, and did so in the ranks."""
    files = list(json.loads((copy_of_v3 / "model.safetensors.index.json").read_text())["weight_map"].values())
    shard = copy_of_v3 / max(sorted(set(files)), key=files.count)
    header, data = _header(shard)
    spans = sorted((entry["data_offsets"], name) for name, entry in header.items() if name != "__metadata__")
    ((start, end), first), (_, second) = spans[0], spans[1]
    moved = [end - (end - start) // 2, header[second]["data_offsets"][1] - (end - start) // 2]
    header[second]["data_offsets"] = moved
    _write_with_header(shard, header, data)
    message = (f"{shard} is not a safetensors file: tensor {second}'s data_offsets [{moved[0]}, {moved[1]}) overlap "
               f"tensor {first}'s, which ends at byte {end}")
    with pytest.raises(ValueError, match=re.escape(message)):
        load_pretrained(copy_of_v3, kv_capacity=64)
    _refused_before_any_rank(copy_of_v3, message, capsys, monkeypatch)


@pytest.mark.parametrize("edit, message", [
    (lambda header, name: header[name].update(shape=[3]), r"tensor {name} \(\w+, shape \[3\]\) needs \d+ bytes, and its "
                                                          r"data_offsets span \d+"),
    (lambda header, name: header[name].update(dtype="Q9"), "cannot be read as safetensors: "),
], ids=["size-not-its-shape", "unknown-dtype"])
def test_shard_that_safetensors_refuses_names_the_file(copy_of_v3, edit, message):
    index = json.loads((copy_of_v3 / "model.safetensors.index.json").read_text())
    shard = copy_of_v3 / sorted(set(index["weight_map"].values()))[1]
    header, data = _header(shard)
    name = next(name for name in header if name != "__metadata__")
    edit(header, name)
    _write_with_header(shard, header, data)
    with pytest.raises(ValueError, match=re.escape(str(shard)) + ".*" + message.format(name=re.escape(name))):
        load_pretrained(copy_of_v3, kv_capacity=64)


def test_index_whose_weight_map_is_not_an_object_names_the_file(copy_of_v3):
    (copy_of_v3 / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.norm.weight"]}))
    with pytest.raises(ValueError, match="model.safetensors.index.json is not a safetensors index"):
        load_pretrained(copy_of_v3, kv_capacity=64)


def test_tensor_with_a_wrong_shape_names_tensor_and_file(copy_of_v3):
    index = json.loads((copy_of_v3 / "model.safetensors.index.json").read_text())
    name = "model.layers.2.self_attn.kv_b_proj.weight"
    shard = index["weight_map"][name]
    tensors = load_file(copy_of_v3 / shard)
    tensors[name] = tensors[name][:-1]
    save_file(tensors, str(copy_of_v3 / shard))
    with pytest.raises(ValueError, match=rf"tensor {name} in .*{shard} has shape \[223, 32\]; the config .* gives \[224, 32\]"):
        load_pretrained(copy_of_v3, kv_capacity=64)


def test_missing_tensor_names_tensor_and_index(copy_of_v3):
    index_path = copy_of_v3 / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["model.layers.3.mlp.experts.5.up_proj.weight"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"tensor model.layers.3.mlp.experts.5.up_proj.weight is not in the checkpoint "
                                         r"\(.*model.safetensors.index.json\)"):
        load_pretrained(copy_of_v3, kv_capacity=64)


@pytest.mark.parametrize("changes, message", [
    (dict(kv_lora_rank=None), "kv_lora_rank is missing: load_pretrained reads MLA"),
    (dict(model_type="llama"), "model_type 'llama' is not supported; supported: deepseek_v3, kimi_k2, deepseek_v2"),
    (dict(topk_method="aux_free"), "topk_method 'aux_free' is not supported"),
    (dict(scoring_func="relu"), "scoring_func 'relu' is not supported"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim must be even"),
    (dict(v_head_dim=None), "v_head_dim is missing"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4}), "rope_parameters.type 'llama3' is not supported"),
    (dict(n_group=3), "n_group 3 does not divide n_routed_experts 16"),
    (dict(num_experts_per_tok=17), "num_experts_per_tok 17 exceeds n_routed_experts 16"),
    (dict(quantization_config={"quant_method": "gptq"}), "quantization_config.quant_method 'gptq' is not supported"),
    (dict(attention_bias=True), "attention_bias true is not supported"),
])
def test_bad_config_names_the_field(copy_of_v3, changes, message):
    edit_config(copy_of_v3, **changes)
    with pytest.raises(ValueError, match=f"config.json: {message}"):
        read_config(copy_of_v3)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("field, value", [
    ("rope_parameters.rope_theta", 0), ("rope_parameters.rope_theta", -1e4), ("rope_parameters.rope_theta", NAN),
    ("rope_parameters.factor", NAN), ("rope_parameters.factor", INF), ("rope_parameters.beta_fast", -32),
    ("rope_parameters.beta_slow", NAN), ("rope_parameters.mscale", NAN), ("rope_parameters.mscale_all_dim", -0.7),
    ("rope_parameters.attention_factor", INF), ("rope_parameters.attention_factor", 0),
    ("routed_scaling_factor", NAN), ("routed_scaling_factor", 0), ("routed_scaling_factor", -INF),
    ("rms_norm_eps", 0), ("rms_norm_eps", INF), ("rms_norm_eps", 10**400),
], ids=lambda value: value if isinstance(value, str) else repr(value)[:8])
def test_a_number_the_model_cannot_use_names_the_field(copy_of_v3, field, value):
    """0, negative, NaN or inf where the model needs a finite number > 0: never bent into a default."""
    config = json.loads((copy_of_v3 / "config.json").read_text())
    *parents, key = field.split(".")
    node = config
    for parent in parents:
        node = node[parent]
    node[key] = value
    (copy_of_v3 / "config.json").write_text(json.dumps(config))  # Python's json writes NaN and Infinity
    with pytest.raises(ValueError, match=re.escape(f"config.json: {field} must be a finite positive number, got "
                                                   f"{json.loads(json.dumps(value))!r}")):
        read_config(copy_of_v3)


def test_rope_theta_0_is_an_error_not_the_default(copy_of_v3):
    edit_config(copy_of_v3, rope_parameters=None, rope_theta=0)
    with pytest.raises(ValueError, match=re.escape("config.json: rope_theta must be a finite positive number, got 0")):
        read_config(copy_of_v3)
    edit_config(copy_of_v3, rope_theta=None)
    assert read_config(copy_of_v3).model.rope_theta == 10000.0  # transformers' default, where the field is absent


@pytest.mark.parametrize("changes, tp_size, message", [
    ({}, 3, "num_attention_heads 8 does not split over tp_size 3"),
    (dict(moe_intermediate_size=20), 8, "moe_intermediate_size 20 does not split over tp_size 8"),
    (dict(intermediate_size=100), 8, "intermediate_size 100 does not split over tp_size 8"),
])
def test_tp_size_that_does_not_split_names_the_field(copy_of_v3, changes, tp_size, message):
    edit_config(copy_of_v3, **changes)
    with pytest.raises(ValueError, match=f"config.json: {message}; allowed tp sizes"):
        load_pretrained(copy_of_v3, kv_capacity=64, par=ParallelState(tp_size=tp_size))


def test_no_weights_and_no_config(tmp_path, copy_of_v3):
    with pytest.raises(ValueError, match="config.json is missing"):
        load_pretrained(tmp_path, kv_capacity=64)
    for file in copy_of_v3.glob("*.safetensors*"):
        file.unlink()
    with pytest.raises(ValueError, match="has neither model.safetensors.index.json nor model.safetensors"):
        load_pretrained(copy_of_v3, kv_capacity=64)
    with pytest.raises(ValueError, match=r"num_layers must be in \[1, 4\]"):
        load_pretrained(copy_of_v3, kv_capacity=64, num_layers=5)


@pytest.mark.parametrize("text, kind", [("[1, 2]", "a JSON array"), ('"v3"', "a JSON string"), ("null", "JSON null")])
def test_config_that_is_not_an_object_names_the_file(copy_of_v3, text, kind, capsys, monkeypatch):
    from dcp_compile.harness import scenario

    (copy_of_v3 / "config.json").write_text(text)
    with pytest.raises(ValueError, match=f"config.json must hold a JSON object of the model's settings, not {kind}"):
        read_config(copy_of_v3)
    monkeypatch.setattr(scenario, "spawn", lambda *a, **k: pytest.fail("a rank was started"))
    assert main(["demo", "--checkpoint", str(copy_of_v3)]) == 2
    assert capsys.readouterr().err == (f"dcp-compile demo: error: {copy_of_v3 / 'config.json'} must hold a JSON object "
                                       f"of the model's settings, not {kind}\n")


@pytest.mark.parametrize("args, message", [
    (["--tp-size", "3"], "num_attention_heads 8 does not split over tp_size 3"),
    (["--layers", "5"], "layers 5 exceeds the checkpoint's num_hidden_layers 4"),
    (["--model", "tiny"], "--model and --checkpoint exclude each other"),
    (["--prompt-ids", "5,x"], "--prompt-ids takes a comma list of token ids"),
    (["--prompt-ids", "5,256"], r"prompt ids must be a non-empty list of token ids in [0, 256)"),
    (["--prompt-ids", "5", "--prompt", "hi"], "--prompt and --prompt-ids exclude each other"),
    (["--prompt-ids", "5", "--context", "3"], "--context sets random prompts' lengths"),
    (["--prompt", "hi"], "--prompt needs --checkpoint DIR with a tokenizer.json"),
])
def test_bad_demo_input_with_a_checkpoint_is_one_line_and_exit_2_before_any_rank(
        v3, args, message, capsys, monkeypatch):
    from dcp_compile.harness import scenario

    monkeypatch.setattr(scenario, "spawn", lambda *a, **k: pytest.fail("a rank was started"))
    assert main(["demo", "--checkpoint", str(v3.folder), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_demo_refuses_a_checkpoint_with_a_missing_shard_before_any_rank(copy_of_v3, capsys, monkeypatch):
    from dcp_compile.harness import scenario

    index = json.loads((copy_of_v3 / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    (copy_of_v3 / shard).unlink()
    monkeypatch.setattr(scenario, "spawn", lambda *a, **k: pytest.fail("a rank was started"))
    assert main(["demo", "--checkpoint", str(copy_of_v3)]) == 2
    assert f"{shard} is missing" in capsys.readouterr().err
