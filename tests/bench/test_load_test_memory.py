"""bench.load_test's memory verdict: the least-squares slope of resident memory per 100 steps."""

from __future__ import annotations

import pytest

from bench import load_test


def test_the_slope_is_the_least_squares_line_per_100_steps():
    assert load_test._slope_per_100([5.0 + 0.002 * step for step in range(1000)]) == pytest.approx(0.2)
    assert load_test._slope_per_100([7.0] * 50) == 0.0
    assert load_test._slope_per_100([7.0]) == 0.0
