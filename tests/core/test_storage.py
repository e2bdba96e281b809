"""The storage protocol: both implementations behave alike, and a faulty one can be swapped in."""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptdl.core.persist.checkpoint import CheckpointError, CheckpointStore
from adaptdl.core.persist.journal import Journal, Mark
from adaptdl.core.persist.localfs import LocalStorage
from adaptdl.core.persist.storage import (
    TMP_PREFIX,
    FileRecord,
    MemoryStorage,
    StagingStorage,
    Storage,
)

SETTINGS = settings(max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(params=["local", "memory"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], Storage]:
    counter = [0]

    def new() -> Storage:
        counter[0] += 1
        if request.param == "local":
            return LocalStorage(tmp_path / f"s{counter[0]}")
        return MemoryStorage()

    return new


def test_both_implementations_are_storages(tmp_path: Path) -> None:
    assert isinstance(LocalStorage(tmp_path), Storage)
    assert isinstance(MemoryStorage(), Storage)


@SETTINGS
@given(
    files=st.dictionaries(
        st.from_regex(r"[a-z]{1,8}\.bin", fullmatch=True), st.binary(max_size=40), max_size=4
    ),
    limit=st.one_of(st.none(), st.integers(0, 50)),
)
def test_a_written_directory_reads_back_and_is_listed(
    make: Callable[[], Storage], files: dict[str, bytes], limit: int | None
) -> None:
    storage = make()
    assert storage.list() == []
    storage.write_directory("d1", files)
    assert storage.list() == ["d1"]
    for file, data in files.items():
        assert storage.read(f"d1/{file}", limit) == (data if limit is None else data[:limit])
    storage.remove("d1")
    storage.cleanup()
    assert storage.list() == []


def test_missing_names_raise_file_not_found(make: Callable[[], Storage]) -> None:
    storage = make()
    storage.check_writable()
    for name in ("nothing", "d/nothing"):
        with pytest.raises(FileNotFoundError):
            storage.read(name)


def test_overwrite_replaces_the_start_of_a_file(make: Callable[[], Storage]) -> None:
    storage = make()
    storage.check_writable()
    storage.overwrite("j", b"abcdef")
    storage.overwrite("j", b"XY")
    assert storage.read("j") == b"XYcdef"
    assert storage.read("j", limit=3) == b"XYc"
    storage.close()


@pytest.mark.parametrize("code", [errno.EMFILE, errno.EACCES, errno.EIO])
def test_overwrite_keeps_a_regular_file_it_failed_to_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """Only debris (a symlink, a FIFO) is replaced; an open that fails otherwise raises."""
    (tmp_path / "j").write_bytes(b"journal")
    storage = LocalStorage(tmp_path)

    def refuse(path: object, flags: int) -> int:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr("adaptdl.core.persist.localfs.open_regular", refuse)
    with pytest.raises(OSError) as exc:
        storage.overwrite("j", b"XY")
    assert exc.value.errno == code
    assert (tmp_path / "j").read_bytes() == b"journal"


def test_leftovers_are_not_listed_and_cleanup_removes_them(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    (tmp_path / f"{TMP_PREFIX}half").mkdir()
    (tmp_path / f"{TMP_PREFIX}file").write_text("x")
    (tmp_path / "a-file").write_text("not a directory")
    storage.write_directory("ckpt", {"f": b"1"})
    assert storage.list() == ["ckpt"]
    storage.cleanup()
    assert sorted(os.listdir(tmp_path)) == ["a-file", "ckpt"]


def test_a_failed_directory_write_leaves_nothing(tmp_path: Path) -> None:
    class Full(LocalStorage):
        @staticmethod
        def write_durably(path: Path, data: bytes) -> None:
            if path.name in ("second", "manifest.json"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            LocalStorage.write_durably(path, data)

    storage = Full(tmp_path)
    with pytest.raises(OSError, match="No space"):
        storage.write_directory("d", {"first": b"1", "second": b"2"})
    assert os.listdir(tmp_path) == []
    store = CheckpointStore(storage)
    with pytest.raises(CheckpointError, match=r"could not write checkpoint .* has space"):
        store.save({"a": b"x"})
    assert store.labels() == []


def test_journal_and_store_share_one_storage(make: Callable[[], Storage]) -> None:
    storage = make()
    store = CheckpointStore(storage)
    store.save({"a": b"1"})
    journal = Journal(storage)
    journal.write(Mark(samples=7, replayed=2))
    assert Journal(storage).read() == Mark(samples=7, replayed=2)
    assert store.labels() == ["ckpt-000001"]  # the journal is a file, not a checkpoint
    journal.close()


def test_a_store_refuses_what_is_neither_a_path_nor_a_storage() -> None:
    with pytest.raises(TypeError, match="root must be a path"):
        CheckpointStore(object())  # type: ignore[arg-type]


def test_the_lock_is_in_the_protocol(make: Callable[[], Storage]) -> None:
    storage = make()
    storage.lock(wait=0)
    storage.lock(wait=0)  # held already: no error
    storage.unlock()


def test_a_local_storage_stages_and_memory_does_not(tmp_path: Path) -> None:
    assert isinstance(LocalStorage(tmp_path), StagingStorage)
    assert not isinstance(MemoryStorage(), StagingStorage)


def test_staged_files_are_new_files_inside_real_directories(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path, owner="j")
    staged = storage.stage("t0k3n", "state")
    assert staged.startswith(TMP_PREFIX) and staged.endswith("stage-t0k3n/state")
    assert storage.stage("t0k3n", "state") == staged  # the same on every replica
    assert storage.list() == []  # a leftover name, never listed
    with storage.create(f"{staged}/a.bin") as file:
        file.write(b"abc")
    assert storage.digest(f"{staged}/a.bin") == FileRecord(3, hashlib.sha256(b"abc").hexdigest())
    assert storage.digest(f"{staged}/a.bin", limit=1).size == 2  # reads limit + 1 at most
    with pytest.raises(FileExistsError):
        storage.create(f"{staged}/a.bin")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "b.bin").write_bytes(b"b")
    (storage.local_path(staged) / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError, match="not a directory"):
        storage.digest(f"{staged}/link/b.bin")  # never through a symlinked directory
    with pytest.raises(OSError, match="not a directory"):
        storage.create(f"{staged}/link/c.bin")
    (storage.local_path(staged) / "dangling").symlink_to(tmp_path / "nowhere")
    assert storage.taken(f"{staged}/dangling") and not storage.taken(f"{staged}/c.bin")
    with pytest.raises(ValueError, match="token"):
        storage.stage("../up")


def test_an_adopted_staged_directory_is_committed_whole(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path, owner="j")
    staged = storage.stage("t", "state")
    with storage.create(f"{staged}/shard") as file:
        file.write(b"shard")
    storage.adopt(staged.rpartition("/")[0])
    storage.write_directory("ckpt-000001", {"manifest.json": b"{}"})
    assert storage.list() == ["ckpt-000001"]
    assert storage.read("ckpt-000001/state/shard") == b"shard"
    assert storage.read("ckpt-000001/manifest.json") == b"{}"
    storage.write_directory("ckpt-000002", {"x": b"y"})  # adopting ends with the commit
    assert sorted(os.listdir(tmp_path / "ckpt-000002")) == ["x"]
