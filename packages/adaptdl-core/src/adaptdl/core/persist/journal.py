"""The job's running count of samples taken, to count what a crash makes it replay.

A checkpoint records how many samples the job had consumed when it was written;
after a SIGKILL the job resumes there and consumes again the samples taken
since. To report how many, rank 0 records, whenever the training loop takes a
batch, the job's running count of samples (the batch taken included); beside it
the replays counted so far and the newest checkpoint's number. The replays
travel in the record too because a run that resumed, counted a replay and died
again before its next checkpoint would otherwise lose that count.

The record costs no system call: the file is mapped into memory
(:class:`~adaptdl.core.persist.storage.MappableStorage`) and a record is a store into
the page cache, which outlives the death of the process (not of the machine,
where the count is then a lower bound). The file holds two kinds of record:

* The running count (:meth:`Journal.recorder`), written for every batch: one
  aligned 8-byte store of a native unsigned integer, through a memoryview (which
  converts the value first and then copies it whole; ``struct.pack_into`` zeroes
  its target before converting, and a kill in between read as 0). The death of
  the process cannot split it: a CPU completes an instruction or does not start
  it. It is the latest count, not a maximum: a batch taken and then left
  unconsumed (a loop left by ``break``) is taken again by the next loop, which
  records the lower count.
* The replays and the checkpoint (:meth:`Journal.rebase`), written when they
  change, a few times a run: a whole record in one of two slots, written in
  turn, each with a sequence number, the running count as it stands, and a
  CRC-32. Such a store is not atomic: a process killed in the middle of one
  leaves that slot torn and the other one whole, holding the previous replays
  and checkpoint. A reader takes the whole slot with the higher sequence number.

A reader takes the samples from the running count and the rest from the newest
whole slot, where the run's first record marked the file as holding a running
count (8 bytes right after it); a file of an earlier version has zeros there, and
then the slot's count is the samples. (A big-endian machine cannot store the
little-endian count in one store: there every record is a whole slot, and the
file is not marked.)

A run's first record rewrites the whole file with one write, so nothing of an
earlier run outlives it. The layout (``ADLJRNL2``, slots at bytes 8 and 48, the
running count at byte 88, its mark at 96) is the one earlier versions write, with
zeros after the slots, and read, ignoring what follows the slots: a journal read by
an earlier version holds the count of its last whole record. Journals of the format
before that (one JSON record) are still read.

The record is a file of a :class:`~adaptdl.core.persist.storage.Storage` (the
checkpoints' own, beside them), named for the job (:func:`journal_name`) so that
two jobs on one directory never share it. A fresh start ignores (and then
overwrites) a journal written by a run that had checkpoints (they were removed),
so only a crash before the first checkpoint counts there. A record holding
anything but counts in ``[0, 2**63)``, or no whole slot, is a
:class:`~adaptdl.core.persist.checkpoint.CheckpointError` naming the file.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import struct
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from adaptdl.core.persist.checkpoint import CheckpointError
from adaptdl.core.persist.localfs import LocalStorage
from adaptdl.core.persist.storage import MappableStorage, Storage, owner_tag

if TYPE_CHECKING:  # the type of a mapped record only
    import mmap

_RECORD_SIZE = 128  # bytes of the file (and of a record of the previous, JSON format)
_MAGIC = b"ADLJRNL2"  # the file's first bytes: two slots follow
_SLOT = struct.Struct("<4Q")  # sequence number, samples, replayed, checkpoint
_CRC = struct.Struct("<I")  # CRC-32 of the slot's packed fields, right after them
_SLOT_AND_CRC = struct.Struct(f"<4Q{_CRC.format.lstrip('<')}")  # both, in one store
# A slot: its fields and their CRC, padded to 8 bytes (the format of existing files).
_SLOT_SIZE = -(-_SLOT_AND_CRC.size // 8) * 8
_OFFSETS = (len(_MAGIC), len(_MAGIC) + _SLOT_SIZE)  # slot ``seq % 2`` takes sequence ``seq``
# The running count: after the slots, 8-aligned (the map starts on a page), so that a
# store of it is one instruction. Read little-endian; stored natively, one store,
# where that is little-endian (elsewhere it stays 0 and every record is a whole slot).
_RUNNING_AT = _OFFSETS[1] + _SLOT_SIZE
_RUNNING = struct.Struct("<Q")
_RUNNING_MARK = b"RUNNING1"  # right after the count: the file holds one (zeros: it does not)
_MARK_AT = _RUNNING_AT + _RUNNING.size
_ONE_STORE = sys.byteorder == "little"


@attrs.frozen
class Mark:
    """The job had taken ``samples`` samples (all replicas, all loops), ``replayed`` twice.

    ``checkpoint`` is the number of the newest checkpoint the run had restored or
    written (0: none), so that a fresh start can tell a crash before the first
    checkpoint (its replays count) from a journal whose checkpoints were removed.
    """

    samples: int
    replayed: int = 0
    checkpoint: int = 0


JOURNAL = "progress.journal"
"""The journal's file name in its storage (beside the checkpoints) for a job without an id."""

_MAX_COUNT = 2**63  # counts at or above this are damage, not progress


def journal_name(job_id: str | None) -> str:
    """The journal's file name for job ``job_id``: each job its own, beside the checkpoints."""
    return JOURNAL if job_id is None else f"progress-{owner_tag(job_id)}.journal"


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a count")


def _count(data: dict[str, Any], key: str) -> int:
    value = data.get(key, 0)
    if type(value) is not int or not 0 <= value < _MAX_COUNT:
        raise ValueError(f"{key}={value!r} is not a count in [0, 2**63)")
    return value


def _slot(seq: int, samples: int, replayed: int, checkpoint: int) -> bytes:
    """A slot's bytes: its fields, then their CRC-32."""
    crc = zlib.crc32(_SLOT.pack(seq, samples, replayed, checkpoint))
    return _SLOT_AND_CRC.pack(seq, samples, replayed, checkpoint, crc)


def _newest_slot(raw: bytes) -> dict[str, int]:
    """The fields of the whole slot with the higher sequence number; ValueError if none is."""
    newest: tuple[int, ...] | None = None
    for offset in _OFFSETS:
        body = raw[offset : offset + _SLOT.size]
        check = raw[offset + _SLOT.size : offset + _SLOT.size + _CRC.size]
        if len(check) == _CRC.size and zlib.crc32(body) == _CRC.unpack(check)[0]:
            fields = _SLOT.unpack(body)
            if newest is None or fields[0] > newest[0]:
                newest = fields
    if newest is None:
        raise ValueError("neither slot holds a whole record")
    _, samples, replayed, checkpoint = newest
    if raw[_MARK_AT : _MARK_AT + len(_RUNNING_MARK)] == _RUNNING_MARK:
        samples = _RUNNING.unpack_from(raw, _RUNNING_AT)[0]
    return {"samples": samples, "replayed": replayed, "checkpoint": checkpoint}


class Journal:
    """Two slots of a progress record, written in turn (see the module docstring).

    ``where`` is a storage (the record is its file ``name``) or the path of the
    record's file on the local file system.
    """

    def __init__(self, where: Storage | str | os.PathLike[str], name: str = JOURNAL) -> None:
        if isinstance(where, (str, os.PathLike)):
            path = Path(os.fspath(where))
            where, name = LocalStorage(path.parent), path.name
        self.storage = where
        self.name = name
        # The file's bytes as this run writes them: the storage's map of the file, or
        # (a storage without maps) a copy overwritten whole after each record.
        self._buffer: mmap.mmap | bytearray | None = None
        # The running count's 8 bytes as one native item (little-endian machines).
        self._running: memoryview | None = None
        self._mapped = False
        self._seq = 0  # of the newest record this run wrote; 0 before its first

    def read(self) -> Mark | None:
        """The last mark written, or None when there is none.

        A name that is not a regular file (a symlink, a FIFO) is no mark (the next
        :meth:`write` replaces it); an empty record (a machine crash before the page
        cache reached the disk) is none either. A record holding anything else
        than counts raises CheckpointError naming the file.
        """
        try:
            raw = self.storage.read(self.name, limit=_RECORD_SIZE + 1)
        except OSError:
            return None
        if not raw.strip(b" \0\n"):
            return None
        try:
            data: Any
            if raw.startswith(_MAGIC):
                data = _newest_slot(raw)
            else:  # the previous format: one JSON record
                data = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
            if not isinstance(data, dict) or "samples" not in data:
                raise ValueError("not an object with 'samples'")
            return Mark(
                samples=_count(data, "samples"),
                replayed=_count(data, "replayed"),
                checkpoint=_count(data, "checkpoint"),
            )
        except (ValueError, RecursionError) as exc:
            raise CheckpointError(
                f"journal {self.storage.describe(self.name)} holds {raw[:_RECORD_SIZE]!r}, "
                f"not a progress record ({exc}); remove it (it only counts replayed samples) "
                "and relaunch"
            ) from None

    def write(self, mark: Mark) -> None:
        """Record ``mark`` (no fsync: see the module docstring)."""
        self.write_counts(mark.samples, mark.replayed, mark.checkpoint)

    def write_counts(self, samples: int, replayed: int, checkpoint: int) -> None:
        """`write` of ``Mark(samples, replayed, checkpoint)``, without building one.

        The running count, then a whole slot: a kill between the two leaves the
        new count with the previous replays and checkpoint, as a `recorder` store
        followed by a `rebase` would. One write of the file where it is not mapped.
        """
        buffer = self._buffer
        if buffer is None:
            self._start(samples, replayed, checkpoint)
            return
        if self._running is not None:
            self._running[0] = samples  # the slot's write below reaches the file
        self._write_slot(buffer, samples, replayed, checkpoint)

    def rebase(self, replayed: int, checkpoint: int) -> None:
        """New replays and checkpoint (a whole slot), the running count kept.

        Nothing before this run's first record: that one carries them.
        """
        buffer = self._buffer
        if buffer is not None:
            self._write_slot(buffer, self._samples(buffer), replayed, checkpoint)

    def recorder(self) -> Callable[[int], None]:
        """The cheapest way to record a new running count, the rest of the record kept.

        ``record(samples)``: on a map of the file and a little-endian machine, one
        8-byte store and no Python frame (what the loader calls for every batch);
        otherwise a whole record. A `write` must come first (RuntimeError
        otherwise): it holds the replays and the checkpoint. After `close` the
        recorder raises ValueError.
        """
        if self._buffer is None:
            raise RuntimeError(
                f"journal {self.storage.describe(self.name)}: write a whole record before "
                "recording running counts"
            )
        if self._mapped and self._running is not None:
            return functools.partial(self._running.__setitem__, 0)
        return self._record

    def _record(self, samples: int) -> None:
        """The running count ``samples``: one store, else (big-endian) a whole slot."""
        buffer = self._buffer
        if buffer is None:
            raise ValueError(f"journal {self.storage.describe(self.name)} is closed")
        if self._running is not None:
            self._running[0] = samples
            if not self._mapped:
                self.storage.overwrite(self.name, bytes(buffer))
            return
        _, _, replayed, checkpoint = _SLOT.unpack_from(buffer, _OFFSETS[self._seq & 1])
        self._write_slot(buffer, samples, replayed, checkpoint)

    def _write_slot(
        self, buffer: mmap.mmap | bytearray, samples: int, replayed: int, checkpoint: int
    ) -> None:
        """A whole record into the slot not holding the newest one."""
        seq = self._seq + 1
        self._seq = seq
        # The fields and their CRC in one store (the CRC is computed first, from the
        # same values): a kill mid-store tears this slot and leaves the other whole.
        crc = zlib.crc32(_SLOT.pack(seq, samples, replayed, checkpoint))
        _SLOT_AND_CRC.pack_into(buffer, _OFFSETS[seq & 1], seq, samples, replayed, checkpoint, crc)
        if not self._mapped:
            self.storage.overwrite(self.name, bytes(buffer))

    def _samples(self, buffer: mmap.mmap | bytearray) -> int:
        """This run's running count (the newest slot's where it is not stored apart)."""
        if self._running is not None:
            return int(self._running[0])
        samples: int = _SLOT.unpack_from(buffer, _OFFSETS[self._seq & 1])[1]
        return samples

    def _start(self, samples: int, replayed: int, checkpoint: int) -> None:
        """This run's first record: the whole file in one write, then a map of it."""
        self._seq = 1
        record = bytearray(_MAGIC.ljust(_RECORD_SIZE, b"\0"))
        first = _slot(1, samples, replayed, checkpoint)
        record[_OFFSETS[1] : _OFFSETS[1] + len(first)] = first
        if _ONE_STORE:
            _RUNNING.pack_into(record, _RUNNING_AT, samples)
            record[_MARK_AT : _MARK_AT + len(_RUNNING_MARK)] = _RUNNING_MARK
        self.storage.overwrite(self.name, bytes(record))
        buffer: mmap.mmap | bytearray = record
        self._mapped = False
        if isinstance(self.storage, MappableStorage):
            # A file that cannot be mapped is overwritten whole after each record instead.
            with contextlib.suppress(OSError):
                buffer, self._mapped = self.storage.mapped(self.name, _RECORD_SIZE), True
        self._buffer = buffer
        if _ONE_STORE:
            # A native 8-byte item: assigning one converts the value, then copies it
            # with one memcpy (one store); released by `close`, before the map is.
            view = memoryview(buffer)
            self._running = view[_RUNNING_AT : _RUNNING_AT + _RUNNING.size].cast("Q")
            view.release()

    def close(self) -> None:
        """Release the file; a later record starts the file anew."""
        if self._running is not None:
            self._running.release()
        self._buffer, self._running, self._mapped, self._seq = None, None, False, 0
        self.storage.close()
