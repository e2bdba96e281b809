"""Restoring a job (issue 12): every replica loads rank 0's checkpoint, fresh starts ignore a
stale journal, and an entry of the wrong shape is a CheckpointError naming it."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.threadcollective import ThreadCollective, run_replicas

from adaptdl.core.collective import encode
from adaptdl.core.job import Job
from adaptdl.core.persist.checkpoint import CheckpointError, CheckpointStore, MemoryCheckpointStore
from adaptdl.core.persist.journal import Journal, Mark
from adaptdl.core.persist.storage import MemoryStorage
from adaptdl.core.topology import Topology


def saved_twice() -> MemoryCheckpointStore:
    store = MemoryCheckpointStore()
    job = Job(store=store)
    job.epoch.finished_epochs = 1
    job.checkpoint()
    job.epoch.finished_epochs = 2
    job.checkpoint()
    return store


def view_without_newest(store: MemoryCheckpointStore) -> MemoryCheckpointStore:
    """What a node with a stale directory listing sees: all but the newest checkpoint."""
    storage = MemoryStorage()
    for label in store.labels()[:-1]:
        files = {"manifest.json": store.storage.read(f"{label}/manifest.json")}
        for i in range(10):
            try:
                files[f"entry-{i:04d}.bin"] = store.storage.read(f"{label}/entry-{i:04d}.bin")
            except FileNotFoundError:
                break
        storage.write_directory(label, files)
    return MemoryCheckpointStore(storage=storage)


def test_every_replica_restores_rank_0s_checkpoint() -> None:
    store = saved_twice()

    def replica(collective: ThreadCollective) -> tuple[str | None, int]:
        job = Job(
            Topology(rank=collective.rank, num_replicas=3), collective=collective, store=store
        )
        return job.restored_from, job.epoch.finished_epochs

    assert run_replicas(3, replica) == [("ckpt-000002", 2)] * 3


def test_a_replica_that_cannot_see_rank_0s_checkpoint_fails_naming_both() -> None:
    store = saved_twice()
    stale = view_without_newest(store)

    def replica(collective: ThreadCollective) -> str | None:
        mine = stale if collective.rank == 1 else store
        job = Job(
            Topology(rank=collective.rank, num_replicas=2), collective=collective, store=mine
        )
        return job.restored_from

    with pytest.raises(
        CheckpointError, match=r"ckpt-000001.*ckpt-000002|ckpt-000002.*ckpt-000001"
    ):
        run_replicas(2, replica, timeout=20)


def test_every_replica_fails_when_one_cannot_see_the_checkpoint() -> None:
    """Not only the replica that is missing it: nobody waits for a peer that died."""
    store = saved_twice()
    stale = view_without_newest(store)
    errors: list[str] = []

    def replica(collective: ThreadCollective) -> None:
        mine = stale if collective.rank == 2 else store
        try:
            Job(Topology(rank=collective.rank, num_replicas=3), collective=collective, store=mine)
        except CheckpointError as exc:
            errors.append(f"{collective.rank}: {exc}")
            return
        errors.append(f"{collective.rank}: no error")

    run_replicas(3, replica, timeout=20)
    assert len(errors) == 3 and all("no error" not in e for e in errors), errors
    assert all("replica 2" in e for e in errors), errors


def test_a_failure_of_rank_0_to_restore_fails_every_replica() -> None:
    store = saved_twice()
    for label in store.labels():
        store.corrupt(label)

    def replica(collective: ThreadCollective) -> str:
        try:
            Job(Topology(rank=collective.rank, num_replicas=2), collective=collective, store=store)
        except CheckpointError as exc:
            return str(exc)
        return "no error"

    messages = run_replicas(2, replica, timeout=20)
    assert all("no usable checkpoint" in m for m in messages), messages


def test_a_fresh_start_ignores_a_stale_journal(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "progress.journal")
    journal.write(Mark(samples=500, replayed=7, checkpoint=3))  # its checkpoints were removed
    journal.close()
    job = Job(
        store=CheckpointStore(tmp_path / "ckpt"), journal=Journal(tmp_path / "progress.journal")
    )
    assert job.restored_from is None
    assert job.replayed_samples == 0
    record = job.samples_recorder()
    assert record is not None
    record(job.samples_consumed + 4)
    assert Journal(tmp_path / "progress.journal").read() == Mark(samples=4, replayed=0)


def test_a_crash_before_the_first_checkpoint_still_counts_its_replays(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "progress.journal")
    journal.write(Mark(samples=12, replayed=0, checkpoint=0))
    journal.close()
    job = Job(
        store=CheckpointStore(tmp_path / "ckpt"), journal=Journal(tmp_path / "progress.journal")
    )
    assert job.replayed_samples == 12


def test_an_entry_of_the_wrong_shape_names_the_checkpoint_and_entry() -> None:
    store = MemoryCheckpointStore()
    job = Job(store=store)
    job.checkpoint()
    label = store.labels()[-1]
    entries = dict(store.load().entries)  # type: ignore[union-attr]
    entries["adaptdl-metrics"] = encode({"gns": [1, 2], "profiler": [3]})
    entries["adaptdl-epoch"] = encode({"finished_epochs": 1})
    store.save(entries)
    with pytest.raises(CheckpointError, match=r"ckpt-000002.*'adaptdl-metrics'"):
        Job(store=store)
    assert label == "ckpt-000001"


def test_loader_state_with_a_list_for_a_mapping_names_the_entry() -> None:
    from adaptdl.core.loop.loaderstate import LoaderState

    store = MemoryCheckpointStore()
    job = Job(store=store)
    state = LoaderState("adaptdl-loader-0")
    job.register(state)
    job.checkpoint()
    entries = dict(store.load().entries)  # type: ignore[union-attr]
    saved = state.to_json()
    saved["last_position"] = [0, 1]
    entries["adaptdl-loader-0"] = encode(saved)
    store.save(entries)
    again = Job(store=store)
    with pytest.raises(CheckpointError, match=r"ckpt-000002.*'adaptdl-loader-0'.*'list'"):
        again.register(LoaderState("adaptdl-loader-0"))
