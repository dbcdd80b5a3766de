"""Tiny DeepSeek-V3 / V2 checkpoints written by transformers, and greedy runs of both sides.

transformers is the oracle: its DeepseekV3ForCausalLM / DeepseekV2ForCausalLM define what a
checkpoint means. The checkpoints are 4 layers (a dense first layer, then MoE layers), random
weights at a scale where logits spread over several units (transformers' 0.02 init makes every
token a near-tie), routing biases and norm weights randomised too, saved in small shards so that
the index is exercised.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from dcp_compile.runtime.batch import RequestTable

PROMPT_LENGTHS = (1, 4, 11, 29)
"""A batch of mixed lengths: below, at and above dcp_size, with empty shards at DCP 4."""
STEPS = 16
VOCAB = 256
REL_TOLERANCE = 1e-4
"""fp32: max|logits - logits(transformers)| / max|logits(transformers)| per step."""

COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
    v_head_dim=12, first_k_dense_replace=1, moe_layer_freq=1, max_position_embeddings=512, tie_word_embeddings=False,
    rope_theta=10000.0,
)
CONFIGS = {
    # q-LoRA, YaRN with both mscales (so the softmax scale and cos/sin are scaled), sigmoid scores with a
    # correction bias, 4 groups of 4 experts of which 2 groups are kept, normalised top-3, and an eps
    # far from the latent norms' fixed 1e-6, so that using the wrong one shows.
    "deepseek_v3": dict(
        COMMON, q_lora_rank=24, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=3, n_group=4, topk_group=2,
        topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
        rms_norm_eps=1e-2,
        rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.7},
    ),
    # No q-LoRA (q_proj), softmax scores, group-limited greedy, 2 shared experts, unnormalised
    # weights, plain rope.
    "deepseek_v2": dict(
        COMMON, q_lora_rank=None, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2, n_group=4, topk_group=2,
        topk_method="group_limited_greedy", scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=1.5,
        rms_norm_eps=1e-6,
    ),
}


def transformers_model(model_type: str, seed: int = 0, **changes):
    """A randomised tiny model of CONFIGS[model_type], with `changes` to its config."""
    import transformers

    config_class, model_class = {
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
        "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
    }[model_type]
    torch.manual_seed(seed)
    model = model_class(config_class(**dict(CONFIGS[model_type], **changes)))
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[-1]))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen))
    return model.eval()


def write_checkpoint(model_type: str, folder: Path, seed: int = 0, **changes):
    """Save a tiny model in shards of at most 64 KB; returns the transformers model."""
    model = transformers_model(model_type, seed, **changes)
    model.save_pretrained(folder, max_shard_size="64KB")
    return model


def prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1000 + seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@torch.no_grad()
def transformers_greedy(model, prompt_list: list[list[int]], steps: int = STEPS) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Each request alone: (tokens [B][steps + 1], logits per step [B, vocab] x (steps + 1))."""
    tokens, logits = [], []
    for prompt in prompt_list:
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        rows, chosen = [out.logits[0, -1].float()], [int(out.logits[0, -1].argmax())]
        for _ in range(steps):
            out = model(input_ids=torch.tensor([[chosen[-1]]]), cache=out.cache, use_cache=True)
            rows.append(out.logits[0, -1].float())
            chosen.append(int(rows[-1].argmax()))
        tokens.append(chosen)
        logits.append(torch.stack(rows))
    return tokens, list(torch.stack(logits, dim=1))


@torch.no_grad()
def greedy(model, prompt_list: list[list[int]], steps: int = STEPS, capacity: int = 512, dcp_size: int = 1,
           pad_rows: int = 1) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The same greedy run through one batch of the reference model (raw, or what apply() returned):
    prefill of every prompt at once, then `steps` decode steps, a padded row in every batch."""
    batch_size = len(prompt_list)
    table = RequestTable(batch_size, max(map(len, prompt_list)) + steps + 1, capacity, dcp_size=dcp_size)
    requests = list(range(batch_size))
    feed, tokens, logits = [list(p) for p in prompt_list], [[] for _ in requests], []
    for _ in range(steps + 1):
        batch = table.extend_batch(requests, feed, pad_rows=pad_rows)
        kwargs = {"host_metadata": batch.host} if dcp_size > 1 else {}
        out = model(*batch.args(), **kwargs)[:batch_size].float()
        logits.append(out)
        for b in requests:
            tokens[b].append(int(out[b].argmax()))
        feed = [[t[-1]] for t in tokens]
    return tokens, logits


def max_relative_diff(logits: list, reference: list[torch.Tensor]) -> float:
    return max(float((torch.as_tensor(a) - b).abs().max() / b.abs().max()) for a, b in zip(logits, reference))


def _portable(run: tuple[list[list[int]], list[torch.Tensor]]):
    """A run a rank can return: torch's queue would pass tensors through shared memory that dies
    with the rank's process."""
    tokens, logits = run
    return tokens, [step.numpy() for step in logits]


def quantize_fp8(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style block quantization: (float8_e4m3fn weight, fp32 scale_inv per block)."""
    rows, cols = weight.shape
    row_blocks, col_blocks = -(-rows // block), -(-cols // block)
    padded = torch.zeros(row_blocks * block, col_blocks * block)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(row_blocks, block, col_blocks, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / torch.finfo(torch.float8_e4m3fn).max
    quantized = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(row_blocks * block, col_blocks * block)
    return quantized[:rows, :cols].contiguous(), scale


def dequantize_fp8(quantized: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    rows, cols = quantized.shape
    expanded = scale.repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)[:rows, :cols]
    return quantized.float() * expanded


def is_quantized_weight(name: str, tensor: torch.Tensor) -> bool:
    """The matrices DeepSeek-V3's FP8 release quantizes: every projection, not the embedding, the
    head, the router or the norms."""
    return tensor.dim() == 2 and "_proj" in name and name.endswith(".weight")


def tp_ranks_worker(rank: int, world_size: int, folders: dict[str, str], prompt_list: list[list[int]],
                    dcp_sizes: dict[str, tuple[int, ...]]) -> dict:
    """One rank of a TP group of world_size: for each checkpoint, the eager TP model's greedy run,
    then the same model under apply(dcp_size) for each of its dcp sizes (compiled, KV sharded)."""
    from dcp_compile import api
    from dcp_compile.models import load_pretrained
    from dcp_compile.runtime import parallel

    tp = parallel.build(world_size, 1)
    runs = {}
    for model_type, folder in folders.items():
        runs[(model_type, "tp")] = _portable(greedy(load_pretrained(folder, kv_capacity=512, par=tp), prompt_list))
        for dcp_size in dcp_sizes.get(model_type, ()):
            model = api.apply(load_pretrained(folder, kv_capacity=512, par=tp), dcp_size, debug_checks=True)
            runs[(model_type, f"dcp{dcp_size}")] = _portable(greedy(model, prompt_list, dcp_size=dcp_size))
    return runs
