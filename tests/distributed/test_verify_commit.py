"""A verify step commits only its accepted tokens to the recurrent state at DCP 2 x TP 2 on gloo
ranks: the flow of tests/runtime/test_verify_commit.py (k = 4 drafts, rows accepting 2, 0, 4 and
1, a padded row, then 6 decode steps) equals feeding the accepted tokens directly, in fp32 to 1e-5;
without the commit the rejected drafts stay in the state (the control). Each rank holds its TP
heads' recurrent state and commits it with the same accepted counts."""

from __future__ import annotations

import pytest

from dcp_compile.runtime import parallel
from dcp_compile.runtime.launch import spawn
from tests.runtime.test_verify_commit import _model, verify_then_decode


def rank_run(rank: int, world: int) -> dict:
    tp = parallel.build(world, 1)
    committed, uncommitted = verify_then_decode(lambda: _model(tp), world)
    return {"worst": committed, "uncommitted": uncommitted}


@pytest.fixture(scope="module")
def runs():
    return spawn(rank_run, 2)


def test_verify_commits_only_the_accepted_drafts_at_dcp_two(runs):
    for run in runs:
        assert run["worst"] < 1e-5
        assert run["uncommitted"] > 1e-2
