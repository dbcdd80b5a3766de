"""bench.serve_warmup in its smoke mode (CPU, 2 tiny layers, replays rerun on the host): one compile
per kind of step, a capture per size (largest first), each replay equal to the step called outside the graph, and
the warm compile of a second process. Launched by torchrun, as on a GPU: the warm child must not
join torchrun's store (it inherited TORCHELASTIC_USE_AGENT_STORE and waited past the GPU run's
limit)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.lib import result as results
from dcp_compile.runtime.launch import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_serve_warmup_smoke_captures_every_size_from_few_compiles(tmp_path):
    out = tmp_path / "serve_warmup.json"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(free_port())]
    subprocess.run([*torchrun, "-m", "bench.serve_warmup", "--smoke", "--out", str(out)], check=True, cwd=ROOT,
                   timeout=120, capture_output=True)
    result = results.read(out)
    assert result["benchmark"] == "serve_warmup"
    rows, run = results.rows(result), result["run"]
    assert [(r["kind"], r["k"], r["batch"]) for r in rows] == [
        ("decode", 1, 4), ("decode", 1, 2), ("decode", 1, 1), ("verify", 3, 2), ("verify", 3, 1)]  # largest first
    for row in rows:
        assert row["max_abs_diff"] == 0.0  # a rerun of the same step on the same inputs
        assert row["capture_seconds"] > 0 and row["step_seconds"] > 0
    assert rows[0]["graphs_compiled"] >= 1 and rows[1]["graphs_compiled"] == 0 and rows[3]["graphs_compiled"] == 0
    assert run["recompiles"] == 0  # a size of 1 too, from the graph compiled at the largest size
    assert run["failures"] == []
    assert run["compile_seconds"] == rows[0]["capture_seconds"] and run["warm_compile_seconds"] > 0
    assert sum(run["warm_compile_phases_seconds"].values()) > 0  # dynamo's phases of the warm compile
    assert run["ready_seconds"] >= sum(r["capture_seconds"] for r in rows)
