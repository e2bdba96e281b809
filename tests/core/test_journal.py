"""The journal's record survives the death of its process at any instant, exactly.

Each record is a store into a memory map of the file (no system call). A whole
record cut short by a SIGKILL leaves a torn slot, and the other slot, holding the
record before it, is read instead: the batch being recorded had not reached the
loop. The running count of every batch is one 8-byte store, which a kill cannot
split; a reader takes it or the newest slot's count, whichever is larger.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptdl.core.checkpoint import CheckpointError
from adaptdl.core.journal import _RUNNING_AT as RUNNING_AT
from adaptdl.core.journal import JOURNAL, Journal, Mark
from adaptdl.core.storage import LocalStorage, MemoryStorage

counts = st.integers(0, 2**63 - 1)
marks = st.builds(Mark, counts, counts, counts)


@st.composite
def runs(draw: st.DrawFn, min_size: int = 1, max_size: int = 6) -> list[Mark]:
    """The marks of one run: samples never fall (the journal is a high-water mark)."""
    written = draw(st.lists(marks, min_size=min_size, max_size=max_size))
    samples = sorted(m.samples for m in written)
    return [Mark(s, m.replayed, m.checkpoint) for s, m in zip(samples, written, strict=True)]


@settings(max_examples=100, deadline=None)
@given(written=runs())
def test_the_newest_record_is_read(written: list[Mark]) -> None:
    journal = Journal(MemoryStorage())
    for mark in written:
        journal.write(mark)
        assert journal.read() == mark


@settings(max_examples=300, deadline=None)
@given(
    written=runs(min_size=2, max_size=5),
    landed=st.sets(st.integers(0, RUNNING_AT - 1)),
    running_landed=st.booleans(),
)
def test_a_record_torn_at_any_byte_reads_as_the_one_before_it_or_itself(
    written: list[Mark], landed: set[int], running_landed: bool
) -> None:
    """A kill mid-record lands any subset of the slot's bytes, in any order; the
    running count's one store comes after them in the program, so it lands only
    with all of them."""
    storage = MemoryStorage()
    journal = Journal(storage)
    for mark in written[:-1]:
        journal.write(mark)
    before = storage.read(JOURNAL)
    journal.write(written[-1])
    after = storage.read(JOURNAL)
    torn = bytearray(after[i] if i in landed else before[i] for i in range(len(after)))
    whole_slot = torn[:RUNNING_AT] == after[:RUNNING_AT]
    if not (whole_slot and running_landed):
        torn[RUNNING_AT : RUNNING_AT + 8] = before[RUNNING_AT : RUNNING_AT + 8]
    storage.put(JOURNAL, bytes(torn))
    read = Journal(storage).read()
    assert read == (written[-1] if whole_slot else written[-2])


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
    record = journal.recorder()
    for samples in range(50, 100):
        record(samples)
    assert writes == [0]  # the first record, the whole file
    assert Journal(LocalStorage(tmp_path)).read() == Mark(samples=99)
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
        journal.write(Mark(samples=samples, replayed=1, checkpoint=2))
        assert Journal(storage).read() == Mark(samples, 1, 2)  # type: ignore[arg-type]
    record = journal.recorder()
    for samples in range(5, 9):
        record(samples)  # a whole record each: the replays and checkpoint kept
        assert Journal(storage).read() == Mark(samples, 1, 2)  # type: ignore[arg-type]


KILLED = """
import os, signal, sys
from adaptdl.core.journal import Journal, Mark
journal = Journal(sys.argv[1])
records, running = int(sys.argv[2]), int(sys.argv[3])
for samples in range(1, records + 1):
    journal.write(Mark(samples=samples, replayed=3, checkpoint=1))
record = journal.recorder()
for samples in range(records + 1, records + running + 1):
    record(samples)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize(("records", "running"), [(1, 0), (2, 0), (1000, 0), (1, 1), (3, 1000)])
def test_the_last_record_outlives_a_sigkill(tmp_path: Path, records: int, running: int) -> None:
    run = subprocess.run(
        [sys.executable, "-c", KILLED, str(tmp_path / "j"), str(records), str(running)],
        capture_output=True,
        check=False,
        timeout=120,
    )
    assert run.returncode == -signal.SIGKILL, run.stderr
    assert Journal(tmp_path / "j").read() == Mark(records + running, replayed=3, checkpoint=1)


@settings(max_examples=100, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("write"), st.integers(0, 50), counts, counts),
            st.tuples(st.just("rebase"), counts, counts),
            st.tuples(st.just("record"), st.integers(0, 50)),
        ),
        max_size=12,
    ),
    mapped=st.booleans(),
)
def test_whole_records_running_counts_and_rebases_read_as_a_model(
    ops: list[tuple[object, ...]], mapped: bool
) -> None:
    """After any mix, the file reads as the model: the run's count so far (it never
    falls), the replays and checkpoint of the last whole record or rebase."""
    storage = MemoryStorage() if mapped else Unmappable()
    journal = Journal(storage)  # type: ignore[arg-type]
    model: Mark | None = None
    record = None
    for op in ops:
        samples = model.samples if model is not None else 0
        if op[0] == "write":
            _, step, replayed, checkpoint = op
            model = Mark(samples + int(step), int(replayed), int(checkpoint))  # type: ignore[call-overload]
            journal.write(model)
        elif op[0] == "rebase":
            _, replayed, checkpoint = op
            journal.rebase(int(replayed), int(checkpoint))  # type: ignore[call-overload]
            if model is not None:  # before a run's first record: nothing
                model = Mark(samples, int(replayed), int(checkpoint))  # type: ignore[call-overload]
        elif model is not None:
            record = record or journal.recorder()
            model = attrs.evolve(model, samples=samples + int(op[1]))  # type: ignore[call-overload]
            record(model.samples)
        assert Journal(storage).read() == model  # type: ignore[arg-type]


def test_counts_never_fall_within_a_run(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j")
    with pytest.raises(RuntimeError, match=r"j.*write a whole record"):
        journal.recorder()
    journal.write(Mark(samples=10))
    journal.recorder()(15)
    with pytest.raises(ValueError, match=r"samples=12 is below .*j' \(15\)"):
        journal.write(Mark(samples=12))
    journal.rebase(replayed=4, checkpoint=2)
    assert Journal(tmp_path / "j").read() == Mark(samples=15, replayed=4, checkpoint=2)
    journal.close()
    fresh = Journal(tmp_path / "j")  # a new run starts lower: its first record is whole
    fresh.write(Mark(samples=3))
    assert Journal(tmp_path / "j").read() == Mark(samples=3)


def test_a_file_of_an_earlier_version_reads_its_last_slot(tmp_path: Path) -> None:
    """Earlier versions wrote 0 where the running count goes and only whole records."""
    journal = Journal(tmp_path / "j")
    journal.write(Mark(samples=7, replayed=1, checkpoint=1))
    journal.write(Mark(samples=9, replayed=1, checkpoint=1))
    journal.close()
    raw = bytearray((tmp_path / "j").read_bytes())
    raw[RUNNING_AT : RUNNING_AT + 8] = bytes(8)
    (tmp_path / "j").write_bytes(bytes(raw))
    assert Journal(tmp_path / "j").read() == Mark(samples=9, replayed=1, checkpoint=1)


def test_an_earlier_version_reads_a_whole_record_as_a_lower_bound(tmp_path: Path) -> None:
    """A reader of slots alone (what earlier versions read) sees the last whole record."""
    journal = Journal(tmp_path / "j")
    journal.write(Mark(samples=7, replayed=1, checkpoint=1))
    journal.recorder()(30)
    journal.close()
    raw = (tmp_path / "j").read_bytes()
    raw = raw[:RUNNING_AT] + bytes(len(raw) - RUNNING_AT)  # what it does not read
    (tmp_path / "j").write_bytes(raw)
    assert Journal(tmp_path / "j").read() == Mark(samples=7, replayed=1, checkpoint=1)


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
@given(written=runs(max_size=4))
def test_the_file_layout_is_the_one_earlier_versions_read(
    tmp_path_factory: pytest.TempPathFactory, written: list[Mark]
) -> None:
    """128 bytes: the magic, then two 40-byte slots at bytes 8 and 48, each the four
    counts (sequence first) as little-endian u64 and their CRC-32 right after; the
    running count at byte 88 (little-endian u64), where earlier versions write 0."""
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
    assert raw[88:96] == struct.pack("<Q", last.samples)
