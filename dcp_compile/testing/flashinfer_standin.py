"""A torch stand-in for flashinfer.mla.BatchMLAPagedAttentionWrapper, where FlashInfer is absent.

It takes the keywords dcp_compile passes to the real wrapper (constructor in CUDA-graph mode,
`plan(metadata=MLAPlanMetadata.csr(...), ...)`, `run(query=(q_nope, q_pe), kv_cache=(ckv, kpe),
return_lse=True, return_lse_base_on_e=...)`), refuses what the real one refuses on the way
(non-int32 metadata, CSR page counts that are not ceil(kv_len / page_size), reserved buffers of
the wrong size, a run that does not match the plan), and computes in fp32 what FlashInfer
computes:

- row b's keys are its first kv_len[b] slots of pages kv_indices[kv_indptr[b]:kv_indptr[b+1]];
- causal: query i of a row of q queries sees key j iff j <= kv_len - q + i (queries aligned to
  the end of the keys), otherwise every query sees every key;
- out in q's dtype, LSE in base 2 unless return_lse_base_on_e;
- a query that sees no key gets out 0 and LSE -inf.

Every plan's arguments are kept in `plans` (tests assert them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class MLAPlanMetadata:
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_len_arr: torch.Tensor

    @classmethod
    def csr(cls, qo_indptr, kv_indptr, kv_indices, kv_len_arr) -> "MLAPlanMetadata":
        return cls(qo_indptr, kv_indptr, kv_indices, kv_len_arr)


class ReferenceMLAWrapper:
    def __init__(self, float_workspace_buffer, use_cuda_graph: bool = False, qo_indptr=None, kv_indptr=None,
                 kv_indices=None, kv_len_arr=None, backend: str = "auto"):
        self.device = float_workspace_buffer.device
        self.use_cuda_graph, self.backend = use_cuda_graph, backend
        self.buffers = dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=kv_len_arr)
        if use_cuda_graph and any(b is None for b in self.buffers.values()):
            raise ValueError("CUDA graph mode requires reserved qo_indptr, kv_indptr, kv_indices, and kv_len_arr buffers.")
        self.plans: list[dict] = []
        self._plan: dict | None = None

    def plan(self, *, metadata: MLAPlanMetadata, num_heads: int, head_dim_ckv: int, head_dim_kpe: int, page_size: int,
             causal: bool, sm_scale: float, q_data_type: torch.dtype, kv_data_type: torch.dtype,
             query_layout: str = "packed", kv_cache_layout: str = "packed", lse_mode: str = "none") -> None:
        csr = {name: getattr(metadata, name) for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr")}
        for name, tensor in csr.items():
            if tensor.dtype != torch.int32 or tensor.dim() != 1:
                raise ValueError(f"{name} must be a rank-1 torch.int32 tensor, got {tensor.dtype} of rank {tensor.dim()}")
        batch = csr["kv_len_arr"].numel()
        if csr["qo_indptr"].numel() != batch + 1 or csr["kv_indptr"].numel() != batch + 1:
            raise ValueError("CSR metadata batch dimensions must agree")
        pages = (csr["kv_len_arr"].long() + page_size - 1) // page_size
        if not torch.equal(pages.cpu(), (csr["kv_indptr"][1:] - csr["kv_indptr"][:-1]).long().cpu()):
            raise ValueError("CSR metadata page counts in kv_indptr must equal ceil(kv_len_arr / page_size).")
        if int(csr["kv_indptr"][-1]) > csr["kv_indices"].numel():
            raise ValueError("kv_indices has fewer entries than kv_indptr[-1]")
        if self.use_cuda_graph:
            for name, source in csr.items():
                reserved = self.buffers[name]
                fits = reserved.numel() >= source.numel() if name == "kv_indices" else reserved.shape == source.shape
                if not fits:
                    raise ValueError(f"CUDA graph reserved {name} buffer has insufficient or incompatible capacity.")
                reserved[: source.numel()].copy_(source)
        if q_data_type != kv_data_type:
            raise ValueError(f"fa3 non-FP8 KV dtype must match the query dtype, got {kv_data_type} and {q_data_type}")
        self._plan = dict(csr={k: v.clone() for k, v in csr.items()}, num_heads=num_heads, head_dim_ckv=head_dim_ckv,
                          head_dim_kpe=head_dim_kpe, page_size=page_size, causal=causal, sm_scale=sm_scale,
                          q_data_type=q_data_type, kv_data_type=kv_data_type, query_layout=query_layout,
                          kv_cache_layout=kv_cache_layout, lse_mode=lse_mode)
        self.plans.append(self._plan)

    def run(self, *, query, kv_cache, out=None, lse=None, return_lse: bool = False, return_lse_base_on_e: bool = False):
        plan = self._plan
        if plan is None:
            raise RuntimeError("BatchMLAPagedAttentionWrapper.run() called before plan().")
        if return_lse and plan["lse_mode"] != ("basee" if return_lse_base_on_e else "base2"):
            raise ValueError(f"planned LSE mode {plan['lse_mode']} does not match the run")
        q_nope, q_pe = query
        ckv, kpe = kv_cache
        csr = plan["csr"]
        tokens = int(csr["qo_indptr"][-1])
        if tuple(q_nope.shape[:2]) != (tokens, plan["num_heads"]):
            raise ValueError("q_nope rows and heads must match the planned query shape.")
        if ckv.shape[1] != plan["page_size"] or q_nope.dtype != plan["q_data_type"] or ckv.dtype != plan["kv_data_type"]:
            raise ValueError("the run's page size or dtypes do not match the plan")
        given_out, given_lse = out, lse  # FlashInfer writes into these when given
        out = torch.zeros(q_nope.shape, dtype=torch.float32, device=q_nope.device)
        lse = torch.full(q_nope.shape[:2], -math.inf, dtype=torch.float32, device=q_nope.device)
        for row in range(csr["kv_len_arr"].numel()):
            first, last = int(csr["qo_indptr"][row]), int(csr["qo_indptr"][row + 1])
            kv_len = int(csr["kv_len_arr"][row])
            if last == first or kv_len == 0:
                continue
            pages = csr["kv_indices"][int(csr["kv_indptr"][row]) : int(csr["kv_indptr"][row + 1])].long()
            keys = ckv[pages].reshape(-1, ckv.shape[-1])[:kv_len].float()
            key_rope = kpe[pages].reshape(-1, kpe.shape[-1])[:kv_len].float()
            scores = (torch.einsum("qhr,kr->qhk", q_nope[first:last].float(), keys)
                      + torch.einsum("qhp,kp->qhk", q_pe[first:last].float(), key_rope)) * plan["sm_scale"]
            if plan["causal"]:
                queries = last - first
                visible = torch.arange(kv_len)[None, :] <= (kv_len - queries + torch.arange(queries))[:, None]
                scores = scores.masked_fill(~visible[:, None, :].to(scores.device), -math.inf)
            row_lse = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - torch.where(torch.isinf(row_lse), 0.0, row_lse)[..., None])
            out[first:last] = torch.einsum("qhk,kr->qhr", probs, keys)
            lse[first:last] = row_lse
        if not return_lse_base_on_e:
            lse = lse / math.log(2.0)
        out = out.to(q_nope.dtype)
        if given_out is not None:
            out = given_out.copy_(out)
        if given_lse is not None:
            lse = given_lse.copy_(lse)
        return (out, lse) if return_lse else out
