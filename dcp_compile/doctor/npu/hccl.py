"""The checks of HCCL collectives inside NPU graphs, on 2 ranks (one spawn serves both checks):
the all-gather and the all-to-all with split lists (torch's functional collectives), and the
all-to-all without split lists that the NPU lowering's exchange calls (dcp_npu.all_to_all,
HCCL's AlltoAll rather than AlltoAllV: docs/ascend.md §17, §19). Each is captured after a warm-up
call and replayed over inputs changed since the capture."""

from __future__ import annotations

import torch

from dcp_compile.doctor.npu.checks import Context, Result, first_line

RANKS = 2


def _functional_collectives(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    device = torch.device("npu", rank)
    group = dist.group.WORLD.group_name
    ops = torch.ops._c10d_functional
    x = torch.full((4, 3), float(rank), device=device)
    y = torch.arange(world_size * 2, dtype=torch.float32, device=device) + 100 * rank

    def step():
        gathered = ops.wait_tensor(ops.all_gather_into_tensor(x, world_size, group))
        exchanged = ops.wait_tensor(ops.all_to_all_single(y, [2] * world_size, [2] * world_size, group))
        return gathered, exchanged

    step()
    torch.npu.synchronize()
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        gathered, exchanged = step()
    x.fill_(rank + 10.0)  # new values: the replay must read them
    y.add_(1000.0)
    graph.replay()
    torch.npu.synchronize()
    want_gathered = torch.cat([torch.full((4, 3), r + 10.0) for r in range(world_size)])
    sent = torch.arange(world_size * 2, dtype=torch.float32)[2 * rank: 2 * rank + 2]
    want_exchanged = torch.cat([sent + 100 * r + 1000 for r in range(world_size)])
    return {"all_gather": bool(torch.equal(gathered.cpu(), want_gathered)),
            "all_to_all": bool(torch.equal(exchanged.cpu(), want_exchanged))}


def _all_to_all_without_splits(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from dcp_compile.lowering.npu import ops as npu_ops

    device = torch.device("npu", rank)
    y = torch.arange(world_size * 2, dtype=torch.float32, device=device).view(world_size, 2) + 100 * rank
    npu_ops.ALL_TO_ALL(y, dist.group.WORLD.group_name)
    torch.npu.synchronize()
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        exchanged = npu_ops.ALL_TO_ALL(y, dist.group.WORLD.group_name)
    y.add_(1000.0)
    graph.replay()
    torch.npu.synchronize()
    want = torch.stack([torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) + 100 * r + 1000
                        for r in range(world_size)])
    return {"all_to_all_no_splits": bool(torch.equal(exchanged.cpu(), want))}


PARTS = {"hccl-in-graphs": _functional_collectives, "all-to-all-no-splits-in-graphs": _all_to_all_without_splits}


def _on_a_rank(rank: int, world_size: int) -> dict:
    """Every part on this rank, by check name: {name: {value: bool}} or {name: "error text"}."""
    found = {}
    for name, part in PARTS.items():
        try:
            found[name] = part(rank, world_size)
        except Exception as exc:  # the other part still runs
            found[name] = first_line(exc, 300)
    return found


def _two_ranks(context: Context):
    """Each rank's results (spawned once a run), or why there are none."""
    if "hccl" not in context.shared:
        if torch.npu.device_count() < RANKS:
            context.shared["hccl"] = f"needs {RANKS} NPUs, found {torch.npu.device_count()}"
        else:
            from dcp_compile.runtime.launch import spawn

            try:
                context.shared["hccl"] = spawn(_on_a_rank, RANKS, backend="hccl", timeout=120)
            except Exception as exc:
                context.shared["hccl"] = exc
    return context.shared["hccl"]


def check_collectives_in_graphs(result: Result, context: Context) -> None:
    ranks = _two_ranks(context)
    if isinstance(ranks, str):
        result.detail = ranks
        return
    if isinstance(ranks, Exception):
        raise ranks
    errors = {f"rank{r}": found[result.name] for r, found in enumerate(ranks) if isinstance(found[result.name], str)}
    if errors:
        result.verdict, result.measured = "FAIL", errors
        return
    result.measured = {f"rank{r}_{k}": v for r, found in enumerate(ranks) for k, v in found[result.name].items()}
    result.verdict = "PASS" if all(result.measured.values()) else "FAIL"
