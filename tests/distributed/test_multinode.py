"""Two torchrun agents on localhost (2 nodes x 2 ranks, c10d rendezvous) run the demo's DCP
check against dcp_size=1: the multi-node launch the README shows, at small shapes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from dcp_compile.runtime.launch import free_port


def test_two_torchrun_nodes_match_dcp_size_one(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    endpoint = f"127.0.0.1:{free_port()}"
    command = [torchrun, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
               "--rdzv-id", "dcp-multinode-test", "-m", "dcp_compile.cli.main", "demo", "--launch", "torchrun",
               "--dcp-size", "2", "--tp-size", "2", "--batch", "2", "--context", "1,9", "--steps", "2", "--timeout", "60",
               "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
             for _ in range(2)]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=240))
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], [err[-6000:] for _, err in outputs]
    summaries = [json.loads(line) for out, _ in outputs for line in out.splitlines() if line.startswith("{")]
    assert len(summaries) == 1  # global rank 0 prints
    summary = summaries[0]
    assert summary["tokens_match"] and summary["outputs_match"] and summary["finite"]
    assert summary["max_abs_diff"] < 1e-5 and sum(summary["tokens_stored_per_dcp_rank"]) == summary["tokens_total"]
