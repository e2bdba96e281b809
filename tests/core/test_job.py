"""The job: states restored at registration, checkpoints, stop and periodic checkpoints."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from tests.fakes import ManualClock
from tests.threadcollective import run_replicas

from adaptdl.core.collective import LocalCollective
from adaptdl.core.config import JobConfig
from adaptdl.core.job import Job
from adaptdl.core.loop.boundary import AgreementCadence, Boundary, CheckpointPolicy, Preempted
from adaptdl.core.loop.epoch import EpochState
from adaptdl.core.persist.checkpoint import CheckpointError, MemoryCheckpointStore
from adaptdl.core.persist.journal import Journal, Mark
from adaptdl.core.topology import Topology


def test_states_restore_when_they_register():
    store = MemoryCheckpointStore()
    job = Job(store=store)
    extra = EpochState("extra")
    job.register(extra)
    extra.finished_epochs = 7
    list(job.epoch.remaining_epochs_until(3))
    job.checkpoint()
    again = Job(store=store)
    assert again.restored_from is not None
    assert again.epoch.finished_epochs == 3
    later = EpochState("extra")
    again.register(later)
    assert later.finished_epochs == 7


def test_duplicate_state_name_raises():
    job = Job()
    with pytest.raises(ValueError, match="already registered"):
        job.register(EpochState())


def test_unique_names_follow_creation_order():
    job = Job()
    assert [job.unique_name("x") for _ in range(3)] == ["x-0", "x-1", "x-2"]
    assert job.unique_name("y") == "y-0"


def test_collective_and_topology_must_agree():
    with pytest.raises(ValueError, match="num_replicas=2"):
        Job(Topology(rank=0, num_replicas=2), collective=LocalCollective())


def test_stop_is_acted_on_one_boundary_later_on_every_replica():
    """Agreeing at every boundary, a stop is acted on at the next one."""
    store = MemoryCheckpointStore()

    def replica(collective):
        job = Job(
            Topology(rank=collective.rank, num_replicas=3),
            collective=collective,
            store=store,
            agreement_cadence=AgreementCadence(max_every=1),
        )
        for step in range(10):
            if step == 4 and collective.rank == 2:
                job.request_stop()
            try:
                job.step_boundary()
            except Preempted as exc:
                assert exc.code == 143
                return step
        return None

    assert run_replicas(3, replica) == [5, 5, 5]
    assert store.latest_label() is not None


@given(every=st.integers(1, 7), steps=st.integers(1, 40))
def test_periodic_checkpoint_by_steps(every, steps):
    store = MemoryCheckpointStore(keep=100)
    job = Job(
        store=store, checkpoint_policy=CheckpointPolicy(every_seconds=None, every_steps=every)
    )
    for _ in range(steps):
        job.step_boundary()
    # Written at every boundary k that is a multiple of `every`; found due one
    # boundary earlier, so never at the very first boundary.
    expected = len([k for k in range(2, steps + 1) if k % every == 0])
    assert job.checkpoints_written == expected
    assert len(store.labels()) == expected


def test_periodic_checkpoint_by_time():
    clock = ManualClock()
    store = MemoryCheckpointStore()
    job = Job(store=store, clock=clock, checkpoint_policy=CheckpointPolicy(every_seconds=30.0))
    for _ in range(5):
        clock.now += 10.0
        job.step_boundary()
    assert job.checkpoints_written == 1


@given(
    every=st.none() | st.integers(1, 7),
    seconds=st.none() | st.sampled_from([4.0, 7.0, 25.0, 0.3, 0.7]),
    tick=st.sampled_from([3.0, 0.1, 0.3]),
    steps=st.integers(1, 40),
)
# `now >= last + s` rounds otherwise than `due`'s `now - last >= s` (0.3-second ticks
# reach 0.8999999999999999 where 0.6 + 0.3 is 0.9): a job must not reformulate it.
@example(every=None, seconds=0.3, tick=0.3, steps=6)
def test_a_policy_assigned_later_counts_as_its_due_says(every, seconds, tick, steps):
    # A policy set after construction checkpoints exactly where its `due` says,
    # counting steps and seconds from the last checkpoint.
    clock = ManualClock()
    job = Job(store=MemoryCheckpointStore(keep=100), clock=clock)
    policy = CheckpointPolicy(every_seconds=seconds, every_steps=every)
    job.checkpoint_policy = policy
    expected, since, last, found = 0, 0, clock.now, False
    for _ in range(steps):
        clock.now += tick
        since += 1
        if found:  # found due at the previous boundary: written at this one
            expected, since, last = expected + 1, 0, clock.now
        found = policy.due(since + 1, clock.now - last)
        job.step_boundary()
        assert job.checkpoints_written == expected


def test_a_policy_without_thresholds_is_never_due():
    assert not CheckpointPolicy(every_seconds=None, every_steps=None).due(10**9, 1e300)
    assert CheckpointPolicy(every_seconds=2.5, every_steps=4).due(4, 0.0)
    assert CheckpointPolicy(every_seconds=2.5, every_steps=4).due(0, 2.5)


def test_periodic_checkpoints_can_be_off():
    clock = ManualClock()
    job = Job(
        store=MemoryCheckpointStore(),
        clock=clock,
        checkpoint_policy=CheckpointPolicy(every_seconds=None, every_steps=None),
    )
    for _ in range(50):
        clock.now += 1e6
        job.step_boundary()
    assert job.checkpoints_written == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"every_seconds": 0.0}, "every_seconds"), ({"every_steps": 0}, "every_steps")],
)
def test_policy_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CheckpointPolicy(**kwargs)


def test_replay_after_crash_is_counted(tmp_path):
    store = MemoryCheckpointStore()
    journal = Journal(tmp_path / "journal")
    job = Job(store=store, journal=journal)
    # What the loader does for each batch: journal it as taken, train, count it.
    record = job.samples_recorder()
    assert record is not None
    record(job.samples_consumed + 40)
    job.count_samples(40)
    job.step_boundary()
    job.checkpoint()
    record(job.samples_consumed + 24)  # the mark now says 64; killed in this step
    journal.close()
    again = Job(store=store, journal=Journal(tmp_path / "journal"))
    assert again.state.samples_consumed == 40
    assert again.replayed_samples == 24


def test_journal_round_trip_and_garbage(tmp_path):
    journal = Journal(tmp_path / "j")
    assert journal.read() is None
    journal.write(Mark(samples=5))
    journal.write(Mark(samples=123456789))
    assert Journal(tmp_path / "j").read() == Mark(samples=123456789)
    (tmp_path / "bad").write_bytes(b"\x00garbage")
    # Damage is an error naming the file (issue 12); only an empty record is no mark.
    with pytest.raises(CheckpointError, match=r"journal .*bad"):
        Journal(tmp_path / "bad").read()


def test_checkpoint_gathers_pending_accumulator_contributions():
    from adaptdl.core.stats.accumulator import Accumulator

    store = MemoryCheckpointStore()

    def before(collective):
        job = Job(
            Topology(rank=collective.rank, num_replicas=3), collective=collective, store=store
        )
        acc = Accumulator(collective)
        job.register(acc)
        acc["loss"] += collective.rank + 1.0  # pending on each replica
        job.checkpoint()

    run_replicas(3, before)

    def after(collective):
        job = Job(
            Topology(rank=collective.rank, num_replicas=2), collective=collective, store=store
        )
        acc = Accumulator(collective)
        job.register(acc)
        with acc.synchronized():
            return acc["loss"]

    assert run_replicas(2, after) == [6.0, 6.0]


def test_policy_from_env():
    assert _policy_from_env({}) == CheckpointPolicy()
    policy = _policy_from_env(
        {"ADAPTDL_CHECKPOINT_INTERVAL": "0", "ADAPTDL_CHECKPOINT_STEPS": "50"}
    )
    assert policy == CheckpointPolicy(every_seconds=None, every_steps=50)
    assert _policy_from_env({"ADAPTDL_CHECKPOINT_INTERVAL": "2.5"}).every_seconds == 2.5


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"ADAPTDL_CHECKPOINT_INTERVAL": "soon"}, "ADAPTDL_CHECKPOINT_INTERVAL"),
        ({"ADAPTDL_CHECKPOINT_INTERVAL": "-1"}, "ADAPTDL_CHECKPOINT_INTERVAL"),
        ({"ADAPTDL_CHECKPOINT_INTERVAL": "nan"}, "ADAPTDL_CHECKPOINT_INTERVAL"),
        ({"ADAPTDL_CHECKPOINT_STEPS": "1.5"}, "ADAPTDL_CHECKPOINT_STEPS"),
        ({"ADAPTDL_CHECKPOINT_STEPS": "-2"}, "ADAPTDL_CHECKPOINT_STEPS"),
    ],
)
def test_policy_env_garbage_names_the_variable(env, variable):
    with pytest.raises(ValueError, match=variable):
        _policy_from_env(env)


def test_boundaries_outside_training_count_no_steps_and_keep_decisions_pending():
    clock = ManualClock()
    store = MemoryCheckpointStore(keep=100)
    job = Job(
        store=store,
        clock=clock,
        checkpoint_policy=CheckpointPolicy(every_seconds=None, every_steps=3),
    )
    clock.now = 100.0
    assert job.step_boundary() == Boundary()  # training: a decision is found due
    for _ in range(10):  # a validation loop: never handed the decision
        assert job.step_boundary(training=False) == Boundary()
    assert job.checkpoints_written == 0
    # The next training boundary carries it, once.
    assert job.step_boundary() == Boundary(redecide=True)
    assert job.step_boundary() == Boundary(checkpoint=True)
    assert job.checkpoints_written == 1  # at the third training step
    clock.now = 1000.0  # a decision would be due now, but only training schedules one
    job.step_boundary(training=False)
    job.step_boundary(training=False)
    assert job.step_boundary() == Boundary()


class CountingCollective(LocalCollective):
    """Counts the reductions started and those whose result was waited for."""

    in_process = False  # no shortcut past allreduce_async: every reduction is counted

    def __init__(self) -> None:
        super().__init__()
        self.started = 0
        self.waited = 0

    def allreduce_async(self, value, op=None):
        future = super().allreduce_async(value, op) if op else super().allreduce_async(value)
        self.started += 1
        outer = self

        class Counted:
            def result(self):
                outer.waited += 1
                return future.result()

        return Counted()


@given(steps=st.integers(0, 12))
def test_drain_leaves_no_reduction_in_flight(steps):
    """A process must not exit with a boundary's reduction in flight (gloo aborts)."""
    collective = CountingCollective()
    job = Job(collective=collective)
    for _ in range(steps):
        job.step_boundary()
    assert collective.started - collective.waited == (1 if steps else 0)
    job.drain()
    job.drain()  # a second drain has nothing to wait for
    assert collective.started == collective.waited
    # Agreements every k-th boundary (fast steps: k > 1 once the first is read).
    every = job.agreement_cadence.max_every
    assert (1 if steps else 0) + (steps - 1) // every <= collective.started <= steps


def _policy_from_env(env):
    return CheckpointPolicy.from_config(JobConfig.from_env(env))


def test_drain_waits_for_what_adapters_keep_in_flight_first():
    """The step statistics' sum was started before the boundary's: it is folded first."""
    calls = []
    collective = CountingCollective()
    job = Job(collective=collective)
    job.on_drain(lambda: calls.append(("steps", collective.waited)))
    job.step_boundary()
    job.drain()
    assert calls == [("steps", 0)]
    assert collective.started == collective.waited == 1


def test_replay_lasts_from_the_restore_to_the_first_loop_that_runs() -> None:
    from adaptdl.core.loop.loader import LoaderHelper

    store = MemoryCheckpointStore()
    job = Job(Topology(), store=store)
    assert not job.replaying
    first, second = LoaderHelper(job, 2), LoaderHelper(job, 2)
    with pytest.raises(Preempted):
        for _ in job.epoch.remaining_epochs_until(1):
            list(first.iterate(4, lambda e, i, b: iter([[0, 1], [2, 3]][i // 2 :])))
            for _batch in second.iterate(4, lambda e, i, b: iter([[0, 1], [2, 3]][i // 2 :])):
                job.request_stop()
    again = Job(Topology(), store=store)
    resumed: list[bool] = []
    again.on_resume(lambda: resumed.append(again.replaying))
    assert again.replaying
    first, second = LoaderHelper(again, 2), LoaderHelper(again, 2)
    for _ in again.epoch.remaining_epochs_until(1):
        assert list(first.iterate(4, lambda e, i, b: iter([]))) == []  # skipped: still replaying
        assert again.replaying and resumed == []
        for _batch in second.iterate(4, lambda e, i, b: iter([[2, 3]])):
            assert not again.replaying
    assert resumed == [False]
    again.on_resume(lambda: resumed.append(True))  # not replaying: never called
    again.loop_resumes()
    assert resumed == [False]


def test_a_checkpoint_outside_loops_is_not_replayed() -> None:
    store = MemoryCheckpointStore()
    Job(Topology(), store=store).checkpoint()
    assert not Job(Topology(), store=store).replaying


def test_progress_is_credited_once_per_step_whatever_the_number_of_commits() -> None:
    job = Job(Topology())
    for step in range(3):
        for _model in range(2):  # a GAN: two optimisers step per batch
            job.metrics.add_progress(0.5, step=step)
        job.metrics.add_progress(0.25)  # no step named: always credited
    assert job.metrics.progress == pytest.approx(3 * 0.75)


def test_a_state_of_a_finished_epoch_leaves_the_checkpoints() -> None:
    class Named:
        def __init__(self, name: str) -> None:
            self.name = name

        def to_bytes(self) -> bytes:
            return b"x"

        def from_bytes(self, data: bytes) -> None:
            pass

    store = MemoryCheckpointStore()
    job = Job(Topology(), store=store)
    for epoch in job.epoch.remaining_epochs_until(3):
        job.register(Named(f"acc-{epoch}"), epoch=epoch)
        job.checkpoint()
        saved = store.load()
        assert saved is not None
        assert sorted(n for n in saved.entries if n.startswith("acc-")) == [f"acc-{epoch}"]
    with pytest.raises(ValueError, match="epoch"):
        job.register(Named("bad"), epoch=-1)


def test_the_job_holds_the_config_it_was_built_from() -> None:
    config = JobConfig(topology=Topology(rank=0, num_replicas=1), job_id="j", stop_wait=3.0)
    job = Job(config=config)
    assert job.config is config
    assert job.topology == config.topology
    # Made without one (the simulator's jobs, tests): the defaults, at its topology.
    assert Job(Topology(num_restarts=2)).config == JobConfig(topology=Topology(num_restarts=2))
    with pytest.raises(ValueError, match=r"disagrees with config\.topology"):
        Job(Topology(num_restarts=1), config=config)
