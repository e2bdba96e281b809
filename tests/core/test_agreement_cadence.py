"""The boundary agreements' cadence: every k-th step boundary, k agreed from rank 0's step time."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.fakes import ManualClock
from tests.threadcollective import run_replicas

from adaptdl.core.collective import LocalCollective
from adaptdl.core.job import Job
from adaptdl.core.loop.boundary import AgreementCadence, CheckpointPolicy, Preempted
from adaptdl.core.persist.checkpoint import MemoryCheckpointStore
from adaptdl.core.topology import Topology


class Counting(LocalCollective):
    """A one-replica collective that a job treats as several (no in-process shortcut),
    counting the reductions started."""

    in_process = False

    def __init__(self):
        super().__init__()
        self.started = 0
        self.values = []

    def allreduce_async(self, value, op=None):
        self.started += 1
        self.values.append(value)
        return super().allreduce_async(value, op)


@given(
    cost=st.floats(0.0, 0.1),
    share=st.floats(1e-4, 1.0),
    max_latency=st.floats(0.0, 10.0),
    max_every=st.integers(1, 64),
    step_time=st.floats(1e-6, 100.0),
)
def test_every_keeps_the_cost_share_and_the_latency(
    cost, share, max_latency, max_every, step_time
):
    cadence = AgreementCadence(cost, share, max_latency, max_every)
    k = cadence.every(step_time)
    assert 1 <= k <= max_every
    if k > 1:
        # Spaced out only as far as the latency allows, and no further than the cost asks.
        assert k * step_time <= max_latency * (1 + 1e-9)
        assert cost / ((k - 1) * step_time) > share * (1 - 1e-9)
    if k < min(max_every, math.floor(max_latency / step_time)):
        assert cost / (k * step_time) <= share * (1 + 1e-9)


@pytest.mark.parametrize("step_time", [0.0, -1.0, math.nan, math.inf])
def test_an_unknown_step_time_agrees_at_every_boundary(step_time):
    assert AgreementCadence().every(step_time) == 1


def test_the_default_spaces_fast_steps_and_not_slow_ones():
    cadence = AgreementCadence()
    assert cadence.every(1.0) == 1  # a GPU step of a second: its cost is 0.1%
    assert cadence.every(0.06) == 7  # a 60 ms CPU step: 1 ms a reduction is 1.7%
    assert cadence.every(0.001) == cadence.max_every


@pytest.mark.parametrize(
    ("argument", "value"),
    [("cost", -1.0), ("share", 0.0), ("share", 2.0), ("max_latency", -0.5), ("max_every", 0)],
)
def test_bad_cadence_names_its_argument(argument, value):
    with pytest.raises((ValueError, TypeError), match=argument):
        AgreementCadence(**{argument: value})


@settings(max_examples=30, deadline=None)
@given(
    replicas=st.integers(2, 4),
    step_ms=st.sampled_from([1, 5, 20, 60, 200, 1000]),
    stop_step=st.integers(0, 60),
    stopper=st.integers(0, 3),
)
def test_every_replica_stops_at_the_same_boundary_within_two_agreements(
    replicas, step_ms, stop_step, stopper
):
    """A stop asked by any replica at any step is acted on by all at one boundary, within
    two agreements; the replicas reduce about once per agreed k boundaries."""
    store = MemoryCheckpointStore()
    cadence = AgreementCadence()
    k = cadence.every(step_ms / 1000)
    stopper %= replicas

    def replica(collective):
        job = Job(
            Topology(rank=collective.rank, num_replicas=replicas),
            collective=collective,
            store=store,
            clock=ManualClock(step_ms / 1000),
        )
        for step in range(200):
            if step == stop_step and collective.rank == stopper:
                job.request_stop()
            try:
                job.step_boundary()
            except Preempted:
                return step
        return None

    stops = run_replicas(replicas, replica)
    assert len(set(stops)) == 1 and stops[0] is not None
    # The first two agreements are one boundary apart (no step time yet, then the first).
    assert stop_step < stops[0] <= stop_step + 2 * k + 2


def test_fast_steps_reduce_once_per_agreed_k_boundaries():
    """Two replicas of 5 ms steps: agreements every 16th boundary after the first three."""

    collective = Counting()
    job = Job(collective=collective, clock=ManualClock(0.005))
    assert job.agreement_cadence.every(0.005) == 16
    for _ in range(3 + 16 * 10):
        job.step_boundary()
    assert collective.started == 3 + 10


def test_checkpoints_counted_in_steps_agree_at_every_boundary():
    """``every_steps`` checkpoints land on their step whatever the step time."""

    collective = Counting()
    job = Job(
        collective=collective,
        store=MemoryCheckpointStore(),
        clock=ManualClock(0.001),
        checkpoint_policy=CheckpointPolicy(every_seconds=None, every_steps=5),
    )
    for _ in range(20):
        job.step_boundary()
    assert collective.started == 20
    assert job.checkpoints_written == 4


def test_steps_that_turn_slow_are_agreed_on_at_every_boundary_again_soon():
    """After fast steps, the first slow step makes rank 0 propose the slow step's spacing
    (not the fast mean's), so at most two spaced-out waits of the fast spacing pass (the
    one agreed already, and the one in flight) before every boundary agrees again."""
    collective = Counting()
    clock = ManualClock(0.002)
    job = Job(collective=collective, clock=clock)
    for _ in range(40):
        job.step_boundary()
    clock.tick = 1.0  # a step of a second: agreeing costs 0.1% of it
    every = job.agreement_cadence.max_every
    for _ in range(2 * every + 1):
        job.step_boundary()
    started = collective.started
    for _ in range(5):
        job.step_boundary()
    assert collective.started - started == 5


def test_the_first_slow_step_proposes_its_own_spacing():
    """Rank 0 proposes from the slower of its mean step and its latest one: the mean of
    fast steps and one slow step would still space agreements 4 apart."""
    collective = Counting()
    clock = ManualClock(0.002)
    job = Job(collective=collective, clock=clock)
    for _ in range(40):
        job.step_boundary()
    while job._until_agreement > 0:  # up to the boundary before the next agreement
        job.step_boundary()
    clock.tick = 1.0
    job.step_boundary()
    assert collective.values[-1][3] == 1
