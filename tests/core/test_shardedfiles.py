"""Sharded checkpoint files (issue 15): every replica writes its own files inside the atomic
checkpoint, a restore at another size sees all of them, and a damaged file falls back."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tests.threadcollective import ThreadCollective, run_replicas

from adaptdl.core.job import Job
from adaptdl.core.loop.boundary import Preempted
from adaptdl.core.persist import localfs
from adaptdl.core.persist.checkpoint import CheckpointError
from adaptdl.core.persist.shardedfiles import (
    FILES_ENTRY,
    AsyncFileState,
    FileRecord,
    FileState,
    ShardedCheckpointStore,
    StagedFiles,
    decode_listing,
    encode_listing,
    shares,
)
from adaptdl.core.topology import Topology


class Shards:
    """A FileState: a list of numbers, each replica writing the slice it owns."""

    name = "shards"

    def __init__(self, rank: int, replicas: int, values: list[int]) -> None:
        self.rank, self.replicas, self.values = rank, replicas, values
        self.restored: list[int] | None = None

    def to_bytes(self) -> bytes:
        return json.dumps({"length": len(self.values)}).encode()

    def from_bytes(self, data: bytes) -> None:
        self.length = json.loads(data)["length"]

    def write_files(self, directory: StagedFiles) -> list[str]:
        mine = self.values[self.rank :: self.replicas]
        name = f"part-{self.rank}-of-{self.replicas}.json"
        with directory.create(name) as file:
            file.write(json.dumps([self.rank, self.replicas, mine]).encode())
        return [name]

    def read_files(self, directory: Path) -> None:
        out = [0] * self.length
        for path in directory.iterdir():
            rank, replicas, part = json.loads(path.read_text())
            out[rank::replicas] = part
        self.restored = out


def run(tmp_path: Path, replicas: int, values: list[int], saves: int = 1) -> list[Any]:
    def replica(collective: ThreadCollective) -> list[int] | None:
        store = ShardedCheckpointStore(tmp_path, job_id="j")
        job = Job(
            Topology(rank=collective.rank, num_replicas=replicas),
            collective=collective,
            store=store,
        )
        state = Shards(collective.rank, replicas, values)
        job.register(state)
        for _ in range(saves):
            job.checkpoint()
        return state.restored

    return run_replicas(replicas, replica, timeout=30)


def test_every_replica_writes_its_own_files_into_one_checkpoint(tmp_path: Path) -> None:
    assert isinstance(Shards(0, 1, []), FileState)
    run(tmp_path, 3, list(range(10)))
    files = sorted(os.listdir(tmp_path / "ckpt-000001" / "shards"))
    assert files == [f"part-{r}-of-3.json" for r in range(3)]
    listing = decode_listing(
        ShardedCheckpointStore(tmp_path, job_id="j").load().entries[FILES_ENTRY]  # type: ignore[union-attr]
    )
    assert sorted(listing["shards"]) == files
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]  # staging renamed


def test_a_restore_at_another_size_sees_every_replicas_files(tmp_path: Path) -> None:
    values = list(range(11))
    run(tmp_path, 3, values)
    assert run(tmp_path, 2, []) == [values, values]


def test_debris_under_the_next_name_moves_the_files_to_the_name_after(tmp_path: Path) -> None:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "ckpt-000001").write_text("not a checkpoint")
    run(tmp_path, 2, [1, 2, 3])
    assert sorted(os.listdir(tmp_path / "ckpt-000002" / "shards")) == [
        "part-0-of-2.json",
        "part-1-of-2.json",
    ]
    assert run(tmp_path, 1, []) == [[1, 2, 3]]


def test_two_checkpoints_are_kept(tmp_path: Path) -> None:
    run(tmp_path, 2, [1, 2, 3], saves=3)
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("ckpt-")) == [
        "ckpt-000002",
        "ckpt-000003",
    ]


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove", "symlink"])
def test_a_damaged_file_falls_back_to_the_older_checkpoint(tmp_path: Path, damage: str) -> None:
    run(tmp_path, 2, [1, 2, 3])
    run(tmp_path, 2, [4, 5, 6])  # resumes (restored [1, 2, 3]) and saves ckpt-000002
    victim = tmp_path / "ckpt-000002" / "shards" / "part-1-of-2.json"
    if damage == "flip":
        data = victim.read_bytes()
        victim.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:-1])
    elif damage == "remove":
        victim.unlink()
    else:
        target = tmp_path / "elsewhere"
        target.write_bytes(victim.read_bytes())
        victim.unlink()
        victim.symlink_to(target)
    store = ShardedCheckpointStore(tmp_path, job_id="j")
    checkpoint = store.load()
    assert checkpoint is not None and checkpoint.label == "ckpt-000001"
    with pytest.raises(CheckpointError, match=r"part-1-of-2\.json"):
        store.load_label("ckpt-000002")


def test_a_file_state_without_a_checkpoint_directory_is_refused() -> None:
    from adaptdl.core.persist.checkpoint import MemoryCheckpointStore

    job = Job(store=MemoryCheckpointStore())
    job.register(Shards(0, 1, [1]))
    with pytest.raises(CheckpointError, match=r"'shards'.*ShardedCheckpointStore"):
        job.checkpoint()


names = st.text(alphabet="abc_.-0", min_size=1, max_size=8).filter(lambda n: n not in (".", ".."))
hexdigits = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)
records = st.builds(FileRecord, st.integers(0, 2**40), hexdigits)


@given(st.dictionaries(names, st.dictionaries(names, records, max_size=3), max_size=3))
def test_listing_round_trips(listing: dict[str, dict[str, FileRecord]]) -> None:
    assert decode_listing(encode_listing(listing)) == listing


@pytest.mark.parametrize("bad", ["..", ".", "a/b", "/abs", ""])
def test_a_listing_naming_a_path_outside_its_directory_is_refused(bad: str) -> None:
    data = json.dumps({"schema": "adaptdl.files/1", "files": {"s": {bad: [1, "0" * 64]}}}).encode()
    with pytest.raises(ValueError, match="file name"):
        decode_listing(data)


# --------------------------------------------------------------------- in the background


class Writes:
    """What the replicas of `BackgroundShards` share: held writes, gathered records."""

    def __init__(self, replicas: int, fail: bool = False) -> None:
        self.replicas, self.fail = replicas, fail
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.records: dict[str, FileRecord] = {}
        self.done = 0
        self.coordinator: Future[Mapping[str, FileRecord] | None] | None = None


class BackgroundShards(Shards):
    """`Shards` written on a thread once ``writes.release`` is set (an AsyncFileState)."""

    def __init__(self, rank: int, replicas: int, values: list[int], writes: Writes) -> None:
        super().__init__(rank, replicas, values)
        self.writes = writes

    def start_files(self, directory: StagedFiles) -> Future[Mapping[str, FileRecord] | None]:
        writes, out = self.writes, Future[Mapping[str, FileRecord] | None]()
        if self.rank == 0:
            writes.coordinator = out
        values = list(self.values)  # fixed now, written later

        def write() -> None:
            writes.release.wait()
            self.values = values
            name = self.write_files(directory)[0]
            with writes.lock:
                writes.records[name] = directory.record(name)
                writes.done += 1
                last = writes.done == writes.replicas
            if self.rank != 0:
                out.set_result(None)
            if last:
                assert writes.coordinator is not None
                if writes.fail:
                    writes.coordinator.set_exception(OSError("disk full"))
                else:
                    writes.coordinator.set_result(dict(writes.records))

        threading.Thread(target=write, daemon=True).start()
        return out


def background_run(tmp_path: Path, values: list[int], writes: Writes) -> list[Any]:
    def replica(collective: ThreadCollective) -> Any:
        store = ShardedCheckpointStore(tmp_path, job_id="j")
        job = Job(Topology(collective.rank, writes.replicas), collective=collective, store=store)
        state = BackgroundShards(collective.rank, writes.replicas, values, writes)
        job.register(state)
        job.checkpoint()
        state.values = [-1]  # training goes on: the checkpoint keeps what it copied
        seen = store.labels() if collective.rank == 0 else None
        collective.barrier()
        if collective.rank == 0:
            writes.release.set()
        try:
            store.wait()
        except CheckpointError as exc:
            return seen, str(exc)
        return seen, store.pending

    return run_replicas(writes.replicas, replica, timeout=30)


def test_a_checkpoint_written_in_the_background_appears_once_every_replica_wrote(
    tmp_path: Path,
) -> None:
    assert isinstance(BackgroundShards(0, 1, [], Writes(1)), AsyncFileState)
    run(tmp_path, 2, [9, 9, 9])  # ckpt-000001
    results = background_run(tmp_path, list(range(7)), Writes(2))
    assert results[0] == (["ckpt-000001"], False)  # not visible while being written
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("ckpt-")) == [
        "ckpt-000001",
        "ckpt-000002",
    ]
    assert run(tmp_path, 3, []) == [list(range(7))] * 3


def test_a_failed_background_write_leaves_the_previous_checkpoint_newest(
    tmp_path: Path,
) -> None:
    run(tmp_path, 2, [9, 9, 9])
    results = background_run(tmp_path, list(range(7)), Writes(2, fail=True))
    assert "disk full" in results[0][1] and "previous checkpoint" in results[0][1]
    assert ShardedCheckpointStore(tmp_path, job_id="j").latest_label() == "ckpt-000001"
    assert run(tmp_path, 1, []) == [[9, 9, 9]]


def test_a_stop_waits_for_the_checkpoint_being_written(tmp_path: Path) -> None:
    writes = Writes(1)
    store = ShardedCheckpointStore(tmp_path, job_id="j")
    job = Job(store=store)
    job.register(BackgroundShards(0, 1, [1, 2], writes))
    job.epoch.current_epoch = 0  # inside an epoch, between loops
    threading.Timer(0.2, writes.release.set).start()
    job.request_stop()
    with pytest.raises(Preempted):
        job.stop_outside_loop()
    assert not store.pending and store.latest_label() == "ckpt-000001"


# --------------------------------------------------------------------- checked together


def test_each_file_is_checked_by_one_replica_and_damage_falls_back_on_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run(tmp_path, 3, [1, 2, 3])
    run(tmp_path, 3, [4, 5, 6])  # restored [1, 2, 3], saved ckpt-000002
    checked: list[tuple[str, str]] = []
    original = localfs.file_record

    def counted(path: Path, limit: int | None = None) -> FileRecord:
        checked.append((threading.current_thread().name, f"{path.parent.parent.name}/{path.name}"))
        return original(path, limit)

    monkeypatch.setattr(localfs, "file_record", counted)
    assert run(tmp_path, 2, [], saves=0) == [[4, 5, 6]] * 2
    files = sorted(name for _, name in checked)
    assert files == [f"ckpt-000002/part-{r}-of-3.json" for r in range(3)]  # each once
    assert {thread for thread, _ in checked} == {"replica-0", "replica-1"}
    victim = tmp_path / "ckpt-000002" / "shards" / "part-2-of-3.json"
    victim.write_bytes(victim.read_bytes()[:-1])
    assert run(tmp_path, 2, [], saves=0) == [[1, 2, 3]] * 2


@given(
    st.dictionaries(names, st.dictionaries(names, records, min_size=1, max_size=4), max_size=3),
    st.integers(1, 5),
)
def test_shares_give_each_file_to_one_replica_balanced_by_size(
    listing: dict[str, dict[str, FileRecord]], replicas: int
) -> None:
    split = shares(listing, replicas)
    assert split == shares(listing, replicas) and len(split) == replicas
    every = sorted((s, n) for part in split for s, n, _ in part)
    assert every == sorted((s, n) for s, row in listing.items() for n in row)
    loads = [sum(r.size + 1 for _, _, r in part) for part in split]
    largest = max((r.size + 1 for row in listing.values() for r in row.values()), default=0)
    assert max(loads) - min(loads) <= largest


# --------------------------------------------------------------------- failures agreed


def test_a_commit_failing_on_rank_0_alone_raises_on_every_replica(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run(tmp_path, 2, [9, 9, 9])

    def refused(*_: Any) -> Any:
        raise OSError("manifest write refused")

    monkeypatch.setattr(ShardedCheckpointStore, "_write", refused)  # rank 0's commit only
    writes = Writes(2)
    writes.release.set()

    def replica(collective: ThreadCollective) -> str:
        store = ShardedCheckpointStore(tmp_path, job_id="j")
        job = Job(Topology(collective.rank, 2), collective=collective, store=store)
        job.register(BackgroundShards(collective.rank, 2, [1, 2], writes))
        job.checkpoint()
        try:
            job._committed()  # every replica, as at a stop or the end of training
        except CheckpointError as exc:
            return str(exc)
        return "passed"

    errors = run_replicas(2, replica, timeout=10)  # the collective times out on a hang
    assert all("manifest write refused" in e for e in errors), errors
    assert ShardedCheckpointStore(tmp_path, job_id="j").latest_label() == "ckpt-000001"


def restore_at(paths: list[Path]) -> list[Any]:
    """Each replica restores from its own path: its result, or its error's text."""

    def replica(collective: ThreadCollective) -> Any:
        store = ShardedCheckpointStore(paths[collective.rank], job_id="j")
        try:
            job = Job(
                Topology(rank=collective.rank, num_replicas=len(paths)),
                collective=collective,
                store=store,
            )
            state = Shards(collective.rank, len(paths), [])
            job.register(state)
        except CheckpointError as exc:
            return str(exc), store
        return state.restored, store

    return run_replicas(len(paths), replica, timeout=20)


def test_a_replica_not_seeing_rank_0s_files_raises_rather_than_falling_back(
    tmp_path: Path,
) -> None:
    import shutil

    shared, other = tmp_path / "shared", tmp_path / "other"
    run(shared, 2, [1, 2, 3])
    run(shared, 2, [4, 5, 6])
    shutil.copytree(shared, other)
    for victim in (other / "ckpt-000002" / "shards").iterdir():
        victim.unlink()  # replica 1 sees the manifest but none of the files (a stale cache)
    results = restore_at([shared, other])
    assert all("does not see" in r and "shared" in r for r, _ in results), results
    # A file missing on rank 0 too is damage: every replica falls back.
    (shared / "ckpt-000002" / "shards" / "part-1-of-2.json").unlink()
    assert [r for r, _ in restore_at([shared, shared])] == [[1, 2, 3]] * 2


def test_a_helper_failing_unexpectedly_still_answers_and_the_job_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run(tmp_path, 2, [1, 2, 3])
    run(tmp_path, 2, [4, 5, 6])
    original = localfs.file_record

    def broken(path: Path, limit: int | None = None) -> FileRecord:
        if threading.current_thread().name == "replica-1" and "ckpt-000002" in str(path):
            raise RuntimeError("hash library broke")
        return original(path, limit)

    monkeypatch.setattr(localfs, "file_record", broken)
    assert [r for r, _ in restore_at([tmp_path, tmp_path])] == [[1, 2, 3]] * 2


def test_verdicts_are_forgotten_after_a_restore(tmp_path: Path) -> None:
    run(tmp_path, 2, [1, 2, 3])
    results = restore_at([tmp_path, tmp_path])
    assert [r for r, _ in results] == [[1, 2, 3]] * 2
    for victim in (tmp_path / "ckpt-000001" / "shards").iterdir():
        victim.write_bytes(b"altered")
    for _, store in results:
        with pytest.raises(CheckpointError, match="does not match"):
            store.load_label("ckpt-000001")


def test_a_background_checkpoint_counts_and_is_said_written_once_committed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="adaptdl.lifecycle")
    writes = Writes(1)
    job = Job(store=ShardedCheckpointStore(tmp_path, job_id="j"))
    job.register(BackgroundShards(0, 1, [1, 2], writes))
    job.checkpoint()
    said = [r.getMessage() for r in caplog.records]
    assert any("ckpt-000001" in m and "started" in m for m in said), said
    assert not any("written in" in m for m in said), said
    assert job._base == 0  # not committed yet: a crash now resumes from nothing
    writes.release.set()
    job._committed()
    assert job._base == 1
    assert any(
        "ckpt-000001" in r.getMessage() and "written in" in r.getMessage() for r in caplog.records
    )


def test_a_failed_background_commit_does_not_count_as_a_checkpoint(tmp_path: Path) -> None:
    writes = Writes(1, fail=True)
    writes.release.set()
    job = Job(store=ShardedCheckpointStore(tmp_path, job_id="j"))
    job.register(BackgroundShards(0, 1, [1, 2], writes))
    job.checkpoint()
    with pytest.raises(CheckpointError, match="disk full"):
        job._committed()
    assert job._base == 0


def test_a_failed_commit_is_logged_even_if_nothing_waits_for_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import concurrent.futures

    caplog.set_level("ERROR", logger="adaptdl.core.persist.checkpoint")
    writes = Writes(1, fail=True)
    writes.release.set()
    store = ShardedCheckpointStore(tmp_path, job_id="j")
    job = Job(store=store)
    job.register(BackgroundShards(0, 1, [1, 2], writes))
    job.checkpoint()
    concurrent.futures.wait(store._pending)  # as the interpreter's exit does, no `wait`
    assert any(
        "not committed" in r.getMessage() and "disk full" in r.getMessage() for r in caplog.records
    )
