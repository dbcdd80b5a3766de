"""How each batch's attention reaches the sharded KV: one decision, used by the compiled model
at every step and by the shape-only capture of `dcp-compile dump`, so both pick the same graph."""

from __future__ import annotations

from dataclasses import dataclass

from dcp_compile import cost_model
from dcp_compile.config import DCPConfig
from dcp_compile.lowering.base import Lowering
from dcp_compile.passes.replicated_q_attention import STRATEGY as REPLICATED_Q

STRATEGIES = cost_model.STRATEGIES + (REPLICATED_Q,)
"""Every strategy a step may run: the cost model's two, and replicated-q for unsplit heads."""


@dataclass(frozen=True)
class BatchFacts:
    """What the decision reads of a batch."""

    query_tokens: int
    rows: int
    width: int
    """Page-table width."""
    visible_keys: int
    """Sum over queries of the keys each sees (or a bound on it)."""
    max_query_len: int
    """The most query tokens of one row."""


@dataclass(frozen=True)
class ModelFacts:
    """What the decision reads of the model and its KV pool."""

    heads: int | None
    """TP-local attention heads (None: the model does not say)."""
    kv_lora_rank: int
    rope_dim: int
    element_bytes: int
    replicated_heads: bool = False
    """Every rank of the DCP group has every head (tp_size 1): the step runs replicated-q."""


def decide(config: DCPConfig, lowering: Lowering, batch: BatchFacts | None, model: ModelFacts) -> cost_model.Decision:
    """The strategy of one batch: 'gather-kv' for rows longer than the lowering's window, where
    it has one (an error under a forced 'gather-q'); 'gather-q' at dcp_size 1; a forced one;
    else the cost model's pick (gather-q where the batch or the model does not say enough)."""
    strategy, dcp_size = config.attention_strategy, config.dcp_size
    window = lowering.window
    if batch is not None and lowering.windowed(dcp_size) and batch.max_query_len > window:
        if strategy == "gather-q" and dcp_size > 1:
            raise ValueError(f"attention_strategy='gather-q' with kernels={lowering.name!r} serves at most {window} query "
                             f"tokens per request; this batch has {batch.max_query_len}")
        return cost_model.Decision("gather-kv", True, {}, f"a row has more than {window} query tokens, which "
                                   f"kernels={lowering.name!r} does not serve over the pool")
    if dcp_size == 1:
        return cost_model.Decision("gather-q", True, {}, "dcp_size 1: attention is local")
    if model.replicated_heads:
        return cost_model.Decision(REPLICATED_Q, True, {}, "every rank has every head (tp_size 1): partial attention "
                                   "over the local shard, its (out, lse) exchanged, the merge")
    if strategy != "auto":
        return cost_model.Decision(strategy, True, {}, f"forced {strategy}")
    if lowering.prefers_gather_q():
        return cost_model.Decision("gather-q", True, {}, f"kernels={lowering.name!r} serves chunks of any length over "
                                   "the pool (gather-q)")
    if batch is None or model.heads is None:
        return cost_model.Decision("gather-q", True, {}, "the model exposes no attention_metadata / num_local_heads")
    return cost_model.choose("auto", query_tokens=batch.query_tokens, rows=batch.rows, width=batch.width,
                             visible_keys=batch.visible_keys, heads=model.heads, dcp_size=dcp_size,
                             kv_lora_rank=model.kv_lora_rank, rope_dim=model.rope_dim,
                             element_bytes=model.element_bytes)
