"""Tests for adaptdl.core.persist.checkpoint: round trips, crash atomicity, damage."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import adaptdl.core.persist.localfs as ckpt  # where the checkpoint store's file system calls live
from adaptdl.core.collective import encode
from adaptdl.core.persist.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    JsonState,
    MemoryCheckpointStore,
    State,
)
from adaptdl.core.persist.manifest import MANIFEST, SCHEMA

LOGGER = "adaptdl.core.persist.checkpoint"
SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(params=["dir", "memory"])
def make_store(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[Callable[..., CheckpointStore]]:
    """A factory of stores of either kind; stores of one test share one root."""

    memory: dict[str, MemoryCheckpointStore] = {}

    def make(**kwargs: Any) -> CheckpointStore:
        if request.param == "dir":
            return CheckpointStore(tmp_path / "ckpt", **kwargs)
        # A memory store is its own storage; reopening means a new view of the same data.
        shared = memory.get("shared")
        store = MemoryCheckpointStore(storage=shared.storage if shared else None, **kwargs)
        memory.setdefault("shared", store)
        return store

    yield make


def _manifest(root: Path, label: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((root / label / MANIFEST).read_text())
    return result


def _write_manifest(root: Path, label: str, manifest: dict[str, Any], *, redigest: bool) -> None:
    if redigest:
        body = {k: v for k, v in manifest.items() if k != "digest"}
        manifest = {**body, "digest": hashlib.sha256(encode(body)).hexdigest()}
    (root / label / MANIFEST).write_bytes(encode(manifest))


def _entry_file(root: Path, label: str, name: str) -> Path:
    file: str = _manifest(root, label)["entries"][name]["file"]
    return root / label / file


# --------------------------------------------------------------------------- round trips


names = st.text(min_size=1, max_size=12)


@SETTINGS
@given(
    entries=st.dictionaries(names, st.binary(max_size=64), max_size=5),
    metadata=st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5)),
)
def test_saved_checkpoint_loads_back_identically(
    make_store: Callable[..., CheckpointStore],
    entries: dict[str, bytes],
    metadata: dict[str, Any],
) -> None:
    store = make_store(keep=1)
    saved = store.save(entries, metadata)
    loaded = make_store(keep=1).load()
    assert loaded == saved
    assert dict(loaded.entries) == entries and dict(loaded.metadata) == metadata


def test_entry_names_unsafe_for_file_names_are_stored(tmp_path: Path) -> None:
    entries = {"../../etc/passwd": b"a", "a/b\\c": b"b", "\x00nul": b"c", "é🙂": b"d", ".": b""}
    store = CheckpointStore(tmp_path)
    store.save(entries)
    loaded = store.load()
    assert loaded is not None and dict(loaded.entries) == entries
    files = sorted(os.listdir(tmp_path / "ckpt-000001"))
    assert files == [*(f"entry-{i:04d}.bin" for i in range(5)), MANIFEST]


def test_empty_store_loads_none(make_store: Callable[..., CheckpointStore]) -> None:
    store = make_store()
    assert store.load() is None and store.labels() == [] and store.latest_label() is None


def test_missing_root_loads_none_and_is_not_created_by_load(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "not" / "yet")
    assert store.load() is None
    assert not (tmp_path / "not").exists()


def test_labels_count_up_and_expected_metadata_is_recorded(
    make_store: Callable[..., CheckpointStore],
) -> None:
    store = make_store(keep=5, expected={"dataset_len": 100})
    for i in range(3):
        checkpoint = store.save({"x": bytes([i])}, {"epoch": i})
        assert checkpoint.sequence == i + 1
    assert store.labels() == ["ckpt-000001", "ckpt-000002", "ckpt-000003"]
    assert store.latest_label() == "ckpt-000003"
    loaded = store.load()
    assert loaded is not None
    assert dict(loaded.metadata) == {"epoch": 2, "dataset_len": 100}


def test_metadata_contradicting_expected_is_refused(
    make_store: Callable[..., CheckpointStore],
) -> None:
    store = make_store(expected={"dataset_len": 100})
    with pytest.raises(
        ValueError, match=r"metadata\['dataset_len'\] is 5 but this store expects 100"
    ):
        store.save({}, {"dataset_len": 5})


def test_manifest_records_schema_job_sizes_hashes_and_clock(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, job_id="job-7", clock=lambda: 1234.5)
    store.save({"model": b"weights"}, {"epoch": 3})
    manifest = _manifest(tmp_path, "ckpt-000001")
    assert manifest["schema"] == SCHEMA == "adaptdl.checkpoint/1"
    assert manifest["job_id"] == "job-7" and manifest["created"] == 1234.5
    assert manifest["label"] == "ckpt-000001" and manifest["sequence"] == 1
    assert manifest["metadata"] == {"epoch": 3}
    record = manifest["entries"]["model"]
    assert record["size"] == 7 and record["sha256"] == hashlib.sha256(b"weights").hexdigest()


# --------------------------------------------------------------------------- retention


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_only_the_newest_keep_checkpoints_remain(
    make_store: Callable[..., CheckpointStore], keep: int
) -> None:
    store = make_store(keep=keep)
    for i in range(6):
        store.save({"i": bytes([i])})
    assert store.labels() == [f"ckpt-{n:06d}" for n in range(7 - keep, 7)]


def test_retention_leaves_no_temporary_directories(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    for i in range(4):
        store.save({"i": bytes([i])})
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000003", "ckpt-000004"]


def test_leftover_temp_dirs_are_ignored_by_load_and_removed_by_save(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save({"a": b"old"})
    # A complete-looking checkpoint under a temporary name, as a crash before the rename leaves.
    shutil.copytree(tmp_path / "ckpt-000001", tmp_path / ".tmp-ckpt-000002-dead")
    (tmp_path / ".tmp-probe-dead").write_bytes(b"probe")
    loaded = store.load()
    assert loaded is not None and loaded.label == "ckpt-000001"
    store.save({"a": b"new"})
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000001", "ckpt-000002"]


def test_failed_retention_does_not_fail_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(tmp_path, keep=1)
    store.save({"a": b"1"})

    monkeypatch.setattr(ckpt, "os", _OsProxy({"rename": 2}, PermissionError))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        saved = store.save({"a": b"2"})
    monkeypatch.undo()
    assert saved.label == "ckpt-000002"
    assert "could not be deleted" in caplog.text
    store.save({"a": b"3"})
    assert store.labels() == ["ckpt-000003"]


# --------------------------------------------------------------------------- atomicity


class _Crash(BaseException):
    """The process dies here: no except-Exception cleanup runs."""


_STEPS = frozenset(
    ["makedirs", "mkdir", "open", "write", "fsync", "close", "rename", "replace", "unlink",
     "listdir", "rmtree"]
)  # fmt: skip


class _OsProxy(types.SimpleNamespace):
    """The os (or shutil) module, except that the k-th call of a step raises.

    ``fail_at`` maps a function name (or "*" for any step) to the 1-based number of
    the call that raises ``error``. ``calls`` records every step call that completed.
    """

    def __init__(
        self, fail_at: dict[str, int], error: type[BaseException], module: Any = os
    ) -> None:
        super().__init__()
        self._module = module
        self._fail_at = fail_at
        self._error = error
        self._counts: dict[str, int] = {}
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._module, name)
        if name not in _STEPS:
            return real

        def step(*args: Any, **kwargs: Any) -> Any:
            for key in (name, "*"):
                self._counts[key] = self._counts.get(key, 0) + 1
                if self._fail_at.get(key) == self._counts[key]:
                    raise self._error(f"simulated failure at {name} call #{self._counts[key]}")
            result = real(*args, **kwargs)
            self.calls.append(name)
            return result

        return step


def _install(monkeypatch: pytest.MonkeyPatch, k: int, error: type[BaseException]) -> _OsProxy:
    proxy = _OsProxy({"*": k}, error)
    shutil_proxy = _OsProxy({}, error, module=shutil)
    # One counter for both modules, so "the k-th step" spans os and shutil calls.
    shutil_proxy._counts = proxy._counts
    shutil_proxy._fail_at = proxy._fail_at
    shutil_proxy.calls = proxy.calls
    monkeypatch.setattr(ckpt, "os", proxy)
    monkeypatch.setattr(ckpt, "shutil", shutil_proxy)
    return proxy


def _steps_of_a_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    store = CheckpointStore(tmp_path / "count", keep=2)
    store.save({"model": b"m0", "opt": b"o0"})
    store.save({"model": b"m1", "opt": b"o1"})
    proxy = _install(monkeypatch, 0, _Crash)
    store.save({"model": b"m2", "opt": b"o2"})
    monkeypatch.undo()
    return len(proxy.calls)


@pytest.mark.parametrize("error", [_Crash, OSError])
def test_a_failure_at_any_step_of_save_leaves_a_complete_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: type[BaseException]
) -> None:
    total = _steps_of_a_save(tmp_path, monkeypatch)
    assert total >= 15  # mkdir, 3 files x (open, write, fsync, close), renames, ...
    previous = {"model": b"m1", "opt": b"o1"}
    new = {"model": b"m2", "opt": b"o2"}
    for k in range(1, total + 1):
        root = tmp_path / f"k{k}-{error.__name__}"
        store = CheckpointStore(root, keep=2)
        store.save({"model": b"m0", "opt": b"o0"})
        store.save(previous)
        proxy = _install(monkeypatch, k, error)
        try:
            store.save(new)
        except (_Crash, CheckpointError):
            failed = True
        else:
            failed = False
        monkeypatch.undo()
        published = "rename" in proxy.calls  # the new checkpoint got its final name
        loaded = CheckpointStore(root, keep=2).load()
        assert loaded is not None, k
        assert dict(loaded.entries) == (new if published else previous), k
        assert failed or published, k
        if error is OSError and not published:
            assert not [n for n in os.listdir(root) if n.startswith(".tmp-ckpt")], k
        # The next save succeeds and tidies whatever the failure left behind.
        after = store.save({"model": b"m3", "opt": b"o3"})
        assert after.label == ("ckpt-000004" if published else "ckpt-000003"), k
        assert not [n for n in os.listdir(root) if n.startswith(".")], k
        assert len(os.listdir(root)) == 2, k
        final = store.load()
        assert final is not None and dict(final.entries) == {"model": b"m3", "opt": b"o3"}


# --------------------------------------------------------------------------- damage


def _two_checkpoints(root: Path, **kwargs: Any) -> CheckpointStore:
    store = CheckpointStore(root, **kwargs)
    store.save({"model": b"old-weights", "sampler": b"{}"}, {"epoch": 1})
    store.save({"model": b"new-weights", "sampler": b"{}"}, {"epoch": 2})
    return store


def _truncate(root: Path) -> None:
    path = _entry_file(root, "ckpt-000002", "model")
    path.write_bytes(path.read_bytes()[:-3])


def _flip(root: Path) -> None:
    path = _entry_file(root, "ckpt-000002", "model")
    data = bytearray(path.read_bytes())
    data[4] ^= 0x01
    path.write_bytes(bytes(data))


def _remove_manifest(root: Path) -> None:
    (root / "ckpt-000002" / MANIFEST).unlink()


def _remove_entry(root: Path) -> None:
    _entry_file(root, "ckpt-000002", "model").unlink()


def _garble_manifest(root: Path) -> None:
    path = root / "ckpt-000002" / MANIFEST
    path.write_bytes(path.read_bytes()[:20])


def _future_schema(root: Path) -> None:
    manifest = _manifest(root, "ckpt-000002")
    manifest["schema"] = "adaptdl.checkpoint/9"
    _write_manifest(root, "ckpt-000002", manifest, redigest=True)


def _edit_metadata(root: Path) -> None:
    manifest = _manifest(root, "ckpt-000002")
    manifest["metadata"]["epoch"] = 7
    _write_manifest(root, "ckpt-000002", manifest, redigest=False)


def _rename_dir(root: Path) -> None:
    shutil.copytree(root / "ckpt-000002", root / "ckpt-000003")
    shutil.rmtree(root / "ckpt-000002")


def _traversal(root: Path) -> None:
    manifest = _manifest(root, "ckpt-000002")
    manifest["entries"]["model"]["file"] = "../ckpt-000001/entry-0000.bin"
    _write_manifest(root, "ckpt-000002", manifest, redigest=True)


def _manifest_list(root: Path) -> None:
    (root / "ckpt-000002" / MANIFEST).write_bytes(b"[]")


def _no_metadata(root: Path) -> None:
    manifest = _manifest(root, "ckpt-000002")
    del manifest["metadata"]
    _write_manifest(root, "ckpt-000002", manifest, redigest=True)


def _entries_list(root: Path) -> None:
    manifest = _manifest(root, "ckpt-000002")
    manifest["entries"] = []
    _write_manifest(root, "ckpt-000002", manifest, redigest=True)


DAMAGES: list[tuple[Callable[[Path], None], str]] = [
    (_manifest_list, "manifest.json is not a JSON object"),
    (_no_metadata, "manifest.json has no metadata object"),
    (_entries_list, "manifest.json has no entries object"),
    (_truncate, "has 8 bytes but the manifest says 11"),
    (_flip, "does not match its SHA-256"),
    (_remove_manifest, "manifest.json is missing"),
    (_remove_entry, "entry 'model' (entry-0000.bin) is missing"),
    (_garble_manifest, "manifest.json is not valid JSON"),
    (_future_schema, "unknown schema 'adaptdl.checkpoint/9'"),
    (_edit_metadata, "does not match its checksum"),
    (_rename_dir, "describes checkpoint 'ckpt-000002', not 'ckpt-000003'"),
    (_traversal, "malformed record for entry 'model'"),
]


@pytest.mark.parametrize(("damage", "reason"), DAMAGES, ids=[d.__name__ for d, _ in DAMAGES])
def test_a_damaged_newest_checkpoint_falls_back_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: Callable[[Path], None], reason: str
) -> None:
    store = _two_checkpoints(tmp_path)
    damage(tmp_path)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        loaded = store.load()
    assert loaded is not None and loaded.label == "ckpt-000001"
    assert loaded.entries["model"] == b"old-weights"
    (record,) = caplog.records
    assert record.name == LOGGER and record.levelno == logging.WARNING
    assert reason in record.getMessage()
    assert "falling back to the older checkpoint ckpt-000001" in record.getMessage()


@pytest.mark.parametrize(("damage", "reason"), DAMAGES, ids=[d.__name__ for d, _ in DAMAGES])
def test_when_no_checkpoint_is_usable_the_error_says_what_and_where(
    tmp_path: Path, damage: Callable[[Path], None], reason: str
) -> None:
    store = _two_checkpoints(tmp_path, keep=1)
    assert store.labels() == ["ckpt-000002"]
    damage(tmp_path)
    with pytest.raises(CheckpointError) as info:
        store.load()
    message = str(info.value)
    assert reason in message
    assert f"'{tmp_path}" in message and "Remove" in message


def test_the_error_lists_every_unusable_checkpoint(tmp_path: Path) -> None:
    store = _two_checkpoints(tmp_path)
    _flip(tmp_path)
    (tmp_path / "ckpt-000001" / MANIFEST).unlink()
    with pytest.raises(CheckpointError) as info:
        store.load()
    message = str(info.value)
    assert f"'{tmp_path / 'ckpt-000002'}': entry 'model'" in message
    assert f"'{tmp_path / 'ckpt-000001'}': manifest.json is missing" in message


def test_a_crafted_pickle_payload_is_rejected_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    # Protocol-0 pickle opcodes for os.system("touch <marker>"), written by hand.
    payload = b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."
    store = CheckpointStore(tmp_path / "ckpt")
    store.save({"model": b"w" * len(payload)})  # same size: only the hash can tell
    _entry_file(tmp_path / "ckpt", "ckpt-000001", "model").write_bytes(payload)
    with pytest.raises(CheckpointError, match="does not match its SHA-256"):
        store.load()
    assert not marker.exists()


def test_another_jobs_checkpoint_is_refused_clearly(tmp_path: Path) -> None:
    CheckpointStore(tmp_path, job_id="job-a").save({"m": b"1"})
    with pytest.raises(CheckpointError, match="belongs to job 'job-a', not to this job 'job-b'"):
        CheckpointStore(tmp_path, job_id="job-b").load()
    loaded = CheckpointStore(tmp_path).load()  # no job id: any job's checkpoint
    assert loaded is not None


def test_a_checkpoint_of_another_dataset_is_refused_clearly(tmp_path: Path) -> None:
    CheckpointStore(tmp_path, expected={"dataset_len": 100}).save({"m": b"1"})
    with pytest.raises(
        CheckpointError, match="written with dataset_len=100 but this job has dataset_len=200"
    ):
        CheckpointStore(tmp_path, expected={"dataset_len": 200}).load()
    with pytest.raises(CheckpointError, match="metadata has no 'seed'"):
        CheckpointStore(tmp_path, expected={"seed": 1}).load()


def test_a_mismatched_newest_falls_back_to_an_older_matching_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    CheckpointStore(tmp_path, keep=5, expected={"n": 1}).save({"m": b"1"})
    CheckpointStore(tmp_path, keep=5, expected={"n": 2}).save({"m": b"2"})
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        loaded = CheckpointStore(tmp_path, expected={"n": 1}).load()
    assert loaded is not None and loaded.entries["m"] == b"1"
    assert "written with n=2" in caplog.text


def test_memory_store_detects_deliberate_damage(caplog: pytest.LogCaptureFixture) -> None:
    store = MemoryCheckpointStore(keep=3)
    for i in range(3):
        store.save({"m": bytes([i]) * 4})
    store.corrupt("ckpt-000003", "m")
    store.corrupt("ckpt-000002")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        loaded = store.load()
    assert loaded is not None and loaded.label == "ckpt-000001"
    assert "SHA-256" in caplog.text and "manifest.json" in caplog.text
    store.corrupt("ckpt-000001", "m", b"")
    with pytest.raises(CheckpointError, match="has 0 bytes but the manifest says 4"):
        store.load()


def test_memory_store_corrupt_names_what_is_missing() -> None:
    store = MemoryCheckpointStore()
    store.save({"m": b""})
    store.corrupt("ckpt-000001", "m")  # an empty entry gains a byte
    with pytest.raises(CheckpointError, match="has more than 0 bytes"):
        store.load()
    with pytest.raises(KeyError, match="no checkpoint 'ckpt-000009'"):
        store.corrupt("ckpt-000009")
    with pytest.raises(KeyError, match="has no entry 'x'"):
        store.corrupt("ckpt-000001", "x")


# --------------------------------------------------------------------------- writability


def test_unwritable_root_is_reported_by_check_writable(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    store = CheckpointStore(blocker / "ckpt")
    with pytest.raises(CheckpointError, match="cannot be created or written") as info:
        store.check_writable()
    assert str(blocker / "ckpt") in str(info.value)
    with pytest.raises(CheckpointError, match="file/ckpt' cannot be"):
        store.save({"m": b"1"})


def test_unwritable_root_is_reported_by_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (A name already taken no longer fails a save, see test_checkpoint_hostile.py: a
    # rename the file system refuses stands for an unwritable root.)
    def refuse(src: object, dst: object) -> None:
        raise PermissionError(13, "Permission denied", str(dst))

    monkeypatch.setattr(ckpt.os, "rename", refuse)
    store = CheckpointStore(tmp_path)
    with pytest.raises(CheckpointError, match="could not write checkpoint ckpt-000001"):
        store.save({"m": b"1"})
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp")]


def test_a_root_that_is_a_file_cannot_be_listed(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match="cannot be listed"):
        CheckpointStore(blocker).load()


def test_stores_describe_themselves(tmp_path: Path) -> None:
    assert repr(CheckpointStore(tmp_path, keep=3, job_id="j")) == (
        f"CheckpointStore({str(tmp_path)!r}, keep=3, job_id='j')"
    )
    store = MemoryCheckpointStore(job_id="j")
    assert repr(store) == "MemoryCheckpointStore(keep=2, job_id='j')"
    assert (store.keep, store.job_id, dict(store.expected)) == (2, "j", {})
    assert CheckpointStore(tmp_path).root == tmp_path


def test_check_writable_creates_root_and_leaves_nothing(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "a" / "b")
    store.check_writable()
    assert os.listdir(tmp_path / "a" / "b") == []
    MemoryCheckpointStore().check_writable()


# --------------------------------------------------------------------------- validation


def test_store_arguments_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep must be >= 1, got 0"):
        CheckpointStore(tmp_path, keep=0)
    with pytest.raises(TypeError, match="job_id must be a str or None, got 3"):
        MemoryCheckpointStore(job_id=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="root must be a path, got 5"):
        CheckpointStore(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cannot travel"):
        MemoryCheckpointStore(expected={"n": object()})


@pytest.mark.parametrize(
    ("entries", "metadata", "error", "match"),
    [
        ({"m": "text"}, {}, TypeError, "entry 'm' must be bytes, got str"),
        ({"": b""}, {}, TypeError, "entry names must be non-empty str, got ''"),
        ({1: b""}, {}, TypeError, "entry names must be non-empty str, got 1"),
        ([("m", b"")], {}, TypeError, "entries must be a mapping"),
        ({}, {"x": {1, 2}}, TypeError, "cannot travel"),
        ({}, [1], TypeError, "metadata must be a mapping"),
    ],
)
def test_save_rejects_bad_entries_and_metadata(
    entries: Any, metadata: Any, error: type[Exception], match: str
) -> None:
    store = MemoryCheckpointStore()
    with pytest.raises(error, match=match):
        store.save(entries, metadata)
    assert store.labels() == []


def test_checkpoint_values_are_validated_and_immutable() -> None:
    with pytest.raises(ValueError, match="label must look like 'ckpt-000012', got 'x'"):
        Checkpoint("x", {}, {})
    checkpoint = Checkpoint("ckpt-000012", {"m": bytearray(b"1")}, {"a": [1]})  # type: ignore[dict-item]
    assert checkpoint.entries["m"] == b"1" and type(checkpoint.entries["m"]) is bytes
    assert checkpoint.sequence == 12
    with pytest.raises(TypeError):
        checkpoint.entries["m"] = b"2"  # type: ignore[index]


def test_labels_sort_by_number_past_six_digits() -> None:
    store = MemoryCheckpointStore(keep=3)
    for label in ["ckpt-1000000", "ckpt-999999"]:
        store.storage.write_directory(label, {})
    assert store.labels() == ["ckpt-999999", "ckpt-1000000"]
    assert store.save({}).label == "ckpt-1000001"


# --------------------------------------------------------------------------- states


class _Counter(JsonState):
    name = "counter"

    def __init__(self) -> None:
        self.count = 0

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_json(self, data: dict[str, Any]) -> None:
        self.count = data["count"]


def test_json_state_round_trips_through_a_store() -> None:
    state: State = _Counter()
    counter = _Counter()
    counter.count = 41
    store = MemoryCheckpointStore()
    store.save({counter.name: counter.to_bytes()})
    loaded = store.load()
    assert loaded is not None
    state.from_bytes(loaded.entries["counter"])
    assert isinstance(state, _Counter) and state.count == 41
    assert counter.to_bytes() == b'{"count":41}'


def test_json_state_rejects_data_that_is_not_a_json_object() -> None:
    with pytest.raises(CheckpointError, match="state 'counter': saved data is not JSON"):
        _Counter().from_bytes(b"\x80\x04K\x01.")
    with pytest.raises(CheckpointError, match="is a JSON list, not an object"):
        _Counter().from_bytes(b"[1]")
