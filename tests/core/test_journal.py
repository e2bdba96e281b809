"""The journal's record survives the death of its process at any instant, exactly.

Each record is a store into a memory map of the file (no system call); a store
cut short by a SIGKILL leaves a torn slot, and the other slot, holding the record
before it, is read instead: the batch being recorded had not reached the loop.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptdl.core.checkpoint import CheckpointError
from adaptdl.core.journal import JOURNAL, Journal, Mark
from adaptdl.core.storage import LocalStorage, MemoryStorage

counts = st.integers(0, 2**63 - 1)
marks = st.builds(Mark, counts, counts, counts)


@settings(max_examples=100, deadline=None)
@given(written=st.lists(marks, min_size=1, max_size=6))
def test_the_newest_record_is_read(written: list[Mark]) -> None:
    journal = Journal(MemoryStorage())
    for mark in written:
        journal.write(mark)
        assert journal.read() == mark


@settings(max_examples=300, deadline=None)
@given(
    written=st.lists(marks, min_size=2, max_size=5),
    landed=st.sets(st.integers(0, 127)),
)
def test_a_record_torn_at_any_byte_reads_as_the_one_before_it_or_itself(
    written: list[Mark], landed: set[int]
) -> None:
    """A kill mid-store lands any subset of the last record's bytes, in any order."""
    storage = MemoryStorage()
    journal = Journal(storage)
    for mark in written[:-1]:
        journal.write(mark)
    before = storage.read(JOURNAL)
    journal.write(written[-1])
    after = storage.read(JOURNAL)
    torn = bytes(after[i] if i in landed else before[i] for i in range(len(after)))
    storage.put(JOURNAL, torn)
    read = Journal(storage).read()
    assert read == (written[-1] if torn == after else written[-2])


def test_a_new_run_replaces_both_slots_of_the_last(tmp_path: Path) -> None:
    """A resumed run counts from its checkpoint, below what the dead run had recorded."""
    old = Journal(tmp_path / "j")
    for samples in range(100, 110):
        old.write(Mark(samples=samples))
    old.close()
    new = Journal(tmp_path / "j")
    new.write(Mark(samples=40, replayed=9, checkpoint=2))
    assert Journal(tmp_path / "j").read() == Mark(samples=40, replayed=9, checkpoint=2)


def test_records_after_the_first_make_no_system_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes: list[int] = []
    pwrite = os.pwrite

    def counted(fd: int, data: bytes, at: int) -> int:
        writes.append(at)
        return pwrite(fd, data, at)

    monkeypatch.setattr(os, "pwrite", counted)
    journal = Journal(LocalStorage(tmp_path))
    for samples in range(1, 50):
        journal.write(Mark(samples=samples))
    assert writes == [0]  # the first record, the whole file
    assert Journal(LocalStorage(tmp_path)).read() == Mark(samples=49)
    journal.close()


class Unmappable:
    """A storage of the protocol without `mapped`: the journal overwrites the file whole."""

    def __init__(self) -> None:
        self.inner = MemoryStorage()

    def __getattr__(self, name: str) -> object:
        if name == "mapped":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def describe(self, name: str | None = None) -> str:
        return self.inner.describe(name)

    def read(self, name: str, limit: int | None = None) -> bytes:
        return self.inner.read(name, limit)

    def overwrite(self, name: str, data: bytes) -> None:
        self.inner.overwrite(name, data)

    def close(self) -> None:
        self.inner.close()


def test_a_storage_without_maps_still_holds_every_record() -> None:
    storage = Unmappable()
    journal = Journal(storage)  # type: ignore[arg-type]
    for samples in range(1, 5):
        journal.write(Mark(samples=samples, replayed=1))
        assert Journal(storage).read() == Mark(samples=samples, replayed=1)  # type: ignore[arg-type]


KILLED = """
import os, signal, sys
from adaptdl.core.journal import Journal, Mark
journal = Journal(sys.argv[1])
for samples in range(1, int(sys.argv[2]) + 1):
    journal.write(Mark(samples=samples, replayed=3, checkpoint=1))
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("records", [1, 2, 1000])
def test_the_last_record_outlives_a_sigkill(tmp_path: Path, records: int) -> None:
    run = subprocess.run(
        [sys.executable, "-c", KILLED, str(tmp_path / "j"), str(records)],
        capture_output=True,
        check=False,
        timeout=120,
    )
    assert run.returncode == -signal.SIGKILL, run.stderr
    assert Journal(tmp_path / "j").read() == Mark(samples=records, replayed=3, checkpoint=1)


def test_a_record_with_no_whole_slot_names_the_file(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j")
    journal.write(Mark(samples=5))
    journal.write(Mark(samples=6))
    journal.close()
    damaged = bytearray((tmp_path / "j").read_bytes())
    damaged[20] ^= 1  # in the first slot
    damaged[60] ^= 1  # in the second
    (tmp_path / "j").write_bytes(bytes(damaged))
    with pytest.raises(CheckpointError, match=r"j.*neither slot"):
        Journal(tmp_path / "j").read()


@settings(max_examples=50, deadline=None)
@given(written=st.lists(marks, min_size=1, max_size=4))
def test_the_file_layout_is_the_one_earlier_versions_read(
    tmp_path_factory: pytest.TempPathFactory, written: list[Mark]
) -> None:
    """128 bytes: the magic, then two 40-byte slots at bytes 8 and 48, each the four
    counts (sequence first) as little-endian u64 and their CRC-32 right after."""
    path = tmp_path_factory.mktemp("journal") / JOURNAL
    journal = Journal(path)
    for mark in written:
        journal.write(mark)
    journal.close()
    raw = path.read_bytes()
    assert len(raw) == 128 and raw.startswith(b"ADLJRNL2")
    seq = len(written)
    last = written[-1]
    offset = 8 if seq % 2 == 0 else 48
    body = struct.pack("<4Q", seq, last.samples, last.replayed, last.checkpoint)
    assert raw[offset : offset + 36] == body + struct.pack("<I", zlib.crc32(body))
