"""Stopping and finishing a job: exit codes, loop ends, the final checkpoint, missing states,
and a pass that can yield no batch."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from tests.threadcollective import run_replicas

from adaptdl.core.config import JobConfig
from adaptdl.core.decide.batchsize import GoodputDecision, batch_size_query
from adaptdl.core.job import OVERDUE_RETRY_SECONDS, Job
from adaptdl.core.loop.boundary import Preempted
from adaptdl.core.loop.epoch import EpochState
from adaptdl.core.loop.lifecycle import Event
from adaptdl.core.loop.loader import LoaderHelper
from adaptdl.core.order.sampling import Shard
from adaptdl.core.persist.checkpoint import (
    CheckpointError,
    CollectiveState,
    JsonState,
    MemoryCheckpointStore,
    SavableAlone,
)
from adaptdl.core.topology import Topology


def drop_last_batches(n, rank, replicas):
    """A DataLoader over this replica's share with drop_last=True: short batches dropped."""

    passes = iter(range(10_000))

    def batches(epoch, index, local_bsz):
        assert next(passes, None) is not None, "the loop never ends"
        shard = Shard(n, index, replicas, rank, epoch=epoch)
        for lo in range(0, shard.count - local_bsz + 1, local_bsz):
            yield shard.indices(lo, lo + local_bsz).tolist()

    return batches


# -- a state missing from the checkpoint ------------------------------------------------


def saved_store() -> MemoryCheckpointStore:
    store = MemoryCheckpointStore()
    Job(store=store).checkpoint()
    return store


def test_a_state_missing_from_the_checkpoint_is_an_error_naming_it_and_the_checkpoint():
    job = Job(store=saved_store())
    with pytest.raises(CheckpointError) as info:
        job.register(EpochState("adaptdl-dataparallel-0"))
    message = str(info.value)
    assert "'adaptdl-dataparallel-0'" in message and "ckpt-000001" in message, message
    assert "ADAPTDL_ALLOW_MISSING_STATE" in message, message
    # Not registered: a retry with the right name still works.
    assert "adaptdl-dataparallel-0" not in {s.name for s in job.states()}


@pytest.mark.parametrize("allowed", [{"extra"}, {"*"}, {"other", "extra"}])
def test_an_allowed_missing_state_starts_fresh(allowed):
    job = Job(store=saved_store(), allow_missing_state=allowed)
    state = EpochState("extra")
    job.register(state)
    assert state.finished_epochs == 0


def test_a_registration_may_accept_a_fresh_start():
    job = Job(store=saved_store(), allow_missing_state={"something-else"})
    with pytest.raises(CheckpointError, match="'extra'"):
        job.register(EpochState("extra"))
    job.register(EpochState("extra"), allow_missing=True)


def test_a_fresh_job_accepts_any_state():
    Job(store=MemoryCheckpointStore()).register(EpochState("extra"))


@pytest.mark.parametrize(
    ("raw", "names"),
    [("", set()), ("a", {"a"}), (" a , b ", {"a", "b"}), ("*", {"*"})],
)
def test_allow_missing_state_is_read_from_the_environment(raw, names):
    config = JobConfig.from_env({"ADAPTDL_ALLOW_MISSING_STATE": raw})
    assert config.allow_missing_state == names


@pytest.mark.parametrize("raw", ["a,,b", ",", "a,"])
def test_an_empty_name_in_allow_missing_state_is_refused(raw):
    with pytest.raises(ValueError, match="ADAPTDL_ALLOW_MISSING_STATE"):
        JobConfig.from_env({"ADAPTDL_ALLOW_MISSING_STATE": raw})


# -- exit codes and the end of a loop ---------------------------------------------------


def test_the_first_stop_requests_code_is_the_exit_status():
    job = Job(store=MemoryCheckpointStore())
    job.request_stop(130)
    job.request_stop(143)
    job.step_boundary()
    with pytest.raises(Preempted) as stopped:
        job.step_boundary()
    assert stopped.value.code == 130


def test_a_stop_after_the_last_boundary_checkpoints_at_the_loop_end_on_every_replica():
    store = MemoryCheckpointStore()

    def replica(collective):
        job = Job(Topology(collective.rank, 2), collective=collective, store=store)
        loader = LoaderHelper(job, batch_size=4)
        for _ in job.remaining_epochs_until(2):
            for step, _ in enumerate(loader.iterate(8, drop_last_batches(8, collective.rank, 2))):
                if step == 1 and collective.rank == 1:  # the loop's last batch
                    job.request_stop()
        return job.epoch.finished_epochs

    with pytest.raises(Preempted):
        run_replicas(2, replica)
    assert store.labels() == ["ckpt-000001"]
    again = Job(store=store)
    loader = LoaderHelper(again, batch_size=4)
    for _ in again.remaining_epochs_until(1):
        assert list(loader.iterate(8, drop_last_batches(8, 0, 1))) == []  # the loop had ended


# -- the final checkpoint ---------------------------------------------------------------


def test_a_finished_epoch_loop_writes_a_final_checkpoint_and_a_relaunch_trains_nothing():
    store = MemoryCheckpointStore()
    job = Job(store=store)
    loader = LoaderHelper(job, batch_size=2)
    for _ in job.remaining_epochs_until(2):
        list(loader.iterate(4, drop_last_batches(4, 0, 1)))
    assert store.load().metadata["finished_epochs"] == 2
    again = Job(store=store)
    LoaderHelper(again, batch_size=2)
    assert list(again.remaining_epochs_until(2)) == []
    assert len(store.labels()) == 1  # nothing ran: nothing written


def test_a_stop_during_the_final_checkpoint_exits_after_it():
    store = MemoryCheckpointStore()
    job = Job(store=store)
    epochs = job.remaining_epochs_until(1)
    next(epochs)
    job.request_stop()
    with pytest.raises(Preempted):
        next(epochs)
    assert store.load().metadata["finished_epochs"] == 1


# -- a stop outside any loop ------------------------------------------------------------


def test_a_stop_between_loops_checkpoints_one_replica_and_exits():
    store = MemoryCheckpointStore()
    job = Job(store=store)
    loader = LoaderHelper(job, batch_size=2)
    with pytest.raises(Preempted):
        for _ in job.remaining_epochs_until(3):
            list(loader.iterate(4, drop_last_batches(4, 0, 1)))
            job.request_stop()
            job.stop_outside_loop()  # what the signal handler does outside a loop
    again = Job(store=store)
    loader = LoaderHelper(again, batch_size=2)
    seen = []
    for _ in again.remaining_epochs_until(3):
        seen.append(list(loader.iterate(4, drop_last_batches(4, 0, 1))))
    assert [len(batches) for batches in seen] == [0, 2, 2]  # epoch 0's loop is not redone


def stop_two_replicas_between_loops(store, *states):
    """Two replicas, with ``states`` registered, stop after their first epoch's loop
    without waiting for each other (``stop_wait=0``, as when their wait ran out);
    rank 0 acts on the stop first, with rank 1 not taking part."""
    saved = threading.Event()

    def replica(collective):
        job = Job(Topology(collective.rank, 2), collective=collective, store=store, stop_wait=0)
        for state in states:
            job.register(state(job))
        loader = LoaderHelper(job, batch_size=4)
        for _ in job.remaining_epochs_until(2):
            list(loader.iterate(8, drop_last_batches(8, collective.rank, 2)))
            job.request_stop()
            if collective.rank == 0:
                try:
                    job.stop_outside_loop()  # no collective: rank 1 does not take part
                finally:
                    saved.set()
            assert saved.wait(30)
            job.stop_outside_loop()

    with pytest.raises(Preempted):
        run_replicas(2, replica)


def test_a_stop_between_loops_of_several_replicas_is_written_by_rank_0_alone():
    store = MemoryCheckpointStore()
    stop_two_replicas_between_loops(store)
    assert store.load().entries["adaptdl-dataloader-0"]


class Gathered(JsonState):
    """A collective state; ``alone``: one rank 0 can also save by itself."""

    def __init__(self, alone):
        self.name = "gathered"
        self.synced = 0
        if alone:
            self.bytes_alone = lambda: b'{"alone":true}'

    def sync(self):
        self.synced += 1

    def to_json(self):
        return {"synced": self.synced}

    def load_json(self, data):
        pass


@pytest.mark.parametrize("alone", [False, True])
def test_a_stop_between_loops_writes_alone_only_what_rank_0_can_save_alone(alone):
    assert isinstance(Gathered(alone), CollectiveState)
    assert isinstance(Gathered(alone), SavableAlone) == alone
    store = MemoryCheckpointStore()
    stop_two_replicas_between_loops(store, lambda job: Gathered(alone))
    if alone:
        assert store.load().entries["gathered"] == b'{"alone":true}'
    else:  # the state needs every replica: nothing written, the job resumes from before
        assert store.labels() == []


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def stop_rank_0_between_loops(store, *, at_epoch, then=None, epochs=3, loops=1):
    """Two replicas with a collective state; after loop 0 of ``at_epoch`` rank 0 is asked
    to stop (what the signal handler does) and runs ``then(job)``; returns what
    `stop_outside_loop` returned on rank 0 and each replica's exit status."""
    out = {}

    def replica(collective):
        job = Job(Topology(collective.rank, 2), collective=collective, store=store)
        job.register(Gathered(False))
        loader = LoaderHelper(job, batch_size=4)
        try:
            for epoch in job.remaining_epochs_until(epochs):
                for loop in range(loops):
                    list(loader.iterate(8, drop_last_batches(8, collective.rank, 2)))
                    if collective.rank == 0 and (epoch, loop) == (at_epoch, 0):
                        job.request_stop()
                        out["wait"] = job.stop_outside_loop()
                        if then is not None:
                            then(job)
        except Preempted as stopped:
            out[collective.rank] = stopped.code
            raise
        out[collective.rank] = 0

    with pytest.raises(Preempted):
        run_replicas(2, replica)
    # (The first replica to raise aborts the threads' group: the other may not get to.)
    assert set(out) - {"wait"} and set(out.values()) - {out.get("wait")} == {143}, out
    return out


def test_a_stop_between_loops_of_several_replicas_waits_for_the_epoch_loop_to_move_on():
    """Issue 39: rank 0 asked to stop during an evaluation, rank 1 already at the next
    epoch: both checkpoint where the epoch loop moves on, the state of every replica in."""
    store = MemoryCheckpointStore()
    out = stop_rank_0_between_loops(store, at_epoch=0)
    assert out["wait"] == 20.0
    saved = store.load()
    assert saved.metadata["finished_epochs"] == 1
    assert json.loads(saved.entries["gathered"]) == {"synced": 1}  # synchronised together
    again = Job(store=store)
    loader = LoaderHelper(again, batch_size=4)
    seen = [
        list(loader.iterate(8, drop_last_batches(8, 0, 1)))
        for _ in again.remaining_epochs_until(3)
    ]
    assert [len(batches) for batches in seen] == [2, 2]  # epochs 1 and 2, whole


def test_an_agreed_stop_is_every_replicas_own():
    """A replica that got no signal but agreed to stop is stopping as one asked: a peer
    leaving during the checkpoint is then the stop, not a failure (`collective_failed`
    answers `Preempted`), and no deadline of a waiting stop acts after the agreement."""
    store = MemoryCheckpointStore()
    seen = {}

    def replica(collective):
        job = Job(Topology(collective.rank, 2), collective=collective, store=store)
        loader = LoaderHelper(job, batch_size=4)
        try:
            for epoch in job.remaining_epochs_until(3):
                list(loader.iterate(8, drop_last_batches(8, collective.rank, 2)))
                if collective.rank == 0 and epoch == 0:
                    job.request_stop()
                    job.stop_outside_loop()
        except Preempted:
            failed = job.collective_failed(ConnectionError("peer left"))
            seen[collective.rank] = (job.stop_requested, type(failed), job.stop_overdue())
            if collective.rank == 0:
                time.sleep(0.5)  # rank 1 gets to record before the group is torn down
            raise

    with pytest.raises(Preempted):
        run_replicas(2, replica)
    assert seen.get(1) == (True, Preempted, None), seen  # rank 1 got no signal


def test_a_stop_between_the_loops_of_an_epoch_checkpoints_in_the_next_loop():
    store = MemoryCheckpointStore()
    stop_rank_0_between_loops(store, at_epoch=1, loops=2)
    saved = store.load()
    assert saved.metadata["finished_epochs"] == 1
    assert json.loads(saved.entries["adaptdl-job"])["in_loop"] is True


def test_a_stop_during_the_last_evaluation_exits_after_the_final_checkpoint():
    store = MemoryCheckpointStore()
    stop_rank_0_between_loops(store, at_epoch=2)
    assert store.load().metadata["finished_epochs"] == 3
    assert len(store.labels()) == 1


@pytest.mark.parametrize("second", [False, True])
def test_a_stop_whose_wait_ran_out_or_that_came_again_exits_at_once(second, caplog):
    """Rank 0 exits at once (nothing written: the collective state needs rank 1), and
    the log says so and never "checkpointing"."""
    store = MemoryCheckpointStore()

    def then(job):
        if second:
            job.clock = Clock()
            job.lifecycle.waiting_since = 0.0  # it waits since time 0 of the new clock
            job.clock.now = 0.5  # the same stop, delivered twice: it still waits
            assert job.stop_outside_loop() == pytest.approx(19.5)
            job.clock.now = 2.0
            job.stop_outside_loop()
        else:
            job.stop_overdue()

    with caplog.at_level(logging.INFO, logger="adaptdl"):
        out = stop_rank_0_between_loops(store, at_epoch=0, then=then)
    assert out[0] == 143 and store.labels() == []
    lines = [r.getMessage() for r in caplog.records if r.name == "adaptdl.lifecycle"]
    assert not any("checkpointing" in line for line in lines), lines
    (line,) = [line for line in lines if "without a checkpoint" in line]
    assert ("second stop signal" if second else "within 20 s") in line, line
    assert "needs every replica" in line, line


def test_a_stop_at_a_step_boundary_without_a_store_never_says_checkpointing(caplog):
    job = Job()
    loader = LoaderHelper(job, batch_size=2)
    with caplog.at_level(logging.INFO, logger="adaptdl"), pytest.raises(Preempted):
        for _ in job.remaining_epochs_until(1):
            for _ in loader.iterate(8, drop_last_batches(8, 0, 1)):
                job.request_stop()
    lines = [r.getMessage() for r in caplog.records if r.name == "adaptdl.lifecycle"]
    (line,) = [line for line in lines if line.startswith("stop requested")]
    assert "without a checkpoint: no checkpoint path" in line, line


def test_a_stop_overdue_inside_a_loop_or_during_a_checkpoint_is_left_to_them():
    job = Job(Topology(0, 1))
    job.request_stop()
    assert job.stop_overdue() is None  # no stop waits: nothing happens
    job.lifecycle.fire(Event.WAIT, now=0.0)
    loader = LoaderHelper(job, batch_size=2)
    with loader.context():
        assert job.stop_overdue() is None
    job.lifecycle.fire(Event.BEGIN_WRITE)
    assert job.stop_overdue() == OVERDUE_RETRY_SECONDS


def test_a_collective_that_fails_while_stopping_exits_with_the_stop_status():
    job = Job()
    error = RuntimeError("Connection closed by peer")
    assert job.collective_failed(error) is error
    job.request_stop(130)
    stopped = job.collective_failed(error)
    assert isinstance(stopped, Preempted) and stopped.code == 130


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("where", ["before", "between", "after"])
@pytest.mark.parametrize("collective_state", [False, True])
@pytest.mark.parametrize("has_store", [False, True])
def test_the_log_says_checkpointing_exactly_when_a_checkpoint_is_written(
    replicas, where, collective_state, has_store, caplog
):
    """Every stop that acts at once outside a loop: "checkpointing" iff one is written."""
    store = MemoryCheckpointStore() if has_store else None
    first = threading.Event()

    def replica(collective):
        rank = collective.rank
        job = Job(Topology(rank, replicas), collective=collective, store=store, stop_wait=0)
        if collective_state:
            job.register(Gathered(False))
        loader = LoaderHelper(job, batch_size=2 * replicas)

        def stop():
            job.request_stop()
            if rank == 0:  # first, alone: then its peer's exit cannot cut it short
                try:
                    job.stop_outside_loop()
                finally:
                    first.set()
            assert first.wait(30)
            job.stop_outside_loop()

        if where == "before":
            stop()
        for _ in job.remaining_epochs_until(2):
            list(loader.iterate(8, drop_last_batches(8, rank, replicas)))
            if where == "between":
                stop()
        stop()

    with caplog.at_level(logging.INFO, logger="adaptdl"), pytest.raises(Preempted):
        run_replicas(replicas, replica)
    lines = [r.getMessage() for r in caplog.records if r.name == "adaptdl.lifecycle"]
    stops = [line for line in lines if line.startswith("stop requested")]
    assert len(stops) == 1, lines
    expected = where == "between" and has_store and (replicas == 1 or not collective_state)
    assert ("checkpointing" in stops[0]) == expected, stops
    assert ("without a checkpoint" in stops[0]) == (not expected), stops
    if where == "between":
        assert len(store.labels() if store is not None else []) == int(expected)


def test_a_stop_before_any_epoch_writes_nothing():
    store = MemoryCheckpointStore()
    job = Job(store=store)
    job.request_stop(130)
    with pytest.raises(Preempted) as stopped:
        job.stop_outside_loop()
    assert stopped.value.code == 130 and store.labels() == []


# -- a pass that can yield no batch -----------------------------------------------------


@given(
    n=st.integers(1, 40),
    replicas=st.integers(1, 4),
    batch_size=st.integers(1, 64),
    stop_at=st.integers(0, 5),
)
def test_a_loop_yields_a_batch_or_raises_and_a_stop_always_ends_it(
    n, replicas, batch_size, stop_at
):
    """drop_last with a batch larger than a replica's share: ValueError, never an endless loop."""
    store = MemoryCheckpointStore()

    def replica(collective):
        rank = collective.rank
        job = Job(Topology(rank, replicas), collective=collective, store=store)
        loader = LoaderHelper(job, batch_size=batch_size)
        taken = 0
        for _ in job.remaining_epochs_until(1000):
            for _ in loader.iterate(n, drop_last_batches(n, rank, replicas)):
                taken += 1
                if taken == stop_at + 1:
                    job.request_stop()
                # Read at the agreement after the next (agreements every k-th boundary).
                bound = stop_at + 2 * job.agreement_cadence.max_every + 2
                assert taken < bound, "a stop did not end the loop"
        return taken

    try:
        run_replicas(replicas, replica)
    except ValueError as exc:
        local = -(-batch_size // replicas)
        assert local > n // replicas  # raised only when a replica's share holds no batch
        message = str(exc)
        assert "drop_last=True" in message and f"{n} samples" in message, message
        assert f"local batch size {local}" in message, message
        assert f"share of the pass is {n // replicas} samples" in message, message
    except Preempted:
        pass
    else:
        pytest.fail("the loop neither stopped nor raised")


@given(
    n=st.integers(1, 500),
    replicas=st.integers(1, 8),
    batch_size=st.integers(1, 500),
    extra=st.integers(0, 1000),
    accumulation=st.booleans(),
    previous=st.integers(0, 64),
)
def test_the_autoscaler_never_chooses_a_size_whose_pass_yields_nothing(
    n, replicas, batch_size, extra, accumulation, previous
):
    """With a target within the dataset, every replica's micro-batch fits in its share."""
    assume(batch_size <= n and replicas <= n)
    query = batch_size_query(
        1,
        replicas,
        batch_size,
        max_batch_size=batch_size + extra,
        gradient_accumulation=accumulation,
        local_bsz=previous,
        dataset_size=n,
    )
    local, accum = GoodputDecision(lambda: None)(query)
    assert replicas * local * (accum + 1) <= n
