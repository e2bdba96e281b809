"""The job's lifecycle lines (issue 14): once per job, from rank 0, with what an operator
needs; the global step and the journal's count continue exactly across restarts."""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tests.core.test_loader import shard_batches
from tests.threadcollective import ThreadCollective, run_replicas

from adaptdl.core.decide.batchsize import BatchSizeDecision, FixedSplit
from adaptdl.core.job import Job
from adaptdl.core.loop.boundary import EXIT_CODE_PREEMPTED, Preempted
from adaptdl.core.loop.lifecycle import LOGGER_NAME
from adaptdl.core.loop.loader import LoaderHelper
from adaptdl.core.persist.checkpoint import MemoryCheckpointStore
from adaptdl.core.persist.journal import Journal
from adaptdl.core.persist.storage import MemoryStorage
from adaptdl.core.topology import Topology


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER_NAME]


def train(
    store: MemoryCheckpointStore,
    replicas: int,
    epochs: int,
    *,
    stop_at: int = -1,
    decision: BatchSizeDecision | None = None,
) -> None:
    """``replicas`` threads run ``epochs`` epochs of 16 samples at batch 4 and checkpoint;
    rank 1 asks to stop after ``stop_at`` batches (never when negative). ``decision``:
    the job's batch-size decision (None: core's)."""

    def replica(collective: ThreadCollective) -> None:
        job = Job(
            Topology(rank=collective.rank, num_replicas=replicas),
            collective=collective,
            store=store,
            batch_size_decision=decision,
        )
        loader = LoaderHelper(job, batch_size=4)
        taken = 0
        for _ in job.epoch.remaining_epochs_until(epochs):
            for _batch in loader.iterate(16, shard_batches(16, collective.rank, replicas)):
                taken += 1
                if taken == stop_at and collective.rank == replicas - 1:
                    job.request_stop()
        job.checkpoint()
        job.drain()

    run_replicas(replicas, replica)


def test_lifecycle_lines_are_printed_once_by_rank_0(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="adaptdl")
    store = MemoryCheckpointStore()
    train(store, replicas=2, epochs=1)
    first = lines(caplog)
    assert first[0] == (
        "adaptdl-dataloader-0 batch size 2 local x 1 micro-batch x 2 replicas = 4 per optimiser "
        "step"
    )
    assert first[1].startswith("checkpoint ckpt-000001 written in ")
    assert first[1].endswith(" s between epochs, at step 4") and len(first) == 2
    caplog.clear()
    train(store, replicas=2, epochs=2)
    second = lines(caplog)
    assert second[0] == (
        "resumed from checkpoint ckpt-000001 at epoch 1 on 2 replicas, written by 2 (restart 0)"
    )
    assert sum("checkpoint ckpt-000002 written" in line for line in second) == 1


def test_a_stop_says_so_once_and_where(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="adaptdl")
    store = MemoryCheckpointStore()
    with pytest.raises(Preempted):
        train(store, replicas=2, epochs=1, stop_at=2)
    stops = [line for line in lines(caplog) if line.startswith("stop requested")]
    # Asked after batch 2; agreed at the boundary after it; acted on at the next one.
    assert stops == [
        "stop requested (SIGTERM): checkpointing in epoch 0 at step 3, then exiting with "
        f"status {EXIT_CODE_PREEMPTED}"
    ]
    caplog.clear()
    train(store, replicas=1, epochs=1)
    resumed = lines(caplog)
    assert resumed[0].startswith("resumed from checkpoint ckpt-000001 at epoch 0 on 1 replica,")
    assert resumed[1] == (
        "adaptdl-dataloader-0 resumes epoch 0 at sample index 12 (pass 0 of a 16-sample dataset)"
    )


def test_a_restart_on_other_replicas_says_the_total_changed_and_one_on_the_same_does_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 38: the local size and micro-batches stay (a fixed split), the replicas
    change, and so does the total."""
    caplog.set_level(logging.INFO, logger="adaptdl")
    store = MemoryCheckpointStore()
    split = FixedSplit(2, 0)
    train(store, replicas=2, epochs=1, decision=split)
    caplog.clear()
    train(store, replicas=3, epochs=2, decision=split)
    changed = [line for line in lines(caplog) if " batch size " in line]
    assert changed == [
        "adaptdl-dataloader-0 batch size 2 local x 1 micro-batch x 3 replicas = 6 per optimiser "
        "step"
    ]
    caplog.clear()
    train(store, replicas=3, epochs=3, decision=split)
    assert not [line for line in lines(caplog) if " batch size " in line]


def test_a_raised_level_hides_the_lifecycle(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="adaptdl")
    train(MemoryCheckpointStore(), replicas=1, epochs=1)
    assert lines(caplog) == []


@given(epochs=st.integers(1, 3), more=st.integers(1, 3))
def test_the_global_step_continues_across_restarts(epochs: int, more: int) -> None:
    store = MemoryCheckpointStore()
    train(store, replicas=2, epochs=epochs)
    assert Job(store=store).global_step == 4 * epochs  # 16 samples at 4 a step
    train(store, replicas=1, epochs=epochs + more)
    assert Job(store=store).global_step == 4 * (epochs + more)


def test_a_checkpoint_without_a_step_count_restores_zero() -> None:
    store = MemoryCheckpointStore()
    job = Job(store=store)
    job.state.steps = 5
    job.checkpoint()
    entry = json.loads(store.load().entries["adaptdl-job"])  # type: ignore[union-attr]
    assert entry["steps"] == 5
    entry.pop("steps")
    job.state.load_json(entry)
    assert job.global_step == 0


@given(batch=st.integers(1, 7), n=st.integers(1, 40))
def test_the_journal_holds_every_batch_before_the_loop_sees_it(batch: int, n: int) -> None:
    """The replay count stays exact: each batch is journalled, counted, before it is yielded."""
    journal = Journal(MemoryStorage())
    job = Job(journal=journal)
    loader = LoaderHelper(job, batch_size=batch)
    seen = 0
    for _ in job.epoch.remaining_epochs_until(2):
        for indices in loader.iterate(n, shard_batches(n, 0, 1)):
            seen += len(indices)
            mark = journal.read()
            assert mark is not None and mark.samples == seen
    assert job.samples_consumed == 2 * n


def test_the_stop_line_names_the_signal_its_exit_status_stands_for(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from adaptdl.core.loop import lifecycle

    with caplog.at_level(logging.INFO, logger="adaptdl.lifecycle"):
        lifecycle.stopping(epoch=1, steps=4, exit_code=130)
        lifecycle.stopping(epoch=None, steps=4, exit_code=143)
    assert "stop requested (SIGINT)" in caplog.messages[0]
    assert "stop requested (SIGTERM): checkpointing between epochs" in caplog.messages[1]
