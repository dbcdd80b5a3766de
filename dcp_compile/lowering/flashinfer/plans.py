"""FlashInfer plans: one MLA wrapper per attention kind of a lowered graph, planned on the host.

A `FlashInferPlan` owns a `BatchMLAPagedAttentionWrapper` in CUDA-graph mode: its metadata
buffers (qo_indptr, kv_indptr, kv_indices, kv_len_arr) are allocated once, for one batch size
(rows, query tokens, block-table width), and `plan()` copies each step's values into them, so a
captured `run()` reads the current step's metadata. Every layer of a graph runs the same plan:
it is made once per step, before the graph runs or replays, by the graph's `FlashInferFeed`, and
the compile regions' graphs of one step share theirs (`FlashInferFeed.share`).
A graph's plan is sized by the step, not by the graph: the graph holds each kind of plan as a
`PlanSpec` without sizes, and its feed keeps one plan per kind and batch size, so one graph
compiled symbolic in the batch shape serves every size (and a device graph captured at a size
replays that size's plan).

The CSR page list is the rank's local block table: page size = the local block size (rows one
logical page puts on a rank, runtime/layout.local_block_size), kv_indices = each row's first
ceil(kv_len / block) local blocks, in position order, from the host metadata RequestTable keeps.
The KV lengths are the rank's local lengths ('all' keys: decode, and every graph at dcp_size 1)
or the local keys before the row's first query ('prefix' keys: verify and extend under DCP,
whose remaining keys go through window attention). The LSE is asked in base e.

`dcp_flashinfer::mla_paged_attention(q_latent, q_rope, kv_cache, plan)` runs a plan. `plan` is a
host-fed graph input (runtime.host_inputs): the plan's one-element handle tensor, which names its
plan, so the plan lives exactly as long as the graph's feed holds it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
import weakref
from dataclasses import dataclass

import torch
import torch.fx as fx

from dcp_compile.lowering.flashinfer import wrapper_api
from dcp_compile.runtime import devices
from dcp_compile.runtime.host_inputs import HOST_INPUT, HostFeed, HostInput, host_placeholders
from dcp_compile.runtime.host_metadata import RankHostMetadata

log = logging.getLogger("dcp_compile")

WORKSPACE_BYTES = 128 << 20
"""FlashInfer's float workspace (split-KV partial outputs), one per device, shared by every plan:
plans run one at a time on one stream."""

KEY_KINDS = ("all", "prefix")
MAX_SIZED_PLANS = 16
"""Plans of batch sizes no device graph was captured with, kept per feed (each holds a wrapper and
its buffers): a scheduler that never pads makes a new size at most steps."""
PLAN_INPUT = "flashinfer_plan"
"""The host-input kind of a plan (its index: the plan's position in the graph's specs)."""
PLAN_SPECS = "dcp_flashinfer_plan_specs"
"""gm.meta key: the PlanSpecs of a lowered graph, in the order of its plan inputs."""

_WORKSPACES: dict[torch.device, torch.Tensor] = {}


class StalePlanError(RuntimeError):
    pass


@dataclass(frozen=True)
class PlanSpec:
    keys: str
    """'all': every local key of a row; 'prefix': the local keys before the row's first query."""
    causal: bool
    """Queries aligned to the end of the keys (FlashInfer's causal mask); only where the keys are
    the whole sequence (dcp_size 1)."""
    rows: int
    """The batch's rows, query tokens and block-table width: 0 in a graph's spec (any size), a
    step's in a plan's (`sized`)."""
    tokens: int
    heads: int
    rank_dim: int
    rope_dim: int
    block_size: int
    """Rows of one local block: FlashInfer's page size."""
    blocks_per_row: int
    """Width of the host block table."""
    sm_scale: float
    dtype: torch.dtype
    device: torch.device

    def __post_init__(self):
        if self.keys not in KEY_KINDS:
            raise ValueError(f"keys must be one of {KEY_KINDS}, got {self.keys!r}")

    def sized(self, host: RankHostMetadata) -> "PlanSpec":
        """This kind of plan for a step's batch size."""
        table = host.block_table
        if table is None:
            raise ValueError("FlashInfer reads the shard through a local block table; the step's host metadata has none")
        return dataclasses.replace(self, rows=len(host.query_lens), tokens=sum(host.query_lens),
                                   blocks_per_row=table.shape[1])


def _workspace(device: torch.device) -> torch.Tensor:
    if device not in _WORKSPACES:
        size = WORKSPACE_BYTES if device.type == "cuda" else 1
        _WORKSPACES[device] = torch.empty(size, dtype=torch.uint8, device=device)
    return _WORKSPACES[device]


def kv_indices_size(spec: PlanSpec) -> int:
    return max(spec.rows * spec.blocks_per_row, 1)


def plan_of(handle: torch.Tensor) -> "FlashInferPlan":
    """The plan whose handle this is (a graph's plan input)."""
    plan = getattr(handle, "_dcp_flashinfer_plan", lambda: None)()
    if plan is None:
        raise RuntimeError("this graph's FlashInfer attention ran without its plan: run the model through "
                           "dcp_compile.apply's module with the batch's host metadata")
    return plan


class FlashInferPlan:
    def __init__(self, spec: PlanSpec):
        self.spec = spec
        device = spec.device
        self.buffers = {name: torch.zeros(size, dtype=torch.int32, device=device) for name, size in (
            ("qo_indptr", spec.rows + 1), ("kv_indptr", spec.rows + 1),
            ("kv_indices", kv_indices_size(spec)), ("kv_len_arr", spec.rows))}
        self.handle = torch.zeros(1, dtype=torch.int32, device=device)
        """The graph's plan input: names this plan (plan_of), whatever the batch size."""
        self.handle._dcp_flashinfer_plan = weakref.ref(self)
        self.wrapper = None
        self.planned_host: RankHostMetadata | None = None
        """The host metadata of the last plan()."""
        self._planned_csr: tuple[torch.Tensor, ...] | None = None
        """The CSR metadata the wrapper was last planned with (host copies)."""
        self._staged: torch.cuda.Event | None = None

    def _make_wrapper(self):
        wrapper_class, _ = wrapper_api(self.spec.device)
        return wrapper_class(_workspace(self.spec.device), use_cuda_graph=True, backend="fa3", **self.buffers)

    @property
    def planned_for(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """(query lens, kv lens) of the last plan()."""
        return None if self.planned_host is None else self.lengths(self.planned_host)

    def lengths(self, host: RankHostMetadata) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(query lens, kv lens) this plan takes from a step's host metadata."""
        kv_lens = host.local_seq_lens if self.spec.keys == "all" else host.local_prefix_lens
        return tuple(host.query_lens), tuple(kv_lens)

    def plan(self, host: RankHostMetadata) -> None:
        spec = self.spec
        query_lens, kv_lens = self.lengths(host)
        if len(query_lens) != spec.rows or sum(query_lens) != spec.tokens:
            raise ValueError(f"host metadata has {len(query_lens)} rows and {sum(query_lens)} query tokens; this graph's "
                             f"FlashInfer plan is for {spec.rows} rows and {spec.tokens} tokens")
        table = host.block_table
        if table is None or tuple(table.shape) != (spec.rows, spec.blocks_per_row):
            raise ValueError(f"FlashInfer reads the shard through a [{spec.rows}, {spec.blocks_per_row}] local block table; "
                             f"host metadata has {None if table is None else list(table.shape)}")
        kv = torch.tensor(kv_lens, dtype=torch.int32)
        blocks = (kv + spec.block_size - 1) // spec.block_size
        used = torch.arange(spec.blocks_per_row)[None, :] < blocks[:, None]
        zero = torch.zeros(1, dtype=torch.int32)
        qo_indptr = torch.cat([zero, torch.tensor(query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)])
        kv_indptr = torch.cat([zero, blocks.cumsum(0, dtype=torch.int32)])
        kv_indices = table.to(torch.int32)[used]
        csr = (kv, qo_indptr, kv_indptr, kv_indices)  # compared in this order: the lengths differ most steps
        if self._planned_csr is not None and all(map(torch.equal, csr, self._planned_csr)):
            # The wrapper holds this plan already: several compile regions' graphs of one step
            # share their plans (FlashInferFeed.share), and a plan is a function of its CSR.
            self.planned_host = host
            return
        if self.wrapper is None:
            self.wrapper = self._make_wrapper()
        _, metadata_class = wrapper_api(spec.device)
        if self._staged is not None:
            # FlashInfer stages each plan through pinned host memory that it copies to the device
            # asynchronously; wait until the last plan's copy ran before writing the next one.
            self._staged.synchronize()
        self.wrapper.plan(
            metadata=metadata_class.csr(qo_indptr, kv_indptr, kv_indices, kv),
            num_heads=spec.heads, head_dim_ckv=spec.rank_dim, head_dim_kpe=spec.rope_dim, page_size=spec.block_size,
            causal=spec.causal, sm_scale=spec.sm_scale, q_data_type=spec.dtype, kv_data_type=spec.dtype,
            query_layout="split", kv_cache_layout="split", lse_mode="basee",
        )
        if spec.device.type == "cuda":
            self._staged = torch.cuda.Event()
            self._staged.record()
        self.planned_host, self._planned_csr = host, csr

    def check_planned(self, host: RankHostMetadata) -> None:
        """Raise if the last plan was not made for this step's lengths (debug mode)."""
        if self.planned_for != self.lengths(host):
            raise StalePlanError(
                f"a FlashInfer plan ({self.spec.keys} keys) was made for lengths {self.planned_for}, but this step has "
                f"{self.lengths(host)}: a run would read another step's metadata"
            )

    def run(self, q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor):
        if self.planned_host is None:
            raise RuntimeError("this graph's FlashInfer attention ran before it was planned: run the model through "
                               "dcp_compile.apply's module with the batch's host metadata")
        spec = self.spec
        if q_latent.shape[0] != spec.tokens:
            raise ValueError(f"this FlashInfer plan was made for {spec.tokens} query tokens (the step's host metadata); "
                             f"the graph runs {q_latent.shape[0]}: host metadata of another batch")
        if kv_cache.shape[0] % spec.block_size:
            raise ValueError(f"the KV shard's {kv_cache.shape[0]} rows are not whole blocks of {spec.block_size}")
        latent = kv_cache[:, : spec.rank_dim].unflatten(0, (-1, spec.block_size))
        rope = kv_cache[:, spec.rank_dim :].unflatten(0, (-1, spec.block_size))
        # Contiguous outputs, as the op's fake says: left to itself FlashInfer allocates out like
        # q_latent, whose strides follow the absorbed matmul (head-major), and a compiler that
        # trusts the fake (inductor) would read it wrongly.
        out = torch.empty(q_latent.shape, dtype=q_latent.dtype, device=q_latent.device)
        lse = torch.empty(q_latent.shape[:2], dtype=torch.float32, device=q_latent.device)
        return self.wrapper.run(query=(q_latent, q_rope), kv_cache=(latent, rope), out=out, lse=lse, return_lse=True,
                                return_lse_base_on_e=True)


@torch.library.custom_op("dcp_flashinfer::mla_paged_attention", mutates_args=())
def mla_paged_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                        plan: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over the rank's KV shard as planned by the plan whose handle is `plan`.
    Returns out [T, H, R] in q's dtype and lse [T, H] fp32 (natural log)."""
    out, lse = plan_of(plan).run(q_latent, q_rope, kv_cache)
    return out.contiguous(), lse.contiguous()  # the fake's layout, whatever the kernel did


@mla_paged_attention.register_fake
def _(q_latent, q_rope, kv_cache, plan):
    tokens, heads, _ = q_latent.shape
    return q_latent.new_empty(q_latent.shape), q_latent.new_empty((tokens, heads), dtype=torch.float32)


class FlashInferFeed(HostFeed):
    """A lowered graph's plans, made from each step's host metadata before it runs or replays,
    and its plan inputs (with the lengths and block table its debug check reads). One plan per
    kind (the graph's specs) and batch size: a graph symbolic in the batch shape runs every size,
    and a device graph captured at one size replays that size's plans."""

    def __init__(self, gm: fx.GraphModule, dcp_rank: int):
        self.specs: list[PlanSpec] = gm.meta[PLAN_SPECS]
        super().__init__(gm.graph, dcp_rank, rows=self.specs[0].rows or None)
        self._sized: collections.OrderedDict[PlanSpec, FlashInferPlan] = collections.OrderedDict()
        """The plans of recent batch sizes, least recently used first (at most MAX_SIZED_PLANS of
        them that no capture holds)."""
        self._captured: dict[PlanSpec, FlashInferPlan] = {}
        """The plans a device graph was captured with: its replays read their buffers, kept for good."""
        self.plans: list[FlashInferPlan] = []
        """This step's plans, one per spec."""

    def prepare(self, host: RankHostMetadata) -> None:
        capturing = devices.capturing(self.specs[0].device)
        self.plans = [self._plan(spec.sized(host), capturing) for spec in self.specs]
        # plan() copies host values to the device, which a device-graph capture must not record;
        # the graph runner plans before every replay instead.
        if capturing:
            return
        for plan in self.plans:
            plan.plan(host)

    def share(self, earlier: list[HostFeed]) -> None:
        """Take the plans of an earlier FlashInfer feed of the same step (another compile region's
        graph): every region of a kind of plan then reads one plan, made once a step."""
        for feed in earlier:
            if isinstance(feed, FlashInferFeed):
                self._sized, self._captured = feed._sized, feed._captured
                return

    def _plan(self, spec: PlanSpec, capturing: bool) -> FlashInferPlan:
        plan = self._captured.get(spec) or self._sized.pop(spec, None) or FlashInferPlan(spec)
        if capturing:
            self._captured[spec] = plan
        elif spec not in self._captured:
            self._sized[spec] = plan  # most recently used last
            while len(self._sized) > MAX_SIZED_PLANS:
                self._sized.popitem(last=False)
        return plan

    def value(self, host_input: HostInput, host: RankHostMetadata, example):
        if host_input.kind != PLAN_INPUT:
            return super().value(host_input, host, example)
        return self.plans[host_input.index].handle

    def check_fed(self, host: RankHostMetadata) -> None:
        super().check_fed(host)
        for plan in self.plans:
            plan.check_planned(host)


def plan_placeholders(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in host_placeholders(graph) if n.meta[HOST_INPUT].kind == PLAN_INPUT]


_WARMED: set[tuple] = set()


def warm_up(device: torch.device, rank_dim: int, rope_dim: int, dtype: torch.dtype, block_size: int) -> float:
    """Build (or load) FlashInfer's MLA kernel for these shapes now, with one tiny plan and run:
    its first use JIT-compiles with nvcc (about 15 s on an H200 host), which no serving step
    should pay. `apply` calls it for a CUDA pool under kernels='flashinfer'. Returns the seconds
    it took (0 when these shapes were warmed already in this process)."""
    key = (torch.device(device), rank_dim, rope_dim, dtype)
    if key in _WARMED:
        return 0.0
    started = time.perf_counter()
    spec = PlanSpec(keys="all", causal=False, rows=1, tokens=1, heads=16, rank_dim=rank_dim, rope_dim=rope_dim,
                    block_size=block_size, blocks_per_row=1, sm_scale=1.0, dtype=dtype, device=torch.device(device))
    plan = FlashInferPlan(spec)
    plan.plan(RankHostMetadata((1,), (1,), (0,), torch.zeros(1, 1, dtype=torch.int32)))
    cache = torch.zeros(block_size, rank_dim + rope_dim, dtype=dtype, device=device)
    query = torch.zeros(1, 16, rank_dim + rope_dim, dtype=dtype, device=device)
    plan.run(query[..., :rank_dim], query[..., rank_dim:], cache)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    _WARMED.add(key)
    seconds = time.perf_counter() - started
    log.info("FlashInfer MLA kernel ready for R=%d, P=%d, %s in %.1f s", rank_dim, rope_dim, dtype, seconds)
    return seconds
