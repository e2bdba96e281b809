"""`adaptdl.core.stats.drift`: the drift's record over progress and what it shed over the
horizon, which the floor's share reads when no target is stated."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptdl.core.stats.drift import HORIZON, POINTS_PER_DOUBLING, DriftHistory


@settings(max_examples=100, deadline=None)
@given(
    st.floats(-5.0, 5.0),  # the drift at progress 1
    st.floats(-2.0, 2.0),  # what it sheds per doubling (below 0: it rises)
    st.floats(1.001, 1.5),  # the factor between records
    st.floats(4.0, 1e5),  # where it is read
)
def test_a_log_linear_drift_sheds_the_same_over_every_horizon(
    start: float, per_doubling: float, factor: float, end: float
) -> None:
    history = DriftHistory()
    progress = 1.0
    while progress <= end:
        history.record(progress, start - per_doubling * math.log2(progress))
        progress *= factor
    drift = start - per_doubling * math.log2(end)
    expected = per_doubling * math.log2(HORIZON)
    shed = history.shed(end, drift)
    assert shed == pytest.approx(expected, rel=1e-6, abs=1e-9)


def test_the_record_keeps_a_few_points_back_to_the_horizon() -> None:
    history = DriftHistory()
    for step in range(1, 20_000):
        history.record(float(step), 1.0 / step)
        assert len(history.points) <= POINTS_PER_DOUBLING * math.log2(HORIZON) + 2
    first, last = history.points[0][0], history.points[-1][0]
    assert first <= 19_999 / HORIZON < history.points[1][0] and last <= 19_999


def test_nothing_is_read_before_the_record_reaches_back_and_a_rise_reads_negative() -> None:
    history = DriftHistory()
    assert history.shed(10.0, 1.0) is None
    history.record(10.0, 1.0)
    assert history.shed(15.0, 0.9) is None  # back to 7.5: before the first point
    assert history.shed(20.0, 0.9) == pytest.approx(0.1)  # back to 10 exactly
    assert history.shed(20.0, 1.3) == pytest.approx(-0.3)  # the drift rose
    # Read between two points, linearly in log-progress.
    history.record(40.0, 0.5)
    assert history.shed(40.0, 0.5) == pytest.approx(0.25)  # back to 20: (1.0 + 0.5) / 2 - 0.5
    assert history.shed(60.0, 0.4) == pytest.approx(1.0 - math.log(3) / math.log(4) * 0.5 - 0.4)


def test_a_progress_below_the_record_forgets_the_points_past_it() -> None:
    history = DriftHistory(points=[[10.0, 1.0], [20.0, 0.8], [40.0, 0.6]])
    history.record(25.0, 0.7)  # a job restored from an older state
    assert history.points == ((10.0, 1.0), (20.0, 0.8), (25.0, 0.7))
    history.record(25.5, 0.69)  # closer than the spacing to the last point: not kept
    assert history.points[-1] == (25.0, 0.7)


def test_the_record_round_trips_as_data_and_refuses_bad_state() -> None:
    history = DriftHistory()
    for p in (1.0, 2.0, 4.0):
        history.record(p, 3.0 - p)
    again = DriftHistory.from_json(json.loads(json.dumps(history.to_json())))
    assert again.points == history.points
    for bad, match in [
        ("12", "points must be a list"),
        ([[1.0]], "points must hold"),
        ([[0.0, 1.0]], r"progress must be > 0\.0"),
        ([[1.0, math.nan]], "drift must be finite"),
        ([[2.0, 1.0], [1.0, 1.0]], "points' progress must increase"),
    ]:
        with pytest.raises(ValueError, match=match):
            DriftHistory.from_json(bad)
    with pytest.raises(ValueError, match=r"progress must be > 0\.0"):
        history.record(0.0, 1.0)
    with pytest.raises(ValueError, match="drift must be finite"):
        history.shed(8.0, math.inf)
