"""The event clock: exact times, a fixed order at equal times, insertion order last."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptdl.sim.engine import EventKind, EventQueue


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0, 1e6, allow_nan=False), st.sampled_from(list(EventKind))),
        max_size=50,
    )
)
def test_events_pop_in_time_then_kind_then_insertion_order(items: list) -> None:
    q = EventQueue()
    pushed = [q.push(t, k, job=str(i)) for i, (t, k) in enumerate(items)]
    popped = [q.pop() for _ in range(len(q))]
    assert popped == sorted(pushed, key=lambda e: (e.time, e.kind, e.seq))
    assert not q and q.peek_time() == math.inf


def test_completion_comes_before_the_round_at_the_same_instant() -> None:
    q = EventQueue()
    q.push(60.0, EventKind.SCHEDULE)
    q.push(60.0, EventKind.COMPLETION, job="a")
    assert q.pop().kind == EventKind.COMPLETION


def test_non_finite_time_is_refused() -> None:
    with pytest.raises(ValueError, match="event time must be finite"):
        EventQueue().push(math.inf, EventKind.ARRIVAL)
