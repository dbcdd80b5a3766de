"""The stand-ins of the Ascend ops on the (emulated) npu device: schemas, numerics against a dense
reference computed on CPU copies, limits, fakes, and no kernel for CPU tensors (as torch_npu's ops)."""

from __future__ import annotations

import importlib.util
import math
import re
from dataclasses import dataclass

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dcp_compile.testing import npu_standin as standin

assert standin.register() is True

fia = torch.ops.npu.npu_fused_infer_attention_score
attention_update = torch.ops.npu.npu_attention_update
NPU = "npu"

HEADS = 4
LATENT_DIM = 512
ROPE_DIM = 64
BLOCK_SIZE = 16
TABLE_WIDTH = 4
NUM_BLOCKS = 20
SCALE = 1.0 / math.sqrt(LATENT_DIM + ROPE_DIM)

# Copied from docs/ascend.md §1.1 and §8.1 (the op-plugin yaml), independently of standin.py.
ASCEND_FIA_ARGUMENTS = (
    'Tensor query, Tensor key, Tensor value, *, Tensor? pse_shift=None, Tensor? atten_mask=None, SymInt[]? actual_seq_lengths=None, SymInt[]? actual_seq_lengths_kv=None, Tensor? dequant_scale1=None, Tensor? quant_scale1=None, Tensor? dequant_scale2=None, Tensor? quant_scale2=None, Tensor? quant_offset2=None, Tensor? antiquant_scale=None, Tensor? antiquant_offset=None, Tensor? key_antiquant_scale=None, Tensor? key_antiquant_offset=None, Tensor? value_antiquant_scale=None, Tensor? value_antiquant_offset=None, Tensor? block_table=None, Tensor? query_padding_size=None, Tensor? kv_padding_size=None, Tensor? key_shared_prefix=None, Tensor? value_shared_prefix=None, SymInt[]? actual_shared_prefix_len=None, Tensor? query_rope=None, Tensor? key_rope=None, Tensor? key_rope_antiquant_scale=None, int num_heads=1, float scale=1.0, int pre_tokens=2147483647, int next_tokens=2147483647, str input_layout="BSH", int num_key_value_heads=0, int sparse_mode=0, int inner_precise=0, int block_size=0, int antiquant_mode=0, int key_antiquant_mode=0, int value_antiquant_mode=0, bool softmax_lse_flag=False'  # noqa: E501
)
ASCEND_SCHEMAS = {
    "default": f"npu_fused_infer_attention_score({ASCEND_FIA_ARGUMENTS}) -> (Tensor, Tensor)",
    # The registered string (libtorch_npu.so of torch_npu 2.10.0.post6, 2.13.0, 2.14.0), not the codegen
    # yaml's `Tensor(a!) attention_out, Tensor(b!) softmax_lse` (docs/ascend.md §21.2).
    "out": f"npu_fused_infer_attention_score.out({ASCEND_FIA_ARGUMENTS}, Tensor? workspace=None, Tensor[] out) -> (Tensor, Tensor)",  # noqa: E501
    "workspace": f"_npu_fused_infer_attention_score_get_max_workspace({ASCEND_FIA_ARGUMENTS}) -> Tensor",
}
ASCEND_ATTENTION_UPDATE_SCHEMA = (
    "npu::npu_attention_update(Tensor[] lse, Tensor[] local_out, int update_type) -> (Tensor, Tensor)"
)


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def on_npu(value):
    """value with every CPU tensor in it (in tuples, lists and dicts too) copied to the npu device."""
    if isinstance(value, torch.Tensor):
        return value.to(NPU) if value.device.type == "cpu" else value
    if isinstance(value, (list, tuple)):
        return type(value)(on_npu(v) for v in value)
    if isinstance(value, dict):
        return {name: on_npu(v) for name, v in value.items()}
    return value


def on_cpu(value):
    """value with every tensor in it copied to the host, for a reference or a comparison."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, (list, tuple)):
        return type(value)(on_cpu(v) for v in value)
    if isinstance(value, dict):
        return {name: on_cpu(v) for name, v in value.items()}
    return value


@dataclass
class PagedCache:
    latent: torch.Tensor  # [NUM_BLOCKS, BLOCK_SIZE, 512] or [NUM_BLOCKS, 1, BLOCK_SIZE, 512]
    rope: torch.Tensor
    block_table: torch.Tensor  # [B, TABLE_WIDTH] int32
    kv_lens: list[int]

    def cpu(self) -> "PagedCache":
        return PagedCache(self.latent.cpu(), self.rope.cpu(), self.block_table.cpu(), list(self.kv_lens))


def make_cache(kv_lens, seed=0, with_kv_head_dim=False) -> PagedCache:
    """A paged cache on the npu device (generated on the host, copied there)."""
    generator = torch.Generator().manual_seed(seed)
    latent = torch.randn(NUM_BLOCKS, BLOCK_SIZE, LATENT_DIM, generator=generator).bfloat16()
    rope = torch.randn(NUM_BLOCKS, BLOCK_SIZE, ROPE_DIM, generator=generator).bfloat16()
    # Scattered, distinct blocks so that a wrong block lookup cannot pass.
    block_ids = torch.randperm(NUM_BLOCKS, generator=generator)[: len(kv_lens) * TABLE_WIDTH]
    block_table = block_ids.reshape(len(kv_lens), TABLE_WIDTH).int()
    if with_kv_head_dim:
        latent, rope = latent.unsqueeze(1), rope.unsqueeze(1)
    return PagedCache(latent.to(NPU), rope.to(NPU), block_table.to(NPU), list(kv_lens))


def make_queries(total_tokens, seed=1):
    """Token-major [T, N, 512] and [T, N, 64] bf16 queries on the npu device."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(total_tokens, HEADS, LATENT_DIM, generator=generator).bfloat16()
    query_rope = torch.randn(total_tokens, HEADS, ROPE_DIM, generator=generator).bfloat16()
    return query.to(NPU), query_rope.to(NPU)


def to_layout(tokens, layout, batch):
    """[T, N, D] token-major (requests contiguous) to the op's query layout."""
    if layout == "TND":
        return tokens
    by_request = tokens.reshape(batch, -1, *tokens.shape[1:])
    return by_request if layout == "BSND" else by_request.transpose(1, 2).contiguous()


def out_to_tokens(attention_out, layout):
    if layout == "BNSD":
        attention_out = attention_out.transpose(1, 2)
    return attention_out.reshape(-1, *attention_out.shape[-2:])


def lse_to_tokens(softmax_lse, layout):
    """(B, N, S, 1) or (T, N, 1) to [T, N]."""
    if layout == "TND":
        return softmax_lse.squeeze(-1)
    return softmax_lse.squeeze(-1).transpose(1, 2).reshape(-1, softmax_lse.shape[1])


def fia_call(cache, query_tokens, query_rope_tokens, layout, query_counts, **overrides):
    """(query, key, value) and keyword arguments of a valid MLA call, as DCP decode issues it."""
    batch = len(query_counts)
    keyword_args = dict(
        query_rope=to_layout(query_rope_tokens, layout, batch),
        key_rope=cache.rope,
        block_table=cache.block_table,
        actual_seq_lengths_kv=cache.kv_lens,
        num_heads=HEADS,
        scale=SCALE,
        input_layout=layout,
        num_key_value_heads=1,
        block_size=BLOCK_SIZE,
        softmax_lse_flag=True,
    )
    if layout == "TND":
        keyword_args["actual_seq_lengths"] = torch.tensor(query_counts).cumsum(0).tolist()
    keyword_args.update(overrides)
    return (to_layout(query_tokens, layout, batch), cache.latent, cache.latent), keyword_args


# ---------------------------------------------------------------------------------------------
# Dense reference, written independently of the stand-in: explicit per-key block lookup and one
# dot product over the concatenated [latent | rope] head dim, on CPU copies of the inputs.
# ---------------------------------------------------------------------------------------------


def gather_keys(cache, request):
    cache = cache.cpu()
    latent = cache.latent.reshape(NUM_BLOCKS, BLOCK_SIZE, LATENT_DIM)
    rope = cache.rope.reshape(NUM_BLOCKS, BLOCK_SIZE, ROPE_DIM)
    rows = []
    for position in range(cache.kv_lens[request]):
        block = int(cache.block_table[request, position // BLOCK_SIZE])
        offset = position % BLOCK_SIZE
        rows.append(torch.cat([latent[block, offset], rope[block, offset]]).float())
    return torch.stack(rows) if rows else torch.empty(0, LATENT_DIM + ROPE_DIM)


def all_visible(request, query_count, kv_len):
    return torch.ones(query_count, kv_len, dtype=torch.bool)


def right_down_causal(request, query_count, kv_len):
    return torch.tensor(
        [[key <= kv_len - query_count + query for key in range(kv_len)] for query in range(query_count)],
        dtype=torch.bool,
    ).reshape(query_count, kv_len)


def reference_attention(cache, query_tokens, query_rope_tokens, query_counts, visible=all_visible):
    """out [T, N, 512] fp32 and natural-log lse [T, N] fp32, token-major, on the host."""
    cache, query_tokens, query_rope_tokens = cache.cpu(), query_tokens.cpu(), query_rope_tokens.cpu()
    outputs, lses = [], []
    start = 0
    for request, query_count in enumerate(query_counts):
        queries = torch.cat([query_tokens, query_rope_tokens], dim=-1)[start : start + query_count].float()
        start += query_count
        keys = gather_keys(cache, request)
        kv_len = keys.shape[0]
        for query_index in range(query_count):
            if kv_len == 0:
                outputs.append(torch.zeros(HEADS, LATENT_DIM))
                lses.append(torch.full((HEADS,), math.inf))
                continue
            seen = visible(request, query_count, kv_len)[query_index]
            if not seen.any():
                outputs.append(torch.zeros(HEADS, LATENT_DIM))
                lses.append(torch.full((HEADS,), -math.inf))
                continue
            scores = SCALE * queries[query_index] @ keys[seen].T  # [N, visible keys]
            outputs.append(torch.softmax(scores, dim=-1) @ keys[seen, :LATENT_DIM])
            lses.append(torch.logsumexp(scores, dim=-1))
    return torch.stack(outputs), torch.stack(lses)


def assert_matches_reference(attention_out, softmax_lse, layout, expected_out, expected_lse):
    assert attention_out.dtype == torch.bfloat16 and attention_out.device.type == NPU
    assert softmax_lse.dtype == torch.float32 and softmax_lse.device.type == NPU
    attention_out, softmax_lse = attention_out.cpu(), softmax_lse.cpu()
    tokens_out = out_to_tokens(attention_out, layout).float()
    torch.testing.assert_close(tokens_out, expected_out, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(lse_to_tokens(softmax_lse, layout), expected_lse, atol=1e-4, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Registration and schemas
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overload", ["default", "out", "workspace"])
def test_fia_schemas_are_the_ascend_yaml_lines(overload):
    op = {
        "default": fia.default,
        "out": fia.out,
        "workspace": torch.ops.npu._npu_fused_infer_attention_score_get_max_workspace.default,
    }[overload]
    assert op._schema == torch._C.parse_schema("npu::" + ASCEND_SCHEMAS[overload])


def test_fia_schema_text():
    default_schema = str(fia.default._schema)
    assert "SymInt[]? actual_seq_lengths_kv=None" in default_schema
    assert "bool softmax_lse_flag=False) -> (Tensor, Tensor)" in default_schema
    out_schema = str(fia.out._schema)
    assert "Tensor? workspace=None, Tensor[] out" in out_schema
    assert out_schema.endswith("-> (Tensor, Tensor)")


def test_attention_update_schema():
    assert str(attention_update.default._schema) == ASCEND_ATTENTION_UPDATE_SCHEMA


def test_register_twice_returns_true_without_redefining(monkeypatch):
    def define_again():
        raise AssertionError("register() defined the ops a second time")

    monkeypatch.setattr(standin, "_define_ops", define_again)
    assert standin.register() is True
    assert standin.register() is True
    assert standin.is_standin()


def test_register_defers_to_an_installed_torch_npu(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        return object() if name == "torch_npu" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert standin.register() is False


def refused_on_cpu(name):
    return pytest.raises(NotImplementedError, match=re.escape(f"Could not run 'npu::{name}' with arguments from the 'CPU' backend"))


def test_cpu_tensors_reach_no_kernel_as_with_torch_npu():
    """The kernels are the npu device's only: a call with CPU tensors is refused by the dispatcher,
    as torch_npu's ops refuse it, instead of running on the host."""
    inputs, keyword_args = on_cpu(base_decode_call())
    with refused_on_cpu("npu_fused_infer_attention_score"):
        fia(*inputs, **keyword_args)
    buffers = dict(out=[torch.empty(3, 1, HEADS, LATENT_DIM, dtype=torch.bfloat16), torch.empty(3, HEADS, 1, 1)])
    with refused_on_cpu("npu_fused_infer_attention_score.out"):
        fia.out(*inputs, **keyword_args, **buffers)
    with refused_on_cpu("_npu_fused_infer_attention_score_get_max_workspace"):
        torch.ops.npu._npu_fused_infer_attention_score_get_max_workspace(*inputs, **keyword_args)
    lses, outs = on_cpu(update_inputs())
    with refused_on_cpu("npu_attention_update"):
        attention_update(lses, outs, 0)
    assert fia(*on_npu(inputs), **on_npu(keyword_args))[0].device.type == NPU  # the same call on the device runs


# ---------------------------------------------------------------------------------------------
# FIA numerics
# ---------------------------------------------------------------------------------------------

NUMERIC_CASES = {
    # name: (layout, query_counts, kv_lens, cache with the KV_N=1 dim)
    "bsnd_decode": ("BSND", [1, 1, 1, 1], [0, 1, 17, 40], False),
    "bsnd_three_queries": ("BSND", [3, 3, 3], [17, 0, 40], True),
    "bnsd_decode": ("BNSD", [1, 1, 1, 1], [40, 17, 1, 0], True),
    "bnsd_two_queries": ("BNSD", [2, 2], [1, 40], False),
    "tnd_uneven": ("TND", [2, 1, 0, 3], [17, 0, 40, 5], True),
}


@pytest.mark.parametrize("case", NUMERIC_CASES)
def test_fia_matches_dense_reference(case):
    layout, query_counts, kv_lens, with_kv_head_dim = NUMERIC_CASES[case]
    cache = make_cache(kv_lens, with_kv_head_dim=with_kv_head_dim)
    query, query_rope = make_queries(sum(query_counts))
    inputs, keyword_args = fia_call(cache, query, query_rope, layout, query_counts)

    attention_out, softmax_lse = fia(*inputs, **keyword_args)

    expected_out, expected_lse = reference_attention(cache, query, query_rope, query_counts)
    assert_matches_reference(attention_out, softmax_lse, layout, expected_out, expected_lse)


@pytest.mark.parametrize("batched_mask", [True, False], ids=["B1SK_mask", "1SK_mask"])
def test_fia_sparse_mode_0_applies_the_mask_by_local_key_index(batched_mask):
    query_counts, kv_lens, mask_width = [2, 2, 2], [17, 40, 0], 48
    cache = make_cache(kv_lens)
    query, query_rope = make_queries(sum(query_counts))
    generator = torch.Generator().manual_seed(2)
    mask = torch.rand(len(kv_lens), 1, 2, mask_width, generator=generator) < 0.3
    mask[:, :, :, 0] = False  # keep one key visible per row
    if not batched_mask:
        mask = mask[:1, 0]
    inputs, keyword_args = fia_call(cache, query, query_rope, "BSND", query_counts, atten_mask=mask.to(NPU))

    attention_out, softmax_lse = fia(*inputs, **keyword_args)

    def unmasked(request, query_count, kv_len):
        return ~mask.reshape(-1, 2, mask_width)[request if batched_mask else 0, :, :kv_len]

    expected = reference_attention(cache, query, query_rope, query_counts, visible=unmasked)
    assert_matches_reference(attention_out, softmax_lse, "BSND", *expected)


@pytest.mark.parametrize("layout, query_counts", [("BSND", [3, 3, 3, 3]), ("TND", [3, 1, 2, 2])])
def test_fia_sparse_mode_3_is_right_down_causal(layout, query_counts):
    kv_lens = [40, 17, 1, 0]  # kv_len 1 with 3 queries: the first two see no key
    cache = make_cache(kv_lens)
    query, query_rope = make_queries(sum(query_counts))
    compressed_mask = ~torch.ones(2048, 2048, dtype=torch.bool).tril_()
    inputs, keyword_args = fia_call(
        cache, query, query_rope, layout, query_counts, sparse_mode=3, atten_mask=compressed_mask.to(NPU)
    )

    attention_out, softmax_lse = fia(*inputs, **keyword_args)

    expected = reference_attention(cache, query, query_rope, query_counts, visible=right_down_causal)
    assert_matches_reference(attention_out, softmax_lse, layout, *expected)


def test_fia_lse_is_natural_log_of_the_scaled_scores():
    cache = make_cache([17])
    query, query_rope = make_queries(1)
    inputs, keyword_args = fia_call(cache, query, query_rope, "BSND", [1])

    _, softmax_lse = fia(*inputs, **keyword_args)

    scores = SCALE * torch.cat([query, query_rope], dim=-1)[0].cpu().float() @ gather_keys(cache, 0).T
    natural = torch.log(torch.exp(scores).sum(dim=-1))
    base_two = torch.log2(torch.exp2(scores).sum(dim=-1))
    torch.testing.assert_close(softmax_lse.cpu().reshape(HEADS), natural, atol=1e-4, rtol=1e-5)
    assert not torch.allclose(softmax_lse.cpu().reshape(HEADS), base_two, atol=1e-2)


def test_fia_empty_request_gives_exact_zero_and_plus_inf_lse():
    cache = make_cache([0, 17])
    query, query_rope = make_queries(2)
    inputs, keyword_args = fia_call(cache, query, query_rope, "BNSD", [1, 1])

    attention_out, softmax_lse = fia(*inputs, **keyword_args)

    assert torch.equal(attention_out[0], torch.zeros_like(attention_out[0]))
    assert torch.all(softmax_lse[0] == math.inf)
    assert torch.isfinite(softmax_lse[1]).all()


def test_fia_empty_batch_returns_empty_outputs():
    cache = make_cache([17])
    query, query_rope = make_queries(1)
    _, keyword_args = fia_call(cache, query, query_rope, "BSND", [1], block_table=cache.block_table[:0])
    keyword_args["query_rope"] = keyword_args["query_rope"][:0]

    attention_out, softmax_lse = fia(query.reshape(1, 1, HEADS, LATENT_DIM)[:0], cache.latent, cache.latent,
                                     **keyword_args)

    assert attention_out.shape == (0, 1, HEADS, LATENT_DIM)
    assert softmax_lse.shape == (0, HEADS, 1, 1) and softmax_lse.dtype == torch.float32


def test_fia_query_whose_mask_hides_every_key_gives_zero_and_minus_inf():
    cache = make_cache([17])
    query, query_rope = make_queries(2)
    mask = torch.zeros(1, 1, 2, 17, dtype=torch.uint8, device=NPU)
    mask[0, 0, 1] = 1
    inputs, keyword_args = fia_call(cache, query, query_rope, "BSND", [2], atten_mask=mask)

    attention_out, softmax_lse = fia(*inputs, **keyword_args)

    assert torch.equal(attention_out[0, 1], torch.zeros_like(attention_out[0, 1]))
    assert torch.all(softmax_lse[0, :, 1] == -math.inf)
    assert torch.isfinite(softmax_lse[0, :, 0]).all()


def test_fia_without_lse_flag_returns_an_empty_lse():
    cache = make_cache([5])
    query, query_rope = make_queries(1)
    inputs, keyword_args = fia_call(cache, query, query_rope, "BSND", [1], softmax_lse_flag=False)

    attention_out, softmax_lse = fia(*inputs, **keyword_args)

    assert attention_out.shape == (1, 1, HEADS, LATENT_DIM)
    assert softmax_lse.shape == (0,) and softmax_lse.dtype == torch.float32


def test_fia_kv_lens_broadcast_from_one_entry_and_extra_entries_ignored():
    cache = make_cache([17, 17])
    query, query_rope = make_queries(2)
    inputs, broadcast = fia_call(cache, query, query_rope, "BSND", [1, 1], actual_seq_lengths_kv=[17])
    _, extra = fia_call(cache, query, query_rope, "BSND", [1, 1], actual_seq_lengths_kv=[17, 17, 3])

    expected = reference_attention(cache, query, query_rope, [1, 1])
    assert_matches_reference(*fia(*inputs, **broadcast), "BSND", *expected)
    assert_matches_reference(*fia(*inputs, **extra), "BSND", *expected)


def test_fia_shards_merged_by_attention_update_equal_unsharded_attention():
    """The LSE contract DCP relies on: split keys, attend per shard, merge; an empty shard is +inf."""
    kv_lens = [1, 17, 40]
    cache = make_cache(kv_lens)
    query, query_rope = make_queries(len(kv_lens))
    split = 2 * BLOCK_SIZE
    first_shard = PagedCache(cache.latent, cache.rope, cache.block_table[:, :2].contiguous(),
                             [min(kv_len, split) for kv_len in kv_lens])
    second_shard = PagedCache(cache.latent, cache.rope, cache.block_table[:, 2:].contiguous(),
                              [max(kv_len - split, 0) for kv_len in kv_lens])
    shard_results = [
        fia(*inputs, **keyword_args)
        for inputs, keyword_args in (
            fia_call(shard, query, query_rope, "BNSD", [1, 1, 1]) for shard in (first_shard, second_shard)
        )
    ]

    merged_out, _ = attention_update(
        [lse.reshape(-1) for _, lse in shard_results],
        [out.reshape(-1, LATENT_DIM) for out, _ in shard_results],
        0,
    )

    expected_out, _ = reference_attention(cache, query, query_rope, [1, 1, 1])
    assert merged_out.device.type == NPU
    torch.testing.assert_close(merged_out.cpu().float(), expected_out.reshape(-1, LATENT_DIM), atol=2e-2, rtol=1e-2)


# ---------------------------------------------------------------------------------------------
# .out overload and the workspace helper
# ---------------------------------------------------------------------------------------------


def test_fia_out_overload_writes_into_the_given_buffers():
    cache = make_cache([0, 17, 40])
    query, query_rope = make_queries(3)
    inputs, keyword_args = fia_call(cache, query, query_rope, "BNSD", [1, 1, 1])
    attention_out = torch.full((3, HEADS, 1, LATENT_DIM), 7.0, dtype=torch.bfloat16, device=NPU)
    softmax_lse = torch.full((3, HEADS, 1, 1), 7.0, device=NPU)

    returned = fia.out(*inputs, **keyword_args, workspace=torch.empty(1, dtype=torch.uint8, device=NPU),
                       out=[attention_out, softmax_lse])

    assert returned[0] is attention_out and returned[1] is softmax_lse
    expected_out, expected_lse = fia(*inputs, **keyword_args)
    assert torch.equal(attention_out, expected_out)
    assert torch.equal(softmax_lse, expected_lse)


def test_fia_out_overload_without_lse_flag_zeroes_a_one_element_lse():
    cache = make_cache([17])
    query, query_rope = make_queries(1)
    inputs, keyword_args = fia_call(cache, query, query_rope, "BSND", [1], softmax_lse_flag=False)
    softmax_lse = torch.full((1,), 7.0, device=NPU)

    fia.out(*inputs, **keyword_args,
            out=[torch.empty(1, 1, HEADS, LATENT_DIM, dtype=torch.bfloat16, device=NPU), softmax_lse])

    assert softmax_lse.item() == 0.0


@pytest.mark.parametrize("bad_buffer", ["attention_out_shape", "attention_out_dtype", "softmax_lse_shape"])
def test_fia_out_overload_rejects_wrong_buffers(bad_buffer):
    cache = make_cache([17])
    query, query_rope = make_queries(1)
    inputs, keyword_args = fia_call(cache, query, query_rope, "BSND", [1])
    buffers = {
        "attention_out": torch.empty(1, 1, HEADS, LATENT_DIM, dtype=torch.bfloat16, device=NPU),
        "softmax_lse": torch.empty(1, HEADS, 1, 1, device=NPU),
    }
    if bad_buffer == "attention_out_shape":
        buffers["attention_out"] = torch.empty(1, HEADS, 1, LATENT_DIM, dtype=torch.bfloat16, device=NPU)
    elif bad_buffer == "attention_out_dtype":
        buffers["attention_out"] = buffers["attention_out"].half()
    else:
        buffers["softmax_lse"] = torch.empty(1, HEADS, 1, device=NPU)
    with pytest.raises(ValueError, match=bad_buffer.rsplit("_", 1)[0]):
        fia.out(*inputs, **keyword_args, out=[buffers["attention_out"], buffers["softmax_lse"]])


def test_get_max_workspace_validates_and_returns_one_byte():
    cache = make_cache([17])
    query, query_rope = make_queries(1)
    inputs, keyword_args = fia_call(cache, query, query_rope, "BSND", [1])
    get_max_workspace = torch.ops.npu._npu_fused_infer_attention_score_get_max_workspace

    workspace = get_max_workspace(*inputs, **keyword_args)

    assert workspace.shape == (1,) and workspace.dtype == torch.uint8 and workspace.device.type == NPU
    with pytest.raises(ValueError, match="num_heads"):
        get_max_workspace(*inputs, **{**keyword_args, "num_heads": 3})


# ---------------------------------------------------------------------------------------------
# Fake and meta kernels
# ---------------------------------------------------------------------------------------------


def to_fake(mode, keyword_args):
    return {name: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
            for name, v in keyword_args.items()}


def to_meta(keyword_args):
    return {name: v.to("meta") if isinstance(v, torch.Tensor) else v for name, v in keyword_args.items()}


@pytest.mark.parametrize(
    "layout, query_counts, lse_flag, expected_out, expected_lse",
    [
        ("BSND", [2, 2, 2], True, (3, 2, HEADS, LATENT_DIM), (3, HEADS, 2, 1)),
        ("BNSD", [1, 1, 1], True, (3, HEADS, 1, LATENT_DIM), (3, HEADS, 1, 1)),
        ("TND", [2, 0, 3], True, (5, HEADS, LATENT_DIM), (5, HEADS, 1)),
        ("BSND", [1, 1, 1], False, (3, 1, HEADS, LATENT_DIM), (0,)),
    ],
)
def test_fia_fake_and_meta_output_shapes(layout, query_counts, lse_flag, expected_out, expected_lse):
    cache = make_cache([0, 17, 40])
    query, query_rope = make_queries(sum(query_counts))
    inputs, keyword_args = fia_call(cache, query, query_rope, layout, query_counts, softmax_lse_flag=lse_flag)

    with FakeTensorMode() as mode:
        fake_results = fia(*map(mode.from_tensor, inputs), **to_fake(mode, keyword_args))
    meta_results = fia(*(tensor.to("meta") for tensor in inputs), **to_meta(keyword_args))

    assert fake_results[0].device.type == NPU and fake_results[1].device.type == NPU
    for attention_out, softmax_lse in (fake_results, meta_results):
        assert attention_out.shape == expected_out and attention_out.dtype == torch.bfloat16
        assert softmax_lse.shape == expected_lse and softmax_lse.dtype == torch.float32


def test_fia_fake_kernel_validates_at_trace_time():
    cache = make_cache([17])
    query, query_rope = make_queries(20)
    inputs, keyword_args = fia_call(cache, query, query_rope, "TND", [20])
    with FakeTensorMode() as mode, pytest.raises(ValueError, match="at most 16"):
        fia(*map(mode.from_tensor, inputs), **to_fake(mode, keyword_args))


def test_attention_update_fake_and_meta_output_shapes():
    lse = [torch.randn(6, device=NPU) for _ in range(2)]
    local_out = [torch.randn(6, 16, dtype=torch.bfloat16, device=NPU) for _ in range(2)]
    with FakeTensorMode() as mode:
        fake_results = attention_update(
            [mode.from_tensor(t) for t in lse], [mode.from_tensor(t) for t in local_out], 1
        )
    meta_results = attention_update([t.to("meta") for t in lse], [t.to("meta") for t in local_out], 1)
    for out, lse_out in (fake_results, meta_results):
        assert out.shape == (6, 16) and out.dtype == torch.bfloat16
        assert lse_out.shape == (6,) and lse_out.dtype == torch.float32


def test_opcheck():
    cache = make_cache([0, 17, 40])
    query, query_rope = make_queries(3)
    inputs, keyword_args = fia_call(cache, query, query_rope, "BSND", [1, 1, 1])
    torch.library.opcheck(fia.default, inputs, keyword_args)
    torch.library.opcheck(
        torch.ops.npu._npu_fused_infer_attention_score_get_max_workspace.default, inputs, keyword_args
    )
    # torch_npu registers .out with `Tensor[] out` unannotated, which its kernel writes: opcheck's
    # test_schema refuses that schema (docs/ascend.md §21.2), so only the fake kernel is checked.
    buffers = [torch.empty(3, 1, HEADS, LATENT_DIM, dtype=torch.bfloat16, device=NPU),
               torch.empty(3, HEADS, 1, 1, device=NPU)]
    torch.library.opcheck(fia.out, inputs, {**keyword_args, "out": buffers}, test_utils=("test_faketensor",))
    torch.library.opcheck(attention_update.default,
                          ([torch.randn(4, device=NPU)] * 2, [torch.randn(4, 8, device=NPU)] * 2, 1))


# ---------------------------------------------------------------------------------------------
# FIA limits: each documented limit raises on its own
# ---------------------------------------------------------------------------------------------


def base_decode_call(layout="BSND", query_counts=(1, 1, 1), kv_lens=(0, 3, 20), **overrides):
    cache = make_cache(kv_lens)
    query, query_rope = make_queries(sum(query_counts))
    return fia_call(cache, query, query_rope, layout, list(query_counts), **overrides)


def with_query(**replacements):
    """A change to (query, key, value) by name."""
    def change(inputs, keyword_args):
        named = dict(zip(("query", "key", "value"), inputs))
        for name, make in replacements.items():
            named[name] = make(named[name])
        return (named["query"], named["key"], named["value"]), keyword_args
    return change


def with_args(**changes):
    """A change to keyword arguments; a callable value maps the current value."""
    def change(inputs, keyword_args):
        keyword_args = dict(keyword_args)
        for name, new in changes.items():
            keyword_args[name] = new(keyword_args.get(name)) if callable(new) else new
        return inputs, keyword_args
    return change


def without(*names):
    def change(inputs, keyword_args):
        return inputs, {key: v for key, v in keyword_args.items() if key not in names}
    return change


def combined(*changes):
    def change(inputs, keyword_args):
        for each in changes:
            inputs, keyword_args = each(inputs, keyword_args)
        return inputs, keyword_args
    return change


def with_query_len(query_len):
    """Every request gets query_len queries (query and query_rope)."""
    return combined(
        with_query(query=lambda q: q.expand(3, query_len, HEADS, LATENT_DIM).contiguous()),
        with_args(query_rope=lambda r: r.expand(3, query_len, HEADS, ROPE_DIM).contiguous()),
    )


def last_dim(size):
    return lambda tensor: torch.zeros(*tensor.shape[:-1], size, dtype=tensor.dtype, device=tensor.device)


FIA_VALUE_ERRORS = {
    # 1. dtypes
    "query_float32": (with_query(query=lambda q: q.float()), "query dtype"),
    "key_dtype": (with_query(key=lambda k: k.half()), "key dtype"),
    "value_dtype": (with_query(value=lambda v: v.half()), "value dtype"),
    "query_rope_dtype": (with_args(query_rope=lambda r: r.half()), "query_rope dtype"),
    "key_rope_dtype": (with_args(key_rope=lambda r: r.half()), "key_rope dtype"),
    # 2. ropes come in pairs
    "query_rope_without_key_rope": (without("key_rope"), "query_rope given without key_rope"),
    "key_rope_without_query_rope": (without("query_rope"), "key_rope given without query_rope"),
    # 3. MLA head dims and KV heads
    "query_head_dim": (with_query(query=last_dim(256)), "query head dim is 256"),
    "query_rope_dim": (with_args(query_rope=last_dim(32)), "query_rope last dim is 32"),
    "key_rope_dim": (with_args(key_rope=last_dim(32)), "key_rope last dim is 32"),
    "num_key_value_heads_default": (without("num_key_value_heads"), "num_key_value_heads is 0"),
    "num_key_value_heads_2": (with_args(num_key_value_heads=2), "num_key_value_heads is 2"),
    # 4. query heads
    "num_heads_not_power_of_two": (with_args(num_heads=3), "num_heads is 3"),
    "num_heads_not_query_heads": (with_args(num_heads=8), "num_heads is 8 but .* 4 heads"),
    # 5. layouts
    "layout_not_allowed_for_mla": (with_args(input_layout="NTD"), "input_layout 'NTD' is not allowed"),
    "query_rank_for_layout": (with_query(query=lambda q: q[:, 0]), "query must be 4-D"),
    "query_rope_shape": (with_args(query_rope=lambda r: r[:2]), "query_rope shape"),
    # 6. at most 16 queries per request with D=512
    "seventeen_queries_bsnd": (with_query_len(17), "17 query tokens"),
    # 7. PageAttention
    "block_table_missing": (without("block_table"), "block_table is required"),
    "block_table_int64": (with_args(block_table=lambda t: t.long()), "2-D int32"),
    "block_table_1d": (with_args(block_table=lambda t: t[0]), "2-D int32"),
    "block_table_rows": (with_args(block_table=lambda t: t[:2]), "block_table has 2 rows for 3 requests"),
    "block_size_zero": (with_args(block_size=0), "block_size is 0"),
    "block_size_not_multiple_of_16": (with_args(block_size=24), "block_size is 24"),
    "block_size_over_1024": (with_args(block_size=2048), "block_size is 2048"),
    "key_block_dim": (with_query(key=lambda k: k.reshape(-1, 32, LATENT_DIM)), r"key shape \(10, 32, 512\)"),
    "key_kv_heads_dim": (with_query(key=lambda k: k.reshape(-1, 2, 8, LATENT_DIM)), "key shape"),
    "key_rope_block_dim": (with_args(key_rope=lambda k: k.reshape(-1, 32, ROPE_DIM)), "key_rope shape"),
    "key_rope_blocks": (with_args(key_rope=lambda k: k[:4]), "key_rope has 4 blocks"),
    "value_not_key_shape": (with_query(value=lambda v: v[:4]), "value shape"),
    # 8. per-request kv lengths
    "kv_lens_missing": (without("actual_seq_lengths_kv"), "actual_seq_lengths_kv is required"),
    "kv_len_negative": (with_args(actual_seq_lengths_kv=[0, -1, 3]), "value -1 is outside"),
    "kv_len_over_capacity": (with_args(actual_seq_lengths_kv=[0, 65, 3]), r"value 65 is outside \[0, 64\]"),
    "kv_lens_too_few": (with_args(actual_seq_lengths_kv=[1, 2]), "2 entries for 3 requests"),
    # 10. sparse modes and masks
    "sparse_mode_1": (with_args(sparse_mode=1), "sparse_mode is 1"),
    "sparse_mode_2": (with_args(sparse_mode=2), "sparse_mode is 2"),
    "sparse_mode_3_without_mask": (with_args(sparse_mode=3), "sparse_mode 3 needs the compressed"),
    "sparse_mode_3_small_mask": (
        with_args(sparse_mode=3, atten_mask=torch.zeros(1, 1024, 1024, dtype=torch.bool)),
        r"got \(1, 1024, 1024\)",
    ),
    "mask_dtype": (with_args(atten_mask=torch.zeros(3, 1, 1, 64)), "atten_mask dtype"),
    "mask_query_dim": (with_args(atten_mask=torch.zeros(3, 1, 2, 64, dtype=torch.bool)), "atten_mask shape"),
    "mask_batch_dim": (with_args(atten_mask=torch.zeros(2, 1, 1, 64, dtype=torch.bool)), "atten_mask shape"),
    "mask_narrower_than_kv": (
        with_args(atten_mask=torch.zeros(1, 1, 19, dtype=torch.bool)), "atten_mask shape"
    ),
    # Arguments MLA does not support (§1.4)
    "pse_shift": (with_args(pse_shift=torch.zeros(1)), "pse_shift given"),
    "quant_scale2": (with_args(quant_scale2=torch.ones(1)), "quant_scale2 given"),
    "inner_precise": (with_args(inner_precise=2), "inner_precise is 2"),
}


@pytest.mark.parametrize("limit", FIA_VALUE_ERRORS)
def test_fia_limit_raises_value_error(limit):
    change, message = FIA_VALUE_ERRORS[limit]
    inputs, keyword_args = on_npu(change(*base_decode_call()))  # the masks above are made on the host
    with pytest.raises(ValueError, match=message):
        fia(*inputs, **keyword_args)


TND_VALUE_ERRORS = {
    "seventeen_queries_tnd": ((1, 17, 1), {}, "17 query tokens"),
    "actual_seq_lengths_missing": ((1, 1, 1), {"actual_seq_lengths": None}, "requires actual_seq_lengths"),
    "actual_seq_lengths_decreasing": ((1, 1, 1), {"actual_seq_lengths": [2, 1, 3]}, "non-decreasing"),
    "actual_seq_lengths_last_not_t": ((1, 1, 1), {"actual_seq_lengths": [1, 2, 2]}, "ends at 2 .* T = 3"),
}


@pytest.mark.parametrize("limit", TND_VALUE_ERRORS)
def test_fia_tnd_limit_raises_value_error(limit):
    query_counts, overrides, message = TND_VALUE_ERRORS[limit]
    inputs, keyword_args = base_decode_call("TND", query_counts, **overrides)
    with pytest.raises(ValueError, match=message):
        fia(*inputs, **keyword_args)


FIA_NOT_IMPLEMENTED = {
    "no_rope": (without("query_rope", "key_rope"), "MLA only"),
    "allowed_layout_bsh_nbsd": (with_args(input_layout="BSH_NBSD"), "'BSH_NBSD' is valid for MLA"),
    "allowed_layout_bsh": (with_args(input_layout="BSH"), "'BSH' is valid for MLA"),
    "sparse_mode_4": (with_args(sparse_mode=4), "sparse_mode 4"),
    "pre_tokens_window": (with_args(pre_tokens=8), "pre_tokens/next_tokens"),
    "padded_queries": (combined(with_query_len(2), with_args(actual_seq_lengths=[1, 2, 2])), "pads queries"),
}


@pytest.mark.parametrize("case", FIA_NOT_IMPLEMENTED)
def test_fia_unimplemented_but_valid_inputs_raise_not_implemented(case):
    change, message = FIA_NOT_IMPLEMENTED[case]
    inputs, keyword_args = change(*base_decode_call())
    with pytest.raises(NotImplementedError, match=message):
        fia(*inputs, **keyword_args)


def test_fia_tnd_with_full_mask_is_not_implemented():
    inputs, keyword_args = base_decode_call(
        "TND", (1, 1, 1), atten_mask=torch.zeros(1, 1, 1, 64, dtype=torch.bool, device=NPU)
    )
    with pytest.raises(NotImplementedError, match="TND"):
        fia(*inputs, **keyword_args)


# ---------------------------------------------------------------------------------------------
# npu_attention_update
# ---------------------------------------------------------------------------------------------


def manual_merge(lses, outs):
    """Softmax over the sources of their lse, as weights of their outputs."""
    stacked_lse = torch.stack(lses)
    weights = torch.softmax(stacked_lse, dim=0).unsqueeze(-1)
    merged = (weights * torch.stack([out.float() for out in outs])).sum(dim=0)
    return merged, torch.logsumexp(stacked_lse, dim=0)


@pytest.mark.parametrize("sources", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_update_matches_manual_merge(sources, dtype):
    generator = torch.Generator().manual_seed(sources)
    lses = [torch.randn(10, generator=generator) * 3 for _ in range(sources)]
    outs = [torch.randn(10, 64, generator=generator).to(dtype) for _ in range(sources)]

    merged_out, merged_lse = attention_update(on_npu(lses), on_npu(outs), 1)

    expected_out, expected_lse = manual_merge(lses, outs)
    assert merged_out.dtype == dtype and merged_lse.dtype == torch.float32
    assert merged_out.device.type == NPU and merged_lse.device.type == NPU
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(merged_out.cpu().float(), expected_out, **tolerance)
    torch.testing.assert_close(merged_lse.cpu(), expected_lse, atol=1e-5, rtol=1e-5)


def test_attention_update_reads_plus_inf_lse_as_minus_inf():
    lses = [torch.tensor([0.5, 1.0]), torch.tensor([math.inf, -0.3])]
    outs = [torch.randn(2, 8), torch.full((2, 8), 1e6)]

    merged_out, merged_lse = on_cpu(attention_update(on_npu(lses), on_npu(outs), 1))

    torch.testing.assert_close(merged_out[0], outs[0][0])
    torch.testing.assert_close(merged_lse[0], lses[0][0])
    expected_out, _ = manual_merge([lse[1:] for lse in lses], [out[1:] for out in outs])
    torch.testing.assert_close(merged_out[1:], expected_out)


def test_attention_update_row_with_every_lse_minus_inf_is_nan():
    lses = [torch.tensor([-math.inf, 0.0]), torch.tensor([math.inf, 0.0])]
    outs = [torch.zeros(2, 8), torch.zeros(2, 8)]

    merged_out, merged_lse = on_cpu(attention_update(on_npu(lses), on_npu(outs), 1))

    assert torch.isnan(merged_out[0]).all() and torch.isnan(merged_lse[0])
    assert torch.isfinite(merged_out[1]).all()


def update_inputs(sources=2, rows=4, head_dim=16, dtype=torch.float32):
    lses = [torch.zeros(rows, device=NPU) for _ in range(sources)]
    outs = [torch.zeros(rows, head_dim, dtype=dtype, device=NPU) for _ in range(sources)]
    return lses, outs


def swap_first(items, replacement):
    return [replacement, *items[1:]]


ATTENTION_UPDATE_ERRORS = {
    "count_mismatch": (lambda lse, out: (lse, out[:1], 0), "2 and 1 entries"),
    "seventeen_sources": (lambda lse, out: ((lse * 9)[:17], (out * 9)[:17], 0), "17 and 17 entries"),
    "lse_2d": (lambda lse, out: (swap_first(lse, torch.zeros(4, 1)), out, 0), r"lse\[0\] is \(4, 1\)"),
    "lse_float16": (lambda lse, out: (swap_first(lse, torch.zeros(4).half()), out, 0), "expected 1-D float32"),
    "lse_rows": (lambda lse, out: (swap_first(lse, torch.zeros(5)), out, 0), r"lse\[0\] is \(5,\)"),
    "out_1d": (lambda lse, out: (lse, swap_first(out, torch.zeros(16)), 0), "must be 2-D"),
    "out_rows": (lambda lse, out: (lse, [out[0], torch.zeros(5, 16)], 0), "has 5 rows"),
    "head_dim_4": (lambda lse, out: update_inputs(head_dim=4) + (0,), "head dim is 4"),
    "head_dim_12": (lambda lse, out: update_inputs(head_dim=12) + (0,), "head dim is 12"),
    "head_dim_520": (lambda lse, out: update_inputs(head_dim=520) + (0,), "head dim is 520"),
    "out_float64": (lambda lse, out: update_inputs(dtype=torch.float64) + (0,), "dtype torch.float64"),
    "out_mixed_dtypes": (lambda lse, out: (lse, [out[0], out[1].bfloat16()], 0), "differs from local_out"),
    "update_type_2": (lambda lse, out: (lse, out, 2), "update_type is 2"),
}


@pytest.mark.parametrize("limit", ATTENTION_UPDATE_ERRORS)
def test_attention_update_limit_raises_value_error(limit):
    change, message = ATTENTION_UPDATE_ERRORS[limit]
    arguments = on_npu(change(*update_inputs()))  # the replacements above are made on the host
    with pytest.raises(ValueError, match=message):
        attention_update(*arguments)


def test_attention_update_without_sources_raises():
    # With no tensor argument the dispatcher finds no kernel; the shared validator still says why.
    with pytest.raises(NotImplementedError):
        attention_update([], [], 0)
    with pytest.raises(ValueError, match="0 and 0 entries"):
        standin.validate_attention_update([], [], 0)


def test_attention_update_accepts_its_documented_extremes():
    lses, outs = update_inputs(sources=16, rows=3, head_dim=512, dtype=torch.float16)
    merged_out, merged_lse = attention_update(lses, outs, 0)
    assert merged_out.shape == (3, 512) and merged_out.dtype == torch.float16 and merged_out.device.type == NPU
    assert merged_lse.shape == (3,)


def test_fia_rejects_a_non_contiguous_query():
    args, keyword_args = base_decode_call()
    strided = torch.cat([args[0], args[0]], dim=-1)[..., :LATENT_DIM]
    with pytest.raises(ValueError, match="query must be contiguous"):
        fia(strided, *args[1:], **keyword_args)
