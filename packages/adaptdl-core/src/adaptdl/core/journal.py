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
(the checkpoints' own, beside them).
"""

from __future__ import annotations

import json
import os
from typing import Any

import attrs

from adaptdl.core.storage import LocalStorage, Storage

_RECORD_SIZE = 64  # bytes; a record is JSON padded with spaces to this size


@attrs.frozen
class Mark:
    """The job had taken ``samples`` samples (all replicas, all loops), ``replayed`` twice."""

    samples: int
    replayed: int = 0


JOURNAL = "progress.journal"
"""The journal's file name in its storage (beside the checkpoints)."""


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
        """The last mark written, or None when there is none or it is unreadable."""
        try:
            raw = self.storage.read(self.name, limit=_RECORD_SIZE)
            data: Any = json.loads(raw.decode("utf-8"))
            return Mark(samples=int(data["samples"]), replayed=int(data.get("replayed", 0)))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write(self, mark: Mark) -> None:
        """Overwrite the record with ``mark`` (no fsync: see the module docstring)."""
        record = json.dumps(attrs.asdict(mark), sort_keys=True).encode("utf-8")
        self.storage.overwrite(self.name, record.ljust(_RECORD_SIZE))

    def close(self) -> None:
        self.storage.close()
