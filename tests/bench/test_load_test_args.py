"""bench.load_test refuses a run with no steps after its warm-up (issue 36, item 10: it crashed
with a TypeError at the end of the run), before it spawns any rank."""

from __future__ import annotations

import pytest

from bench import load_test


@pytest.mark.parametrize("argv", [["--steps", "50"], ["--steps", "100", "--warmup", "100"], ["--warmup", "-1"]])
def test_no_steps_after_the_warm_up_is_refused_up_front(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_test.main(argv)
    assert exit_info.value.code == 2
    assert "must exceed --warmup" in capsys.readouterr().err
