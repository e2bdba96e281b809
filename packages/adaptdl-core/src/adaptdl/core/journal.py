"""A high-water mark of the job's progress, to count what a crash makes it replay.

A checkpoint records how many samples the job had consumed when it was written;
after a SIGKILL the job resumes there and consumes again the samples taken
since. To report how many, rank 0 overwrites one small record whenever the
training loop takes a batch and at every step boundary, with the job's running
count of samples (the batch taken included) and the replays counted so far. The
replays travel in the record too because a run that resumed, counted a replay
and died again before its next checkpoint would otherwise lose that count. The
write goes to the page cache without fsync, so it costs a system call and
survives the death of the process (not of the machine, where the count is then
a lower bound). The record is a file of a :class:`~adaptdl.core.storage.Storage`
(the checkpoints' own, beside them), named for the job (:func:`journal_name`) so
that two jobs on one directory never share it. A fresh start ignores (and then
overwrites) a journal written by a run that had checkpoints (they were removed),
so only a crash before the first checkpoint counts there. A record holding
anything but counts in ``[0, 2**63)`` is a
:class:`~adaptdl.core.checkpoint.CheckpointError` naming the file.
"""

from __future__ import annotations

import json
import os
from typing import Any

import attrs

from adaptdl.core.checkpoint import CheckpointError
from adaptdl.core.storage import LocalStorage, Storage, owner_tag

_RECORD_SIZE = 128  # bytes; a record is JSON padded with spaces to this size


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


def encode_record(samples: int, replayed: int, checkpoint: int) -> bytes:
    """The record of a mark: its fields as sorted JSON, padded with spaces to the record size."""
    return (_RECORD_FORMAT % (checkpoint, replayed, samples)).ljust(_RECORD_SIZE)


_RECORD_FORMAT = b'{"checkpoint": %d, "replayed": %d, "samples": %d}'


class Journal:
    """One fixed-size record, overwritten in place.

    ``where`` is a storage (the record is its file ``name``) or the path of the
    record's file on the local file system.
    """

    def __init__(self, where: Storage | str | os.PathLike[str], name: str = JOURNAL) -> None:
        if isinstance(where, (str, os.PathLike)):
            path = os.fspath(where)
            where, name = LocalStorage(os.path.dirname(path) or "."), os.path.basename(path)
        self.storage = where
        self.name = name

    def read(self) -> Mark | None:
        """The last mark written, or None when there is none.

        A name that is not a regular file (a symlink, a FIFO) is no mark (the next
        :meth:`write` replaces it); an empty record (a machine crash before the page
        cache reached the disk) is none either. A record holding anything else
        than two counts raises CheckpointError naming the file.
        """
        try:
            raw = self.storage.read(self.name, limit=_RECORD_SIZE + 1)
        except OSError:
            return None
        if not raw.strip(b" \0\n"):
            return None
        try:
            data: Any = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
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
        """Overwrite the record with ``mark`` (no fsync: see the module docstring)."""
        self.write_counts(mark.samples, mark.replayed, mark.checkpoint)

    def write_counts(self, samples: int, replayed: int, checkpoint: int) -> None:
        """`write` of ``Mark(samples, replayed, checkpoint)``, without building one.

        The job calls this for every batch it hands out, so the record is formatted
        directly (the same bytes as ``json.dumps(..., sort_keys=True)`` of the mark's
        fields, a fraction of its cost).
        """
        record = (_RECORD_FORMAT % (checkpoint, replayed, samples)).ljust(_RECORD_SIZE)
        self.storage.overwrite(self.name, record)  # encode_record, inlined: once per batch

    def close(self) -> None:
        self.storage.close()
