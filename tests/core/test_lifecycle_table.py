"""The job's lifecycle table: every transition walked, every other event refused unchanged."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tests.core.test_job_stop import drop_last_batches

from adaptdl.core.job import Job
from adaptdl.core.loop.boundary import Preempted
from adaptdl.core.loop.lifecycle import (
    TRANSITIONS,
    Event,
    Lifecycle,
    LifecycleError,
    Replay,
    Stop,
    Train,
    Write,
    machine_of,
)
from adaptdl.core.loop.loader import LoaderHelper
from adaptdl.core.persist.checkpoint import MemoryCheckpointStore
from adaptdl.core.topology import Topology

MACHINES = (Stop, Write, Train, Replay)
KEYWORD = {Stop: "stop", Write: "write", Train: "train", Replay: "replay"}


def in_phase(phase):
    since = 0.0 if phase is Stop.WAITING else None
    return Lifecycle(**{KEYWORD[type(phase)]: phase}, waiting_since=since)


def test_a_waiting_stop_has_a_deadline_and_only_it():
    with pytest.raises(ValueError, match="waiting_since must be given exactly when"):
        Lifecycle(stop=Stop.WAITING)
    with pytest.raises(ValueError, match="waiting_since must be given exactly when"):
        Lifecycle(waiting_since=1.0)


def fire(life, event):
    return life.fire(event, now=1.0) if event is Event.WAIT else life.fire(event)


ALL_PAIRS = [(event, phase) for event in Event for phase in machine_of(event)]


@pytest.mark.parametrize(("event", "phase"), ALL_PAIRS, ids=lambda v: v.name)
def test_every_event_in_every_phase_moves_as_the_table_says_or_changes_nothing(event, phase):
    life = in_phase(phase)
    before = (life.phases, life.stop_code, life.waiting_since)
    expected = TRANSITIONS[event].get(phase)
    if expected is None:
        with pytest.raises(LifecycleError, match=f"{event.name} cannot come in phase"):
            fire(life, event)
        assert (life.phases, life.stop_code, life.waiting_since) == before
        return
    assert fire(life, event) is expected
    others = [p for p in before[0] if type(p) is not type(phase)]
    assert [p for p in life.phases if type(p) is not type(phase)] == others
    assert (life.waiting_since is not None) == (life.stop is Stop.WAITING)


def test_each_event_moves_one_machine_and_the_table_names_only_its_phases():
    for event, table in TRANSITIONS.items():
        machine = machine_of(event)
        assert all(type(a) is machine and type(b) is machine for a, b in table.items())
    assert set(TRANSITIONS) == set(Event)


def test_every_phase_is_reachable_from_a_new_job_and_stopped_is_final():
    reached = {p for p in (Stop.NONE, Write.IDLE, Train.BEFORE, Replay.LIVE, Replay.REPLAYING)}
    frontier = list(reached)
    while frontier:
        phase = frontier.pop()
        for table in TRANSITIONS.values():
            after = table.get(phase)
            if after is not None and after not in reached:
                reached.add(after)
                frontier.append(after)
    assert reached == {p for machine in MACHINES for p in machine}
    leaving = {
        after for table in TRANSITIONS.values() for p, after in table.items() if p is Stop.STOPPED
    }
    assert leaving == {Stop.STOPPED}


def test_a_signal_never_raises_whatever_the_stop_phase():
    for phase in Stop:
        life = in_phase(phase)
        life.fire(Event.REQUEST, code=130)
        assert life.stop is (Stop.REQUESTED if phase is Stop.NONE else phase)


@given(st.lists(st.tuples(st.sampled_from(list(Event)), st.integers(128, 160)), max_size=40))
def test_any_sequence_keeps_the_first_code_and_a_deadline_only_while_waiting(events):
    life = Lifecycle()
    first_code = None
    for clock, (event, code) in enumerate(events):
        was = life.phases
        try:
            life.fire(event, code=code, now=float(clock))
        except LifecycleError:
            assert life.phases == was
            continue
        if event is Event.REQUEST and was[0] is Stop.NONE:
            first_code = code
        assert (life.waiting_since is not None) == (life.stop is Stop.WAITING)
    assert life.stop_code == (143 if first_code is None else first_code)


# -- the job drives the machine ------------------------------------------------------------


def test_a_stop_in_a_loop_goes_requested_stopping_stopped_and_a_late_signal_is_ignored():
    store = MemoryCheckpointStore()
    job = Job(Topology(0, 1), store=store)
    loader = LoaderHelper(job, batch_size=2)
    seen = []
    with pytest.raises(Preempted):
        for _ in job.remaining_epochs_until(2):
            for _ in loader.iterate(8, drop_last_batches(8, 0, 1)):
                job.request_stop()
                seen.append(job.lifecycle.phases)
    assert seen[0] == (Stop.REQUESTED, Write.IDLE, Train.TRAINING, Replay.LIVE)
    assert job.lifecycle.phases == (Stop.STOPPED, Write.IDLE, Train.TRAINING, Replay.LIVE)
    job.request_stop()  # a second SIGTERM while the process exits
    assert job.stop_outside_loop() is None
    assert job.lifecycle.stop is Stop.STOPPED and store.labels()


def test_a_finished_epoch_loop_is_trained_and_a_stop_there_exits_without_writing():
    store = MemoryCheckpointStore()
    job = Job(Topology(0, 1), store=store)
    loader = LoaderHelper(job, batch_size=2)
    for _ in job.remaining_epochs_until(1):
        list(loader.iterate(4, drop_last_batches(4, 0, 1)))
    assert job.lifecycle.phases == (Stop.NONE, Write.IDLE, Train.TRAINED, Replay.LIVE)
    written = len(store.labels())
    job.request_stop()
    with pytest.raises(Preempted):
        job.stop_outside_loop()
    assert job.lifecycle.stop is Stop.STOPPED and len(store.labels()) == written


def test_a_restart_inside_a_loop_replays_until_a_loop_resumes():
    store = MemoryCheckpointStore()
    job = Job(Topology(0, 1), store=store)
    loader = LoaderHelper(job, batch_size=2)
    with pytest.raises(Preempted):
        for _ in job.remaining_epochs_until(2):
            for _ in loader.iterate(8, drop_last_batches(8, 0, 1)):
                job.request_stop()
    again = Job(Topology(0, 1), store=store)
    assert again.lifecycle.replay is Replay.REPLAYING and again.replaying
    again.loop_resumes()
    assert again.lifecycle.replay is Replay.LIVE and not again.replaying


def test_a_stop_outside_a_loop_without_a_request_is_a_caller_error():
    job = Job(Topology(0, 1))
    with pytest.raises(LifecycleError, match=r"ACT_ALONE cannot come in phase Stop\.NONE"):
        job.stop_outside_loop()
    assert job.lifecycle.stop is Stop.NONE
