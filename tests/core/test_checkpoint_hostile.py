"""A checkpoint directory shared with another job, or holding hostile files (issue 12).

Every file of the directory is opened without following symlinks and must be a
regular file; reads are bounded by the manifest; damage to the newest checkpoint
falls back to the older one; another job's files are never touched; debris named
like the next checkpoint never blocks a save. A FIFO is guarded by an alarm so a
regression fails instead of hanging the suite.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptdl.core.persist.checkpoint import CheckpointError, CheckpointStore
from adaptdl.core.persist.journal import JOURNAL, Journal, Mark
from adaptdl.core.persist.localfs import LocalStorage
from adaptdl.core.persist.manifest import MANIFEST
from adaptdl.core.persist.storage import TMP_PREFIX, MemoryStorage, StorageLocked

LOGGER = "adaptdl.core.persist.checkpoint"


@pytest.fixture(autouse=True)
def no_hang() -> Iterator[None]:
    """Fail (not hang) a test that blocks on a FIFO."""

    def expired(signum: int, frame: object) -> None:
        raise TimeoutError("blocked: a FIFO or an unbounded read was followed")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def two_checkpoints(root: Path) -> CheckpointStore:
    store = CheckpointStore(root, job_id="a")
    store.save({"x": b"old"})
    store.save({"x": b"new"})
    return store


def entry(root: Path, label: str) -> Path:
    return root / label / "entry-0000.bin"


# ---- another job in the same directory ----------------------------------------------------


def test_retention_keeps_the_other_jobs_checkpoints(tmp_path: Path) -> None:
    a = CheckpointStore(tmp_path, job_id="a", keep=1)
    b = CheckpointStore(tmp_path, job_id="b", keep=1)
    for i in range(3):
        a.save({"x": f"a{i}".encode()})
        b.save({"x": f"b{i}".encode()})
    loaded_a, loaded_b = a.load(), b.load()
    assert loaded_a is not None and loaded_a.entries["x"] == b"a2"
    assert loaded_b is not None and loaded_b.entries["x"] == b"b2"
    assert len(a.labels()) == 2  # one of each job


def test_a_save_never_deletes_the_other_jobs_save_in_progress(tmp_path: Path) -> None:
    a = CheckpointStore(tmp_path, job_id="a")
    a.save({"x": b"1"})
    interleaved: list[str] = []

    class Slow(LocalStorage):
        def write_durably(self, path: Path, data: bytes) -> None:  # type: ignore[override]
            LocalStorage.write_durably(path, data)
            if path.name == "entry-0000.bin" and not interleaved:
                # Job a saves (taking the name b chose) and cleans up while b is half-way.
                interleaved.append(a.save({"x": b"2"}).label)

    b = CheckpointStore(Slow(tmp_path, owner="b"), job_id="b")
    b.save({"x": b"mine"})
    loaded = b.load()
    assert loaded is not None and loaded.entries["x"] == b"mine"
    assert loaded.label != interleaved[0]
    mine = a.load()
    assert mine is not None and mine.entries["x"] == b"2"


def test_the_other_jobs_newest_checkpoint_is_not_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    CheckpointStore(tmp_path, job_id="a").save({"x": b"a"})
    CheckpointStore(tmp_path, job_id="b").save({"x": b"b"})
    with caplog.at_level(logging.WARNING, LOGGER):
        loaded = CheckpointStore(tmp_path, job_id="a").load()
    assert loaded is not None and loaded.entries["x"] == b"a"
    assert not caplog.records


def test_only_another_jobs_checkpoints_are_still_refused(tmp_path: Path) -> None:
    CheckpointStore(tmp_path, job_id="b").save({"x": b"b"})
    with pytest.raises(CheckpointError, match="belongs to job 'b'"):
        CheckpointStore(tmp_path, job_id="a").load()


def test_a_second_job_is_refused_naming_the_directory_and_the_other_job(tmp_path: Path) -> None:
    first = LocalStorage(tmp_path, owner="job-a")
    first.lock(wait=0)
    with pytest.raises(StorageLocked, match=r"'.*' is in use by job 'job-a'") as info:
        LocalStorage(tmp_path, owner="job-b").lock(wait=5)
    assert str(tmp_path) in str(info.value)
    first.unlock()
    LocalStorage(tmp_path, owner="job-b").lock(wait=0)  # released with the first


def test_a_relaunch_of_the_same_job_waits_for_the_previous_run(tmp_path: Path) -> None:
    previous = LocalStorage(tmp_path, owner="job-a")
    previous.lock(wait=0)
    threading.Timer(0.3, previous.unlock).start()
    relaunch = LocalStorage(tmp_path, owner="job-a")
    relaunch.lock(wait=30)  # proceeds once the previous run let go
    relaunch.unlock()


def test_a_relaunch_that_waits_too_long_fails_clearly(tmp_path: Path) -> None:
    previous = LocalStorage(tmp_path, owner="job-a")
    previous.lock(wait=0)
    with pytest.raises(StorageLocked, match=r"still held by a previous run of job 'job-a'"):
        LocalStorage(tmp_path, owner="job-a").lock(wait=0.2)
    previous.unlock()


def test_the_lock_file_is_not_followed_when_a_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "adaptdl.lock").symlink_to(victim)
    with pytest.raises(OSError):
        LocalStorage(tmp_path / "ckpt", owner="a").lock(wait=0)
    assert victim.read_text() == "precious"


# ---- hostile files in the newest checkpoint: fall back ------------------------------------


def damage_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def damage_dev_zero(path: Path) -> None:
    path.unlink()
    path.symlink_to("/dev/zero")


def damage_sparse(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(1 << 40)


def damage_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def damage_nested(path: Path) -> None:
    path.write_bytes(b"[" * 100_000 + b"]" * 100_000)


HOSTILE = [damage_fifo, damage_dev_zero, damage_sparse, damage_directory]


@pytest.mark.parametrize(
    ("target", "damage"),
    # An entry's bytes are opaque (its SHA-256 catches any content): only the manifest
    # is parsed, so only the manifest gets deeply nested JSON.
    [("manifest", d) for d in [*HOSTILE, damage_nested]] + [("entry", d) for d in HOSTILE],
)
def test_hostile_files_in_the_newest_checkpoint_fall_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, target: str, damage: object
) -> None:
    store = two_checkpoints(tmp_path)
    newest = store.labels()[-1]
    path = tmp_path / newest / MANIFEST if target == "manifest" else entry(tmp_path, newest)
    damage(path)  # type: ignore[operator]
    with caplog.at_level(logging.WARNING, LOGGER):
        loaded = store.load()
    assert loaded is not None and loaded.entries["x"] == b"old"
    assert "falling back" in caplog.text


def test_a_symlinked_checkpoint_directory_is_not_listed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    two_checkpoints(elsewhere)
    root = tmp_path / "root"
    root.mkdir()
    (root / "ckpt-000009").symlink_to(elsewhere / "ckpt-000002")
    assert CheckpointStore(root, job_id="a").labels() == []


def test_reads_never_exceed_the_manifests_size_by_more_than_a_byte(tmp_path: Path) -> None:
    store = two_checkpoints(tmp_path)
    newest = store.labels()[-1]
    sizes: list[int | None] = []
    storage = store.storage
    assert isinstance(storage, LocalStorage)
    original = storage.read

    def read(name: str, limit: int | None = None) -> bytes:
        sizes.append(limit)
        return original(name, limit)

    storage.read = read  # type: ignore[method-assign]
    entry(tmp_path, newest).write_bytes(b"n" * 10_000_000)
    loaded = store.load()
    assert loaded is not None and loaded.entries["x"] == b"old"
    assert None not in sizes and max(sizes) <= (1 << 24) + 1  # type: ignore[type-var]
    assert sizes[1] == len(b"new") + 1  # the entry: manifest size + 1


# ---- debris named like the next checkpoint -----------------------------------------------


@pytest.mark.parametrize("debris", ["file", "dangling", "fifo"])
def test_debris_named_like_the_next_checkpoint_never_blocks_a_save(
    tmp_path: Path, debris: str
) -> None:
    store = CheckpointStore(tmp_path, job_id="a")
    store.save({"x": b"1"})
    stray = tmp_path / "ckpt-000002"
    if debris == "file":
        stray.write_text("stray")
    elif debris == "dangling":
        stray.symlink_to(tmp_path / "nowhere")
    else:
        os.mkfifo(stray)
    saved = store.save({"x": b"2"})
    assert saved.label != "ckpt-000002"
    loaded = store.load()
    assert loaded is not None and loaded.entries["x"] == b"2"
    assert os.path.lexists(stray)  # not ours: left alone
    store.save({"x": b"3"})


def test_an_unwritable_directory_still_says_writable_and_space(tmp_path: Path) -> None:
    class Full(LocalStorage):
        def write_durably(self, path: Path, data: bytes) -> None:  # type: ignore[override]
            raise OSError(28, "No space left on device")

    with pytest.raises(CheckpointError, match="has space"):
        CheckpointStore(Full(tmp_path)).save({"x": b"1"})


# ---- the journal ---------------------------------------------------------------------------


def test_a_symlinked_journal_never_writes_through_the_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / JOURNAL).symlink_to(victim)
    journal = Journal(LocalStorage(tmp_path / "ckpt"))
    assert journal.read() is None
    journal.write(Mark(samples=3))
    journal.close()
    assert victim.read_text() == "precious"
    assert Journal(LocalStorage(tmp_path / "ckpt")).read() == Mark(samples=3)


def test_a_fifo_journal_never_blocks(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / JOURNAL)
    journal = Journal(LocalStorage(tmp_path))
    assert journal.read() is None
    journal.write(Mark(samples=5))
    journal.close()
    assert Journal(LocalStorage(tmp_path)).read() == Mark(samples=5)


@pytest.mark.parametrize(
    "record",
    [
        '{"samples": Infinity}',
        '{"samples": NaN}',
        '{"samples": 1e400}',
        '{"samples": 99999999999999999999999999999999}',
        '{"samples": -4}',
        '{"samples": 3, "replayed": "x"}',
        '{"samples": true}',
        "[1, 2]",
    ],
)
def test_a_journal_holding_a_bad_value_names_the_file(tmp_path: Path, record: str) -> None:
    (tmp_path / JOURNAL).write_text(record.ljust(64))
    with pytest.raises(CheckpointError, match=JOURNAL):
        Journal(LocalStorage(tmp_path)).read()


def test_an_empty_journal_is_no_mark(tmp_path: Path) -> None:
    (tmp_path / JOURNAL).write_bytes(b"")
    assert Journal(LocalStorage(tmp_path)).read() is None
    (tmp_path / JOURNAL).write_bytes(b"\0" * 64)
    assert Journal(LocalStorage(tmp_path)).read() is None


def test_leftovers_of_this_owner_are_cleaned_and_others_kept(tmp_path: Path) -> None:
    mine = LocalStorage(tmp_path, owner="a")
    theirs = LocalStorage(tmp_path, owner="b")
    for storage in (mine, theirs):
        storage.write_directory("ckpt-000001" if storage is mine else "ckpt-000002", {"f": b"1"})
        storage.remove("ckpt-000001" if storage is mine else "ckpt-000002")
    (tmp_path / f"{TMP_PREFIX}{mine.tag}.half").mkdir()
    (tmp_path / f"{TMP_PREFIX}{theirs.tag}.half").mkdir()
    mine.cleanup()
    assert sorted(os.listdir(tmp_path)) == [f"{TMP_PREFIX}{theirs.tag}.half"]


def test_the_lock_names_its_owner_in_json(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path, owner="job-a")
    storage.lock(wait=0)
    owner = json.loads((tmp_path / "adaptdl.lock").read_text())
    assert owner["job_id"] == "job-a" and owner["pid"] == os.getpid()
    storage.unlock()


@given(
    record=st.one_of(
        st.binary(max_size=130),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
            lambda inner: (
                st.lists(inner, max_size=3)
                | st.dictionaries(st.sampled_from(["samples", "replayed", "checkpoint"]), inner)
            ),
            max_leaves=6,
        ).map(lambda v: json.dumps(v).encode()),
    )
)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_any_journal_record_is_a_mark_nothing_or_a_checkpoint_error(record: bytes) -> None:
    storage = MemoryStorage()
    storage.overwrite(JOURNAL, record)
    try:
        mark = Journal(storage).read()
    except CheckpointError as exc:
        assert JOURNAL in str(exc)
        return
    if mark is not None:
        for count in (mark.samples, mark.replayed, mark.checkpoint):
            assert type(count) is int and 0 <= count < 2**63
