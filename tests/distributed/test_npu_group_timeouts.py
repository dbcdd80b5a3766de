"""The TP and DCP groups on ranks of the emulated npu device (HCCL) wait the launcher's timeout for
a stalled peer, not torch's default of 30 minutes (issue 36, item 8: they waited 30 minutes).

dist.new_group does not inherit the world's timeout, and the emulated HCCL, a Python process group,
does not report its own to be read back (torch_npu's ProcessGroupHCCL does): the launchers record
it. A world whose timeout is neither recorded nor reported is an error when its groups are built,
unless they are given a timeout.
"""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from dcp_compile.runtime import launch, parallel
from dcp_compile.runtime.launch import spawn

pytestmark = pytest.mark.usefixtures("npu_emulator")  # tests/conftest.py: the ranks inherit it

LAUNCH_TIMEOUT_S = 7.0
EXPLICIT_TIMEOUT_S = 2.5


def _made_with(group_name: str) -> float:
    """The timeout an emulated HCCL group was made with, in seconds: its gloo group's (the emulated
    group itself reports none)."""
    return dist.distributed_c10d._resolve_process_group(group_name)._gloo.options._timeout.total_seconds()


def _timeouts_on_rank(rank: int, world: int, port: int) -> dict:
    default = parallel.build(2, 2)
    replicated = parallel.build_replicated(2)
    explicit = parallel.build(2, 1, timeout=datetime.timedelta(seconds=EXPLICIT_TIMEOUT_S))
    seen = {"tp": _made_with(default.tp_group_name), "dcp": _made_with(default.dcp_group_name),
            "replicated dcp": _made_with(replicated.dcp_group_name), "explicit tp": _made_with(explicit.tp_group_name)}
    dist.destroy_process_group()  # a world the launcher did not start: its timeout recorded nowhere
    dist.init_process_group("hccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=LAUNCH_TIMEOUT_S))
    try:
        unrecorded = parallel.build(2, 2)
        seen["unrecorded tp"] = _made_with(unrecorded.tp_group_name)
    except RuntimeError as exc:
        seen["unrecorded tp"] = str(exc)
    seen["unrecorded, explicit tp"] = _made_with(
        parallel.build(2, 2, timeout=datetime.timedelta(seconds=EXPLICIT_TIMEOUT_S)).tp_group_name)
    return seen


def test_tp_and_dcp_groups_on_hccl_wait_the_launchers_timeout_or_fail_to_build():
    for seen in spawn(_timeouts_on_rank, 2, launch.free_port(), backend="hccl", timeout=LAUNCH_TIMEOUT_S):
        unrecorded = seen.pop("unrecorded tp")
        assert seen == {"tp": LAUNCH_TIMEOUT_S, "dcp": LAUNCH_TIMEOUT_S, "replicated dcp": LAUNCH_TIMEOUT_S,
                        "explicit tp": EXPLICIT_TIMEOUT_S, "unrecorded, explicit tp": EXPLICIT_TIMEOUT_S}
        assert "timeout is unknown" in unrecorded and "'hccl'" in unrecorded and "record_world_timeout" in unrecorded
