"""The suite-floor benchmark (benchmarks/suite_floor.py) extrapolates right.

Oracle: a closed form. A plain loop of 20 rounds whose training rounds take
2 s and whose evaluation rounds (every 10th) take 5 s, after 7 s of start-up
and a slow first round, extrapolates to 500 rounds as 7 + 500 × 2 + 50 × 3.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.app  # imports torch and the app's run config


def test_a_short_floor_extrapolates_to_the_suites_rounds():
    from benchmarks.suite_floor import extrapolate

    rounds = [9.0] + [5.0 if r % 10 == 0 else 2.0 for r in range(2, 21)]
    measured = {"round_s": rounds, "startup_s": 7.0}
    assert extrapolate(measured, 500, 10) == pytest.approx(7 + 500 * 2 + 50 * 3)
    # no evaluation: every round is a training round
    assert extrapolate({"round_s": [9.0, 2.0, 4.0], "startup_s": 1.0}, 10, 0) == (
        pytest.approx(1 + 10 * 3)
    )
