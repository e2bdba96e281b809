"""Replay after SIGKILL is counted exactly; a loop never resumes over a different dataset.

Core objects only (a memory store and a journal file), killed by abandoning them
at the instants the fault suite kills real processes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptdl.core.job import Job
from adaptdl.core.loop.boundary import CheckpointPolicy
from adaptdl.core.loop.loader import LoaderHelper
from adaptdl.core.persist.checkpoint import CheckpointError, CheckpointStore, MemoryCheckpointStore
from adaptdl.core.persist.journal import Journal, Mark

N = 20
BATCH = 4


class Run:
    """One run of a one-replica job over N samples, checkpointing every ``every`` steps."""

    def __init__(self, store: MemoryCheckpointStore | CheckpointStore, path: Path, every: int):
        self.job = Job(
            store=store,
            journal=Journal(path),
            checkpoint_policy=CheckpointPolicy(every_seconds=None, every_steps=every),
        )
        self.loader = LoaderHelper(self.job, BATCH)
        self.taken: list[int] = []  # every sample the training loop received

    def batches(self, epoch: int, index: int, local_bsz: int) -> Iterator[list[int]]:
        for lo in range(index, N, local_bsz):
            yield list(range(lo, min(lo + local_bsz, N)))

    def train(self, epochs: int, die_after: int | None = None) -> None:
        """Train; with ``die_after``, stop dead after taking that many batches (SIGKILL)."""
        taken = 0
        for _ in self.job.epoch.remaining_epochs_until(epochs):
            for batch in self.loader.iterate(N, self.batches):
                self.taken.extend(batch)
                taken += 1
                if taken == die_after:
                    self.job.journal.close()  # type: ignore[union-attr]
                    return


@settings(max_examples=60, deadline=None)
@given(
    every=st.integers(1, 6),
    deaths=st.lists(st.integers(1, 9), min_size=1, max_size=4),
)
def test_replays_counted_equal_samples_taken_twice_through_repeated_crashes(
    tmp_path_factory: pytest.TempPathFactory, every: int, deaths: list[int]
) -> None:
    tmp = tmp_path_factory.mktemp("replay")
    store = MemoryCheckpointStore()
    taken: list[int] = []
    for die_after in [*deaths, None]:
        run = Run(store, tmp / "journal", every)
        run.train(epochs=2, die_after=die_after)
        taken.extend(run.taken)
    # Every sample of both epochs taken at least once; the surplus is what was counted.
    assert set(taken) == set(range(N))
    assert len(taken) - 2 * N == run.job.replayed_samples


def test_a_second_crash_before_a_checkpoint_keeps_the_first_replay(tmp_path: Path) -> None:
    store = MemoryCheckpointStore()
    journal = tmp_path / "journal"
    first = Run(store, journal, every=3)
    first.train(epochs=1, die_after=5)  # checkpoint after 3 steps; 2 batches replayed
    second = Run(store, journal, every=3)
    assert second.job.replayed_samples == 2 * BATCH
    second.train(epochs=1, die_after=1)  # dies before its first checkpoint
    third = Run(store, journal, every=3)
    assert third.job.replayed_samples == 3 * BATCH


def test_a_batch_taken_but_not_trained_on_counts_as_replayed(tmp_path: Path) -> None:
    store = MemoryCheckpointStore()
    run = Run(store, tmp_path / "journal", every=1)
    run.train(epochs=1, die_after=3)  # killed while training on the third batch
    again = Run(store, tmp_path / "journal", every=1)
    assert again.job.state.samples_consumed == 2 * BATCH  # checkpointed after two steps
    assert again.job.replayed_samples == BATCH


def test_a_graceful_stop_replays_nothing(tmp_path: Path) -> None:
    store = MemoryCheckpointStore()
    run = Run(store, tmp_path / "journal", every=100)
    with pytest.raises(SystemExit):
        for _ in run.job.epoch.remaining_epochs_until(1):
            for _batch in run.loader.iterate(N, run.batches):
                run.job.request_stop()
    assert Run(store, tmp_path / "journal", every=100).job.replayed_samples == 0


def test_a_journal_of_the_previous_format_still_counts(tmp_path: Path) -> None:
    (tmp_path / "journal").write_bytes(b'{"samples": 12}'.ljust(64))
    assert Journal(tmp_path / "journal").read() == Mark(samples=12, replayed=0)
    assert Job(journal=Journal(tmp_path / "journal")).replayed_samples == 12


# -- the dataset a loop resumes over ------------------------------------------------------


def one_pass(n: int):
    """The batches callback of a dataset of ``n``: one dummy batch per step to the pass end."""
    return lambda epoch, index, local_bsz: iter([[0]] * -(-(n - index) // local_bsz))


def stopped_mid_loop(store: MemoryCheckpointStore | CheckpointStore) -> None:
    job = Job(store=store)
    loader = LoaderHelper(job, BATCH)
    with pytest.raises(SystemExit):
        for _ in job.epoch.remaining_epochs_until(1):
            for _batch in loader.iterate(N, one_pass(N)):
                job.request_stop()


def test_the_dataset_length_is_saved_with_the_loop() -> None:
    store = MemoryCheckpointStore()
    stopped_mid_loop(store)
    job = Job(store=store)
    loader = LoaderHelper(job, BATCH)
    assert loader._state.dataset_len == N and loader._state.current_index == 2 * BATCH


@pytest.mark.parametrize(
    ("store_of", "where"),
    [
        (lambda tmp: MemoryCheckpointStore(), "remove the checkpoint store"),
        (lambda tmp: CheckpointStore(tmp / "ckpt"), "remove '{tmp}/ckpt'"),
    ],
)
def test_resuming_a_loop_over_another_dataset_length_is_refused(
    tmp_path: Path, store_of, where: str
) -> None:
    store = store_of(tmp_path)
    stopped_mid_loop(store)
    job = Job(store=store)
    loader = LoaderHelper(job, BATCH)
    with pytest.raises(CheckpointError) as info:
        for _ in job.epoch.remaining_epochs_until(1):
            next(iter(loader.iterate(N - 1, lambda e, i, b: iter([[0]]))))
    message = str(info.value)
    assert f"dataset of {N} samples" in message and f"now has {N - 1}" in message
    assert "dataset changed since the checkpoint" in message
    assert where.format(tmp=tmp_path) in message


def test_another_dataset_length_between_loops_is_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = MemoryCheckpointStore()
    job = Job(store=store)
    loader = LoaderHelper(job, BATCH)
    for _ in job.epoch.remaining_epochs_until(1):
        for _batch in loader.iterate(N, one_pass(N)):
            pass
    job.checkpoint()  # between loops: nothing of the finished loop is resumed
    job = Job(store=store)
    loader = LoaderHelper(job, BATCH)
    with caplog.at_level(logging.WARNING, logger="adaptdl.core.loop.loader"):
        for _ in job.epoch.remaining_epochs_until(2):
            assert len(list(loader.iterate(N + 8, one_pass(N + 8)))) == 7
    assert "had 20 samples in the previous loop and has 28 now" in caplog.text


def test_a_checkpoint_without_the_dataset_length_still_resumes() -> None:
    store = MemoryCheckpointStore()
    stopped_mid_loop(store)
    label = store.latest_label()
    assert label is not None
    # A loader state written before dataset_len was recorded.
    checkpoint = store.load()
    assert checkpoint is not None
    entries = dict(checkpoint.entries)
    name = "adaptdl-dataloader-0"
    entries[name] = entries[name].replace(f'"dataset_len":{N},'.encode(), b"")
    assert b"dataset_len" not in entries[name]
    store.save(entries)
    job = Job(store=store)
    loader = LoaderHelper(job, BATCH)
    for _ in job.epoch.remaining_epochs_until(1):
        assert len(list(loader.iterate(N - 1, one_pass(N - 1)))) == 3
