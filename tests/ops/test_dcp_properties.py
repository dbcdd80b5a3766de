"""DCP against dcp_size=1 over random configurations, at the op level, in one process that
simulates the N ranks (shard the cache as sharded_kv_write would, attend per rank, merge):

N in {1, 2, 4, 8}; interleave 1 or the page size, page sizes 1 to 16; decode, verify (k up to
16) and extend (chunks up to 40); lengths including 1, lengths below N (empty shards) and padded
rows; shared prefixes (forked pages); both strategies (gather-q, gather-kv). The page tables come
from RequestTable, as a server's would.

CI runs a small derandomised profile; DCP_PROPERTY_EXAMPLES=1000 runs 1,000 examples.
"""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcp_compile.runtime.batch import RequestTable
from tests.ops.reference_inputs import gather_q_attention, naive_attention
from tests.ops.test_extend_strategies import gather_kv_attention

EXAMPLES = int(os.environ.get("DCP_PROPERTY_EXAMPLES", "25"))
SCALE = 0.25
RANK_DIM, ROPE_DIM, HEADS, CAPACITY = 16, 8, 2, 2048


@st.composite
def configurations(draw):
    dcp_size = draw(st.sampled_from([1, 2, 4, 8]))
    page_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    interleave = draw(st.sampled_from(sorted({1, page_size})))
    mode = draw(st.sampled_from(["decode", "verify", "extend"]))
    queries = {"decode": 1, "verify": draw(st.integers(1, 16)), "extend": draw(st.integers(1, 40))}[mode]
    prefixes = draw(st.lists(st.sampled_from([0, 1, 2, 3, 5, 9, 17, 40, 70]), min_size=1, max_size=5))
    return dict(dcp_size=dcp_size, page_size=page_size, interleave=interleave, mode=mode, queries=queries,
                prefixes=prefixes, pad_rows=draw(st.integers(0, 2)), shared=draw(st.booleans()),
                seed=draw(st.integers(0, 2**31 - 1)))


def batch_of(config):
    """A RequestTable batch: each request's prefix is cached, then `queries` new tokens each."""
    page_size = config["page_size"]
    requests = len(config["prefixes"])
    table = RequestTable(requests, 128, CAPACITY, page_size)
    for request, prefix in enumerate(config["prefixes"]):
        if config["shared"] and request == 1 and config["prefixes"][0] >= page_size:
            table.fork(0, 1, config["prefixes"][0] // page_size * page_size)
        elif prefix:
            table.append(request, prefix)
    batch = table.extend_batch(list(range(requests)), [[1] * config["queries"]] * requests, pad_rows=config["pad_rows"])
    gen = torch.Generator().manual_seed(config["seed"])
    tokens = batch.input_ids.shape[0]
    return dict(
        q_latent=torch.randn(tokens, HEADS, RANK_DIM, generator=gen), q_rope=torch.randn(tokens, HEADS, ROPE_DIM, generator=gen),
        kv_cache=torch.randn(CAPACITY, RANK_DIM + ROPE_DIM, generator=gen), req_to_token=batch.req_to_token,
        seq_lens=batch.seq_lens, q_seq_ids=batch.q_seq_ids, q_positions=batch.positions,
    )


@settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 25,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(config=configurations())
def test_dcp_equals_dcp_size_one(config):
    inputs = batch_of(config)
    expected_out, expected_lse = naive_attention(inputs, SCALE)
    dense = torch.ops.dcp.mla_attention(inputs["q_latent"], inputs["q_rope"], inputs["kv_cache"], inputs["req_to_token"],
                                        inputs["seq_lens"], inputs["q_seq_ids"], inputs["q_positions"], SCALE)
    torch.testing.assert_close(dense.double(), expected_out, atol=1e-5, rtol=1e-5)
    for out, lse in (gather_q_attention(inputs, config["dcp_size"], config["interleave"], SCALE),
                     gather_kv_attention(inputs, config["dcp_size"], config["interleave"])):
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse.double(), expected_lse, atol=1e-5, rtol=1e-5)
    padded = inputs["seq_lens"][inputs["q_seq_ids"]] == 0
    assert (dense[padded] == 0).all()
