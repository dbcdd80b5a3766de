"""DeepSeek-style MoE block: a top-k router over routed experts, plus shared experts.

Written so that torch.compile(fullgraph=True) captures it: no data-dependent Python control flow.
Every expert runs on every token, and the results are summed with a routing matrix [T, E] that is
zero for the experts a token did not choose (MoE speed is not this model's concern).

Routing, as DeepSeek's code and transformers' DeepseekV2/V3 routers:
- scores = softmax or sigmoid of the router logits (fp32, fp32 router weight);
- noaux_tc (V3): choice = scores + e_score_correction_bias; a group's score is the sum of its
  top-2 choices; the topk_group best groups stay, the other experts are masked to -inf;
- group_limited_greedy (V2): a group's score is its best score; masked experts score 0;
- greedy: top-k of the scores;
- the chosen experts are weighted by their scores (not the bias), normalised to sum 1 where
  norm_topk_prob (+1e-20 as DeepSeek's code), times routed_scaling_factor.

TP: each expert's (and the shared experts') intermediate dimension is split over the TP group;
routed and shared outputs are summed locally and all-reduced once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dcp_compile.models.config import MLAModelConfig, MoEConfig
from dcp_compile.models.functional import all_reduce, swiglu
from dcp_compile.runtime.parallel import ParallelState


def routing_weights(logits: torch.Tensor, moe: MoEConfig, correction_bias: torch.Tensor | None = None) -> torch.Tensor:
    """[T, E] fp32 weight of each expert for each token: zero where the expert is not chosen."""
    logits = logits.float()
    scores = logits.sigmoid() if moe.scoring_func == "sigmoid" else logits.softmax(dim=-1)
    choice = scores + correction_bias if correction_bias is not None else scores
    if moe.topk_method != "greedy" and moe.n_group > 1:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, moe.n_group, experts // moe.n_group)
        if moe.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        kept_groups = group_scores.topk(moe.topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores).scatter(1, kept_groups, 1.0)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts).bool()
        masked = float("-inf") if moe.topk_method == "noaux_tc" else 0.0
        choice = choice.masked_fill(~expert_mask, masked)
    chosen = choice.topk(moe.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, chosen)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * moe.routed_scaling_factor
    return torch.zeros_like(scores).scatter(1, chosen, weights)


class MoE(nn.Module):
    def __init__(self, cfg: MLAModelConfig, prefix: str, par: ParallelState, weights):
        super().__init__()
        moe = cfg.moe
        for field, width in (("moe_intermediate_size", moe.moe_intermediate_size),
                             ("the shared experts' width", moe.shared_intermediate_size)):
            if width % par.tp_size:
                raise ValueError(f"{field} {width} does not split over tp_size {par.tp_size}")
        if moe.n_routed_experts % moe.n_group:
            raise ValueError(f"n_group {moe.n_group} does not divide n_routed_experts {moe.n_routed_experts}")
        self.moe, self.tp_group_name = moe, par.tp_group_name
        tp = dict(tp_rank=par.tp_rank, tp_size=par.tp_size)
        E, I, Hd = moe.n_routed_experts, moe.moe_intermediate_size, cfg.hidden_size
        self.router = weights.make(f"{prefix}.router", (E, Hd), Hd, dtype=torch.float32)
        self.router_bias = (weights.make(f"{prefix}.router_bias", (E,), Hd, dtype=torch.float32)
                            if moe.topk_method == "noaux_tc" else None)
        self.experts_gate = weights.make(f"{prefix}.experts_gate", (E, I, Hd), Hd, 1, **tp)
        self.experts_up = weights.make(f"{prefix}.experts_up", (E, I, Hd), Hd, 1, **tp)
        self.experts_down = weights.make(f"{prefix}.experts_down", (E, Hd, I), I, 2, **tp)
        if moe.n_shared_experts:
            shared = moe.shared_intermediate_size
            self.shared_gate = weights.make(f"{prefix}.shared_gate", (shared, Hd), Hd, 0, **tp)
            self.shared_up = weights.make(f"{prefix}.shared_up", (shared, Hd), Hd, 0, **tp)
            self.shared_down = weights.make(f"{prefix}.shared_down", (Hd, shared), shared, 1, **tp)

    def forward(self, x):
        routing = routing_weights(F.linear(x.float(), self.router), self.moe, self.router_bias)
        hidden = F.silu(torch.einsum("th,eih->tei", x, self.experts_gate)) * torch.einsum("th,eih->tei", x, self.experts_up)
        expert_out = torch.einsum("tei,ehi->teh", hidden, self.experts_down)
        out = torch.einsum("te,teh->th", routing.to(x.dtype), expert_out)
        if self.moe.n_shared_experts:
            out = out + swiglu(x, self.shared_gate, self.shared_up, self.shared_down)
        return all_reduce(out, self.tp_group_name)
