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


def test_a_cells_time_is_what_its_results_json_records(tmp_path):
    """The cell's own ``wall_time_s``, not the file's modification time (a
    copy or a later rewrite moves that); a file from before the key falls
    back to the modification time."""
    import json
    import os
    from datetime import UTC, datetime

    from benchmarks.suite_floor import cell_seconds

    started = datetime(2026, 11, 28, 12, 0, tzinfo=UTC)
    path = tmp_path / "results.json"
    record = {"status": "completed", "started": started.isoformat()}
    path.write_text(json.dumps({**record, "wall_time_s": 600.5}))
    an_hour_later = started.timestamp() + 3600
    os.utime(path, (an_hour_later, an_hour_later))
    assert cell_seconds(path) == 600.5
    path.write_text(json.dumps(record))
    os.utime(path, (an_hour_later, an_hour_later))
    assert cell_seconds(path) == pytest.approx(3600)
    path.write_text(json.dumps({**record, "status": "failed"}))
    with pytest.raises(SystemExit, match="not completed"):
        cell_seconds(path)
