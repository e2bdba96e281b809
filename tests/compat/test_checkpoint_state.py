"""adaptdl.checkpoint: a program's State is saved with the job's checkpoints and restored."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import BinaryIO

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import TensorDataset

import adaptdl.checkpoint
import adaptdl.torch as adl
import torch
from adaptdl.core.loop.boundary import Preempted
from adaptdl.core.persist.checkpoint import CheckpointStore
from adaptdl.torch import _context


class Counter(adaptdl.checkpoint.State):
    """The original's idiom: super().__init__ first, then the fields."""

    def __init__(self, name: str = "counter") -> None:
        super().__init__(name)
        self.value = 0
        self.synced = 0
        self.saves = 0

    def save(self, fileobj: BinaryIO) -> None:
        self.saves += 1
        fileobj.write(json.dumps(self.value).encode())

    def load(self, fileobj: BinaryIO) -> None:
        self.value = json.loads(fileobj.read())

    def sync(self) -> None:
        self.synced += 1


class Raw(adaptdl.checkpoint.State):
    """Arbitrary bytes, in a format of the subclass's choosing."""

    def __init__(self, data: bytes = b"") -> None:
        super().__init__("raw")
        self.data = data

    def save(self, fileobj: BinaryIO) -> None:
        fileobj.write(self.data)

    def load(self, fileobj: BinaryIO) -> None:
        self.data = fileobj.read()


def _restart(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new run of the job in this process: forget the job, init again on ``path``."""
    _context._reset()
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(path))
    adl.init_process_group()


def test_a_fresh_start_loads_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path))
    counter = Counter()
    assert adaptdl.checkpoint.load_state(counter) is False
    assert counter.value == 0


def test_a_state_is_restored_after_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path))
    counter = Counter()
    counter.value = 41
    assert adaptdl.checkpoint.save_all_states() == str(tmp_path)
    assert (counter.synced, counter.saves) == (1, 1)
    _restart(tmp_path, monkeypatch)
    again = Counter()
    assert again.value == 0  # the constructor's own value until load_state
    assert adaptdl.checkpoint.load_state(again) is True
    assert again.value == 41


def test_the_entry_is_a_checksummed_blob_of_the_jobs_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path))
    Raw(b"\x00\xffpayload")
    adaptdl.checkpoint.save_all_states()
    _context._reset()  # release the directory's lock
    loaded = CheckpointStore(tmp_path).load()
    assert loaded is not None
    # One checkpoint holds it beside the library's own entries.
    assert loaded.entries["program-state:raw"] == b"\x00\xffpayload"
    assert "adaptdl-job" in loaded.entries


def test_a_damaged_state_entry_is_never_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path))
    Raw(b"first")
    adaptdl.checkpoint.save_all_states()
    _restart(tmp_path, monkeypatch)
    raw = Raw()
    assert adaptdl.checkpoint.load_state(raw)
    raw.data = b"second"
    adaptdl.checkpoint.save_all_states()
    _context._reset()
    newest = sorted(tmp_path.glob("ckpt-*"))[-1]
    manifest = json.loads((newest / "manifest.json").read_text())
    blob = newest / manifest["entries"]["program-state:raw"]["file"]
    blob.write_bytes(b"SECOND")  # same size, other bytes: the sha256 tells
    _restart(tmp_path, monkeypatch)
    restored = Raw()
    assert adaptdl.checkpoint.load_state(restored)
    assert restored.data == b"first"  # the older, intact checkpoint


@settings(max_examples=20)
@given(data=st.binary(max_size=4096))
def test_any_bytes_round_trip(data: bytes, tmp_path_factory: pytest.TempPathFactory) -> None:
    path = tmp_path_factory.mktemp("ckpt")
    _context._reset()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ADAPTDL_CHECKPOINT_PATH", str(path))
        adl.init_process_group()
        Raw(data)
        adaptdl.checkpoint.save_all_states()
        _restart(path, mp)
        restored = Raw()
        assert adaptdl.checkpoint.load_state(restored)
        assert restored.data == data
        _context._reset()


def test_names_are_unique() -> None:
    Counter("a")
    with pytest.raises(ValueError, match="'a' already exists"):
        Counter("a")
    Counter("b")


def test_a_name_the_library_uses_does_not_collide(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The library's own entry is called adaptdl-metrics; a program's state lives apart.
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path))
    state = Counter("adaptdl-metrics")
    state.value = 5
    adaptdl.checkpoint.save_all_states()
    _restart(tmp_path, monkeypatch)
    again = Counter("adaptdl-metrics")
    assert adaptdl.checkpoint.load_state(again) and again.value == 5


class Named(adaptdl.checkpoint.State):
    """A subclass with an attribute of its own called name."""

    def __init__(self) -> None:
        super().__init__("named")
        self.name = "my own attribute"


def test_a_subclass_may_use_any_attribute_name() -> None:
    state = Named()
    assert state.name == "my own attribute"
    adaptdl.checkpoint.save_all_states()


@pytest.mark.parametrize("name", ["", None, 3])
def test_a_bad_name_is_refused(name: object) -> None:
    with pytest.raises(ValueError, match="name must be a non-empty str"):
        adaptdl.checkpoint.State(name)  # type: ignore[arg-type]


def test_load_state_wants_a_state() -> None:
    with pytest.raises(TypeError, match=r"adaptdl\.checkpoint\.State"):
        adaptdl.checkpoint.load_state(object())  # type: ignore[arg-type]


def test_without_a_checkpoint_path_saving_returns_none() -> None:
    counter = Counter()
    assert adaptdl.checkpoint.save_all_states() is None
    assert counter.saves == 1 and counter.synced == 1
    assert adaptdl.checkpoint.load_state(counter) is False


def test_a_state_missing_from_the_checkpoint_is_not_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path))
    Counter("old")
    adaptdl.checkpoint.save_all_states()
    _restart(tmp_path, monkeypatch)
    new = Counter("new")
    new.value = 7
    assert adaptdl.checkpoint.load_state(new) is False
    assert new.value == 7


def test_a_sigterm_checkpoint_holds_the_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path))
    adl.init_process_group()
    counter = Counter()
    loader = adl.AdaptiveDataLoader(TensorDataset(torch.arange(20)), batch_size=2)
    with pytest.raises(Preempted):
        for _ in adl.remaining_epochs_until(1):
            for _ in loader:
                counter.value += 1
                if counter.value == 3:
                    os.kill(os.getpid(), signal.SIGTERM)
    _restart(tmp_path, monkeypatch)
    again = Counter()
    assert adaptdl.checkpoint.load_state(again)
    assert again.value == counter.value


def test_save_state_saves_the_whole_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path))
    counter, other = Counter("one"), Counter("two")
    counter.value, other.value = 1, 2
    adaptdl.checkpoint.save_state(counter, str(tmp_path))
    assert (counter.synced, other.synced) == (1, 1)
    _restart(tmp_path, monkeypatch)
    one, two = Counter("one"), Counter("two")
    assert adaptdl.checkpoint.load_state(one) and adaptdl.checkpoint.load_state(two)
    assert (one.value, two.value) == (1, 2)


def test_save_state_refuses_what_it_cannot_honour(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path))
    counter = Counter()
    with pytest.raises(ValueError, match="checkpoint_dir='/elsewhere' is not the job's"):
        adaptdl.checkpoint.save_state(counter, "/elsewhere")
    with pytest.raises(ValueError, match="sync=False is not supported"):
        adaptdl.checkpoint.save_state(counter, sync=False)
    assert counter.saves == 0
