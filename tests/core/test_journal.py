"""The journal's record survives the death of its process at any instant, exactly.

Each record is a store into a memory map of the file (no system call). A whole
record cut short by a SIGKILL leaves a torn slot, and the other slot, holding the
record before it, is read instead: the batch being recorded had not reached the
loop. The running count of every batch is one 8-byte store, which a kill cannot
split; a reader takes it or the newest slot's count, whichever is larger.
"""

from __future__ import annotations

import os
import random
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptdl.core.persist.checkpoint import CheckpointError
from adaptdl.core.persist.journal import _RUNNING_AT as RUNNING_AT
from adaptdl.core.persist.journal import JOURNAL, Journal, Mark
from adaptdl.core.persist.localfs import LocalStorage
from adaptdl.core.persist.storage import MemoryStorage

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
    landed=st.sets(st.integers(0, RUNNING_AT - 1)),
    running_landed=st.booleans(),
)
def test_a_record_torn_at_any_byte_reads_as_the_one_before_it_or_its_parts(
    written: list[Mark], landed: set[int], running_landed: bool
) -> None:
    """A kill mid-record: the running count's one store comes first in the program,
    then the slot's bytes, which land in any subset and order; so the slot lands
    only after the count. The file reads as the record before, the new count with
    the previous replays and checkpoint (a `recorder` store not yet rebased), or the
    new record."""
    storage = MemoryStorage()
    journal = Journal(storage)
    for mark in written[:-1]:
        journal.write(mark)
    before = storage.read(JOURNAL)
    journal.write(written[-1])
    after = storage.read(JOURNAL)
    torn = bytearray(before)
    if running_landed:
        torn[RUNNING_AT : RUNNING_AT + 8] = after[RUNNING_AT : RUNNING_AT + 8]
        for i in landed:
            torn[i] = after[i]
    storage.put(JOURNAL, bytes(torn))
    read = Journal(storage).read()
    last, new = written[-2], written[-1]
    whole_slot = running_landed and torn[:RUNNING_AT] == after[:RUNNING_AT]
    if whole_slot:
        assert read == new
    elif running_landed:
        assert read == attrs.evolve(last, samples=new.samples)
    else:
        assert read == last


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
        self.overwrites = 0

    def __getattr__(self, name: str) -> object:
        if name == "mapped":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def describe(self, name: str | None = None) -> str:
        return self.inner.describe(name)

    def read(self, name: str, limit: int | None = None) -> bytes:
        return self.inner.read(name, limit)

    def overwrite(self, name: str, data: bytes) -> None:
        self.overwrites += 1
        self.inner.overwrite(name, data)

    def close(self) -> None:
        self.inner.close()


def test_a_storage_without_maps_still_holds_every_record() -> None:
    storage = Unmappable()
    journal = Journal(storage)  # type: ignore[arg-type]
    for samples in range(1, 5):
        journal.write(Mark(samples=samples, replayed=1, checkpoint=2))
        assert Journal(storage).read() == Mark(samples, 1, 2)  # type: ignore[arg-type]
    assert storage.overwrites == 4  # one write of the file per record
    record = journal.recorder()
    for samples in range(5, 9):
        record(samples)  # the file rewritten each time: the replays and checkpoint kept
        assert Journal(storage).read() == Mark(samples, 1, 2)  # type: ignore[arg-type]
    assert storage.overwrites == 8


KILLED = """
import os, signal, sys
from adaptdl.core.persist.journal import Journal, Mark
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


RECORDING = """
import os, sys
from adaptdl.core.persist.journal import Journal, Mark
journal = Journal(sys.argv[1])
journal.write(Mark(samples=1, replayed=3, checkpoint=1))
record = journal.recorder()
record(2)
os.write(1, b"recording\\n")
samples = 3
while True:
    record(samples)
    samples += 1
"""


def test_a_kill_at_any_moment_of_the_running_counts_leaves_one_of_them(tmp_path: Path) -> None:
    """SIGKILLs at random moments of a loop of records: the file always reads as one
    of the counts recorded, never as less (a store that first zeroed the count, as
    ``struct.pack_into`` does, read back as the last whole record, 1, about once in 30)."""
    rng = random.Random(0)
    for trial in range(60):
        path = tmp_path / f"j{trial}"
        child = subprocess.Popen(
            [sys.executable, "-c", RECORDING, str(path)], stdout=subprocess.PIPE
        )
        assert child.stdout is not None and child.stdout.readline() == b"recording\n"
        time.sleep(rng.uniform(0.0, 0.02))
        child.kill()
        assert child.wait(timeout=60) == -signal.SIGKILL
        mark = Journal(path).read()
        assert mark is not None and mark.samples >= 2, (trial, mark)
        assert (mark.replayed, mark.checkpoint) == (3, 1)


@settings(max_examples=100, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("write"), marks),
            st.tuples(st.just("rebase"), counts, counts),
            st.tuples(st.just("record"), counts),
            st.tuples(st.just("new run"), marks),
        ),
        max_size=12,
    ),
    mapped=st.booleans(),
)
def test_whole_records_running_counts_and_rebases_read_as_a_model(
    ops: list[tuple[Any, ...]], mapped: bool
) -> None:
    """After any mix, the file reads as the model: the last count recorded (it may
    fall: a batch left unconsumed is taken again), the replays and checkpoint of the
    last whole record or rebase; a new run's first record replaces all of it."""
    storage = MemoryStorage() if mapped else Unmappable()
    journal = Journal(storage)  # type: ignore[arg-type]
    model: Mark | None = None
    record = None
    for op in ops:
        if op[0] == "write":
            model = op[1]
            journal.write(op[1])
        elif op[0] == "new run":
            journal.close()
            journal, record = Journal(storage), None  # type: ignore[arg-type]
            model = op[1]
            journal.write(op[1])
        elif op[0] == "rebase":
            journal.rebase(op[1], op[2])
            if model is not None:  # before a run's first record: nothing
                model = attrs.evolve(model, replayed=op[1], checkpoint=op[2])
        elif model is not None:
            record = record or journal.recorder()
            model = attrs.evolve(model, samples=op[1])
            record(op[1])
        assert Journal(storage).read() == model  # type: ignore[arg-type]


def test_counts_may_fall_and_a_closed_journal_refuses_records(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j")
    with pytest.raises(RuntimeError, match=r"j.*write a whole record"):
        journal.recorder()
    journal.write(Mark(samples=10))
    record = journal.recorder()
    record(15)
    record(12)  # a batch taken at 15 was left unconsumed
    journal.rebase(replayed=4, checkpoint=2)
    assert Journal(tmp_path / "j").read() == Mark(samples=12, replayed=4, checkpoint=2)
    journal.close()
    with pytest.raises(ValueError, match="released"):
        record(13)
    fresh = Journal(tmp_path / "j")  # a new run: its first record is whole
    fresh.write(Mark(samples=3))
    assert Journal(tmp_path / "j").read() == Mark(samples=3)
    fresh.close()


def _slot_bytes(seq: int, mark: Mark) -> bytes:
    body = struct.pack("<4Q", seq, mark.samples, mark.replayed, mark.checkpoint)
    return body + struct.pack("<I", zlib.crc32(body))


def test_a_file_of_an_earlier_version_reads_its_last_slot(tmp_path: Path) -> None:
    """What earlier versions wrote: the magic, two slots, zeros after them."""
    raw = bytearray(b"ADLJRNL2".ljust(128, b"\0"))
    raw[48:84] = _slot_bytes(1, Mark(7, 1, 1))
    raw[8:44] = _slot_bytes(2, Mark(9, 1, 1))
    (tmp_path / "j").write_bytes(bytes(raw))
    assert Journal(tmp_path / "j").read() == Mark(samples=9, replayed=1, checkpoint=1)


def _earlier_read(raw: bytes) -> Mark:
    """The reader of earlier versions: the whole slot with the higher sequence number."""
    assert raw.startswith(b"ADLJRNL2")
    whole = []
    for offset in (8, 48):
        body, crc = raw[offset : offset + 32], raw[offset + 32 : offset + 36]
        if zlib.crc32(body) == struct.unpack("<I", crc)[0]:
            whole.append(struct.unpack("<4Q", body))
    _, samples, replayed, checkpoint = max(whole)
    return Mark(samples, replayed, checkpoint)


def test_an_earlier_version_reads_the_last_whole_record(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j")
    journal.write(Mark(samples=7, replayed=1, checkpoint=1))
    journal.recorder()(30)
    journal.rebase(replayed=2, checkpoint=3)  # a whole record: the count as it stands
    journal.recorder()(41)
    journal.close()
    raw = (tmp_path / "j").read_bytes()
    assert _earlier_read(raw) == Mark(samples=30, replayed=2, checkpoint=3)
    assert Journal(tmp_path / "j").read() == Mark(samples=41, replayed=2, checkpoint=3)


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
    counts (sequence first) as little-endian u64 and their CRC-32 right after; the
    running count at byte 88 (little-endian u64) and its mark at 96, where earlier
    versions write zeros."""
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
    assert raw[88:104] == struct.pack("<Q", last.samples) + b"RUNNING1"
