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
a lower bound).
"""

from __future__ import annotations

import json
import os
from typing import Any

import attrs

_RECORD_SIZE = 64  # bytes; a record is JSON padded with spaces to this size


@attrs.frozen
class Mark:
    """The job had taken ``samples`` samples (all replicas, all loops), ``replayed`` twice."""

    samples: int
    replayed: int = 0


class Journal:
    """One fixed-size record in a file, overwritten in place."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._fd: int | None = None

    def read(self) -> Mark | None:
        """The last mark written, or None when there is none or it is unreadable."""
        try:
            with open(self.path, "rb") as f:
                raw = f.read(_RECORD_SIZE)
            data: Any = json.loads(raw.decode("utf-8"))
            return Mark(samples=int(data["samples"]), replayed=int(data.get("replayed", 0)))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write(self, mark: Mark) -> None:
        """Overwrite the record with ``mark`` (no fsync: see the module docstring)."""
        record = json.dumps(attrs.asdict(mark), sort_keys=True).encode("utf-8")
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.pwrite(self._fd, record.ljust(_RECORD_SIZE), 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
