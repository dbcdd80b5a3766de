"""A TP rank's load allocates its own share of the checkpoint, not the checkpoint.

The checkpoint (written here) has one dense layer whose MLP is 65536 wide: 48 MiB of fp32 in three
shards; TP rank 3 of 8 should hold 6 MiB of it, down_proj's columns included (a column slice of a
row-major matrix is where a loader is tempted to read the whole tensor).

Measured in a fresh process (a spawned rank) whose malloc returns every block of 64 KiB or more to
the system when freed (MALLOC_MMAP_THRESHOLD_), so that its anonymous RSS is the memory alive:
sampled after every tensor read and every parameter made, and by a thread that samples while the
reads run (torch's copies release the GIL), its peak less the RSS before the load. Sampling can only
miss a peak, never invent one: the bound it checks cannot fail spuriously.
File pages that reading maps in are not counted: they are the kernel's page cache, shared by the
ranks of a host and reclaimable. For scale, the same process then reads the tensors whole.
"""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dcp_compile.runtime.launch import spawn

HIDDEN, WIDTH, TP_SIZE, TP_RANK, VOCAB = 64, 65536, 8, 3, 256
HEADS, ROPE, LATENT, NOPE, VALUE = 8, 8, 32, 16, 16
CONFIG = dict(
    model_type="deepseek_v3", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=WIDTH, num_hidden_layers=1,
    num_attention_heads=HEADS, kv_lora_rank=LATENT, q_lora_rank=None, qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE,
    v_head_dim=VALUE, n_routed_experts=None, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
)
MLP_BYTES = 3 * WIDTH * HIDDEN * 4
MLP_NAMES = ("gate_proj", "up_proj", "down_proj")


def _anonymous_rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon:")) * 1024


def _whole(folder: str, name: str) -> torch.Tensor:
    files = json.loads(open(os.path.join(folder, "model.safetensors.index.json")).read())["weight_map"]
    tensor = f"model.layers.0.mlp.{name}.weight"
    with safe_open(os.path.join(folder, files[tensor]), framework="pt") as shard:
        return shard.get_tensor(tensor).clone()


def measure(rank: int, world_size: int, folder: str) -> dict:
    """In the spawned process: the load's peak, what it keeps, and a whole read's cost."""
    from dcp_compile.models import load_pretrained, pretrained, safetensors_reader
    from dcp_compile.runtime.parallel import ParallelState

    samples = []

    def sampled(method):
        def wrapper(*args, **kwargs):
            result = method(*args, **kwargs)
            samples.append(_anonymous_rss())
            return result
        return wrapper

    safetensors_reader.SafetensorsReader.read = sampled(safetensors_reader.SafetensorsReader.read)
    pretrained.CheckpointWeights._param = sampled(pretrained.CheckpointWeights._param)
    pretrained.CheckpointWeights._experts = sampled(pretrained.CheckpointWeights._experts)
    load = lambda tp_rank: load_pretrained(folder, kv_capacity=16, par=ParallelState(tp_size=TP_SIZE, tp_rank=tp_rank))
    del_me = load(0)  # once first: the first load's one-off allocations are not the loader's
    del del_me
    start = _anonymous_rss()
    samples.clear()
    done = threading.Event()

    def sample_meanwhile():
        while not done.is_set():
            samples.append(_anonymous_rss())

    sampler = threading.Thread(target=sample_meanwhile)
    sampler.start()
    try:
        model = load(TP_RANK)
    finally:
        done.set()
        sampler.join()
    peak = max(samples + [_anonymous_rss()]) - start
    params = dict(model.named_parameters())
    down_columns = params["layers.0.mlp.down"].clone()
    start = _anonymous_rss()
    whole = [_whole(folder, name) for name in MLP_NAMES]
    whole_cost = _anonymous_rss() - start
    width = WIDTH // TP_SIZE
    return {
        "peak": peak, "samples": len(samples), "whole_cost": whole_cost,
        "held": sum(p.numel() * p.element_size() for p in params.values()),
        "largest": max(p.numel() * p.element_size() for p in params.values()),
        "down_columns_match": torch.equal(down_columns, whole[2][:, TP_RANK * width:(TP_RANK + 1) * width]),
    }


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wide")
    gen = torch.Generator().manual_seed(0)
    layer = "model.layers.0."
    small = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN), "lm_head.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
        layer + "input_layernorm.weight": (HIDDEN,), layer + "post_attention_layernorm.weight": (HIDDEN,),
        layer + "self_attn.q_proj.weight": (HEADS * (NOPE + ROPE), HIDDEN),
        layer + "self_attn.kv_a_proj_with_mqa.weight": (LATENT + ROPE, HIDDEN),
        layer + "self_attn.kv_a_layernorm.weight": (LATENT,),
        layer + "self_attn.kv_b_proj.weight": (HEADS * (NOPE + VALUE), LATENT),
        layer + "self_attn.o_proj.weight": (HIDDEN, HEADS * VALUE),
    }
    shards = {"model-00001-of-00004.safetensors": {name: torch.randn(shape, generator=gen) for name, shape in small.items()}}
    for number, (name, shape) in enumerate([("gate_proj", (WIDTH, HIDDEN)), ("up_proj", (WIDTH, HIDDEN)),
                                            ("down_proj", (HIDDEN, WIDTH))], start=2):
        shards[f"model-0000{number}-of-00004.safetensors"] = {f"{layer}mlp.{name}.weight": torch.randn(shape, generator=gen)}
    for file, tensors in shards.items():
        save_file(tensors, str(folder / file))
    weight_map = {name: file for file, tensors in shards.items() for name in tensors}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return folder


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RssAnon from /proc")
def test_a_rank_allocates_its_share_not_the_checkpoint(wide_checkpoint, monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(64 << 10))
    (result,) = spawn(measure, 1, str(wide_checkpoint))
    held, largest = result["held"], result["largest"]
    assert MLP_BYTES // TP_SIZE <= held < MLP_BYTES // TP_SIZE + (1 << 20)
    assert result["down_columns_match"] and result["samples"] >= 13
    # What the model keeps plus a slice in flight; the whole checkpoint never.
    assert held - (1 << 20) <= result["peak"] <= held + largest + (2 << 20)
    assert result["peak"] < MLP_BYTES / 4
    # The measurement sees a whole read for what it costs.
    assert result["whole_cost"] >= 0.95 * MLP_BYTES
