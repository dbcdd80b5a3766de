"""Capture a preset model's dynamo graph with shapes only: no weights, no process group, no run.

What `dcp-compile dump` and bench/pass_pipeline.py run the passes on, in one process:
- the model is built on the meta device, so a 61-layer Kimi-K2 allocates no weights;
- TP is rank 0 of a fake group: heads are split, and the all-reduces name FAKE_TP_GROUP, a
  string that is embedded in the graph and never resolved;
- the recording backend keeps the graph and returns meta outputs, so nothing is executed;
- the passes embed FAKE_DCP_GROUP the same way.

Modes (the batch is built by RequestTable.extend_batch, over `context` cached tokens each):
decode = 1 new token per request, verify = `draft_len` tokens per request, extend = a chunk of
`chunk` tokens per request.

The request table is real (host memory, pages handed out one by one), so every size is bounded
before anything is allocated (MAX_* below): Kimi-K2's 128k context at a batch of 256 fits, with
pages of 32 locations or more (engines page by 64 or more).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.node import map_arg

from dcp_compile import cost_model, strategy
from dcp_compile.binding import Binding, bind
from dcp_compile.models.config import MLAModelConfig, allowed_tp_sizes
from dcp_compile.models.mla import MLAModel
from dcp_compile.passes import default_passes
from dcp_compile.passes.base import PassConfig
from dcp_compile.passes.cache_use import bind_pool
from dcp_compile.runtime import parallel
from dcp_compile.runtime.batch import RequestTable
from dcp_compile.workload import DTYPES, Workload

ATTENTION_STRATEGIES = ("auto",) + cost_model.STRATEGIES
FAKE_TP_GROUP, FAKE_DCP_GROUP = "fake-tp-group", "fake-dcp-group"
MAX_BATCH = 1024
"""Requests in the batch (serving batches are a few hundred)."""
MAX_CONTEXT = 1 << 20
"""Tokens of one request, cached or new, and locations of a page (DeepSeek-V3 and Kimi-K2 serve 128k-160k)."""
MAX_LAYERS = 256
"""Layers captured (DeepSeek-V3 and Kimi-K2 have 61); capture time grows with them."""
MAX_PAGE_TABLE_ENTRIES = 1 << 26
"""batch x tokens per request: the request table's page tables are that many int64, twice (1 GiB)."""
MAX_PAGES = 1 << 21
"""Pages the request table hands out, each on the host one by one (about 10 us each: 20 s)."""


@dataclass(frozen=True)
class GraphSpec(Workload):
    """One shape-only capture of a workload (dcp_compile.workload.Workload: model, layout, mode,
    kernels). Every field is checked when the spec is made."""

    tp_size: int | None = None
    """TP ranks the heads are split over (this is rank 0); None means tp_size = dcp_size."""
    draft_len: int = 4
    chunk: int = 64
    """extend: new tokens per request."""
    context: int = 256
    """Tokens already cached for each request before this step."""
    block_size: int = 128

    default_dtype = "bfloat16"

    def __post_init__(self) -> None:
        super().__post_init__()
        cfg = self.model_config()
        if self.chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {self.chunk}")
        if self.context < 0:
            raise ValueError(f"context must be >= 0, got {self.context}")
        if self.page < 1:
            raise ValueError(f"page-size must be >= 1, got {self.page}")
        self._check_sizes(cfg, self.lowering().page_size(self.dcp_size, self.interleave, self.block_size) is not None)
        tp = self.tp
        allowed = allowed_tp_sizes(cfg)
        if tp not in allowed:
            linear = f", {cfg.hidden_size // cfg.linear_head_dim} linear-attention heads" if "linear" in cfg.layer_types else ""
            raise ValueError(
                f"tp_size {tp} does not split model {self.model} ({cfg.num_heads} attention heads{linear}, "
                f"MLP width {cfg.intermediate_size}); allowed tp sizes: {allowed}"
            )
        parallel.validate_sizes(tp, self.dcp_size, tp)

    def _check_sizes(self, cfg: MLAModelConfig, pages_from_blocks: bool) -> None:
        """What capture() allocates and loops over stays within the MAX_* bounds."""
        for name, value, limit, unit in (("batch", self.batch, MAX_BATCH, "requests"),
                                         ("context", self.context, MAX_CONTEXT, "tokens"),
                                         ("chunk", self.chunk, MAX_CONTEXT, "tokens")):
            if value > limit:
                raise ValueError(f"{name} {value} exceeds the dump's limit of {limit} {unit}")
        if self.page > MAX_CONTEXT:
            if pages_from_blocks:
                raise ValueError(f"block-size {self.block_size} makes pages of {self.page} locations, more than the "
                                 f"dump's limit of {MAX_CONTEXT}")
            raise ValueError(f"page-size {self.page} exceeds the dump's limit of {MAX_CONTEXT} locations")
        if cfg.num_layers > MAX_LAYERS:
            raise ValueError(f"{self.model} with {cfg.num_layers} layers exceeds the dump's limit of {MAX_LAYERS} layers "
                             "(--layers captures fewer)")
        per_request = self.context + self.new_tokens
        if self.batch * per_request > MAX_PAGE_TABLE_ENTRIES:
            raise ValueError(f"{self.batch} requests of {per_request} tokens make {self.batch * per_request} page-table "
                             f"entries, more than the dump's limit of {MAX_PAGE_TABLE_ENTRIES}")
        pages = self.batch * -(-per_request // self.page)
        if pages > MAX_PAGES:
            raise ValueError(f"{self.batch} requests of {per_request} tokens need {pages} pages of {self.page}, more than "
                             f"the dump's limit of {MAX_PAGES}: use a larger --page-size (engines page by 64 or more), "
                             "or fewer requests or tokens")

    @property
    def page(self) -> int:
        return self.pages


    @property
    def new_tokens(self) -> int:
        """Query tokens per request."""
        return {"decode": 1, "verify": self.draft_len, "extend": self.chunk}[self.mode]

    @property
    def query_tokens(self) -> int:
        return self.batch * self.new_tokens

    def parallel_state(self) -> parallel.ParallelState:
        return parallel.ParallelState(tp_size=self.tp, tp_rank=0, dcp_size=1, dcp_rank=0,
                                      tp_group_name=FAKE_TP_GROUP if self.tp > 1 else None)

    def describe(self) -> str:
        cfg = self.model_config()
        layers = f"{cfg.num_layers} layer{'s' if cfg.num_layers != 1 else ''}"
        return (f"{self.model}, {layers} ({cfg.num_mla_layers} MLA), {self.mode}: "
                f"{self.batch} x {self.new_tokens} tokens over {self.context} cached, "
                f"DCP {self.dcp_size} x TP {self.tp}, {self.dtype}, kernels {self.kernels}")


@dataclass
class CapturedGraph:
    gm: fx.GraphModule
    spec: GraphSpec
    seconds: float
    binding: Binding | None
    """What bind() resolved for the spec's pool (None for a model without MLA sites): the back end
    and config the passes below run with, as apply() would run them."""

    def lowering(self):
        return self.binding.lowering if self.binding is not None else self.spec.lowering()

    def config(self):
        return self.binding.config if self.binding is not None else self.spec.config()

    def strategy_decision(self) -> cost_model.Decision:
        """The strategy for this batch, as the compiled model decides it (strategy.decide)."""
        spec = self.spec
        cfg = spec.model_config()
        batch = strategy.BatchFacts(
            query_tokens=spec.query_tokens, rows=spec.batch, width=spec.context + spec.new_tokens,
            visible_keys=spec.batch * sum(spec.context + i + 1 for i in range(spec.new_tokens)),
            max_query_len=spec.new_tokens)
        model = strategy.ModelFacts(cfg.num_heads // spec.tp, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                                    torch.empty((), dtype=DTYPES[spec.dtype]).element_size())
        return strategy.decide(self.config(), self.lowering(), batch, model)

    def pass_config(self) -> PassConfig:
        spec, config = self.spec, self.config()
        return PassConfig(dcp_size=spec.dcp_size, dcp_rank=0, interleave=spec.interleave,
                          dcp_group_name=FAKE_DCP_GROUP if spec.dcp_size > 1 else None,
                          debug_checks=spec.debug_checks, attention_strategy=self.strategy_decision().strategy,
                          fuse_projections=config.fuse_projections == "on", page_size=spec.page)

    def passes(self) -> list:
        """The pass pipeline of the bound back end."""
        return default_passes(self.lowering().passes())


def _placeholder_outputs(gm: fx.GraphModule):
    """Meta tensors shaped like the graph's outputs: what the compiled function returns."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = map_arg(output.args[0], lambda n: n.meta.get("val", n.meta.get("example_value")))

    def as_meta(value):
        if isinstance(value, torch.Tensor):
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
        return value

    return torch.utils._pytree.tree_map(as_meta, values)


def capture(spec: GraphSpec) -> CapturedGraph:
    """Build spec's model on the meta device and capture its full graph without running it."""
    start = time.perf_counter()
    cfg = spec.model_config()
    per_request = spec.context + spec.new_tokens
    pages_per_request = -(-per_request // spec.page)
    capacity = (spec.batch * pages_per_request + 1) * spec.page  # page 0 holds the reserved location 0
    model = MLAModel(cfg, kv_capacity=capacity, max_requests=spec.batch, par=spec.parallel_state(),
                     dtype=DTYPES[spec.dtype], device="meta", page_size=spec.page)
    binding = None
    if model.kv_pool is not None:
        # As apply() does: the back end's checks, and the cache the passes see is this rank's shard in its layout.
        binding = bind(spec.config(), model.kv_pool, model)
        binding.shard_pool(dcp_rank=0)
    table = RequestTable(spec.batch, per_request, capacity, page_size=spec.page)
    requests = list(range(spec.batch))
    if spec.context:
        for request in requests:
            table.append(request, spec.context)
    batch = table.extend_batch(requests, [[1] * spec.new_tokens for _ in requests]).to("meta")

    graphs: list[fx.GraphModule] = []

    def record(gm: fx.GraphModule, example_inputs):
        if model.kv_pool is not None:
            bind_pool(gm, example_inputs, model.kv_pool)
        graphs.append(gm)
        outputs = _placeholder_outputs(gm)
        return lambda *args: outputs

    torch._dynamo.reset()
    torch.compile(model, backend=record, fullgraph=True, dynamic=False)(*batch.args())
    torch._dynamo.reset()
    if len(graphs) != 1:
        raise RuntimeError(f"expected one captured graph, got {len(graphs)}")
    return CapturedGraph(graphs[0], spec, time.perf_counter() - start, binding)
