"""The listing of a sharded checkpoint's files: each file's size and SHA-256, and its codec.

Rank 0 saves it as the :data:`FILES_ENTRY` of the checkpoint
(`adaptdl.core.shardedfiles.ShardedCheckpointStore`), so the manifest's SHA-256
covers it and it covers every file; :func:`shares` splits it among the replicas
that check it together.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from adaptdl.core._validate import check_int
from adaptdl.core.checkpoint import CheckpointError
from adaptdl.core.collective import decode as _json_decode
from adaptdl.core.collective import encode as _json_encode
from adaptdl.core.storage import open_regular

__all__ = [
    "FILES_ENTRY",
    "FILES_SCHEMA",
    "FileRecord",
    "Listing",
    "check_name",
    "decode_listing",
    "encode_listing",
    "file_record",
    "merge_listings",
    "shares",
]

FILES_ENTRY = "adaptdl-files"
"""The checkpoint entry listing every file the :class:`FileState` s wrote."""

FILES_SCHEMA = "adaptdl.files/1"
"""The schema of that entry."""

# A file or state name inside a checkpoint: one path component, never "." or "..".
_NAME = re.compile(r"(?!\.\.?\Z)[A-Za-z0-9_.-]{1,200}\Z")
_SHA256 = re.compile(r"[0-9a-f]{64}\Z")
_CHUNK = 1 << 20


def check_name(what: str, name: Any) -> str:
    """``name`` if it is one safe path component, else ValueError naming ``what``."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"{what} must be 1-200 letters, digits, '_', '.' or '-' (not '.' or '..'), "
            f"got {name!r}"
        )
    return name


@attrs.frozen
class FileRecord:
    """The size and SHA-256 of one file."""

    size: int
    sha256: str

    def __attrs_post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 0:
            raise ValueError(f"size must be an int >= 0, got {self.size!r}")
        if not isinstance(self.sha256, str) or not _SHA256.match(self.sha256):
            raise ValueError(f"sha256 must be 64 lowercase hex digits, got {self.sha256!r}")


Listing = Mapping[str, Mapping[str, FileRecord]]
"""Per state name, per file name, its record."""


def encode_listing(listing: Listing) -> bytes:
    """The :data:`FILES_ENTRY` bytes for ``listing``."""
    files = {
        check_name("state name", state): {
            check_name("file name", name): [record.size, record.sha256]
            for name, record in sorted(records.items())
        }
        for state, records in sorted(listing.items())
    }
    return _json_encode({"schema": FILES_SCHEMA, "files": files})


def decode_listing(data: bytes) -> dict[str, dict[str, FileRecord]]:
    """The listing :func:`encode_listing` wrote; ValueError saying what is malformed."""
    value = _json_decode(data)
    if not isinstance(value, dict) or value.get("schema") != FILES_SCHEMA:
        raise ValueError(f"{FILES_ENTRY} is not a {FILES_SCHEMA!r} listing")
    files = value.get("files")
    if not isinstance(files, dict):
        raise ValueError(f"{FILES_ENTRY} has no files object")
    out: dict[str, dict[str, FileRecord]] = {}
    for state, records in files.items():
        check_name("state name", state)
        if not isinstance(records, dict):
            raise ValueError(f"{FILES_ENTRY}: the files of {state!r} are not an object")
        row: dict[str, FileRecord] = {}
        for name, record in records.items():
            check_name("file name", name)
            if not (isinstance(record, list) and len(record) == 2):
                raise ValueError(f"{FILES_ENTRY}: malformed record for {state}/{name}")
            row[name] = FileRecord(record[0], record[1])
        out[state] = row
    return out


def file_record(path: Path, limit: int | None = None) -> FileRecord:
    """Size and SHA-256 of the regular file ``path`` (reading at most ``limit`` + 1 bytes).

    A symlink, FIFO or directory in its place raises OSError, never followed.
    """
    fd = open_regular(path, os.O_RDONLY)
    sha = hashlib.sha256()
    size = 0
    try:
        while limit is None or size <= limit:
            chunk = os.read(fd, _CHUNK if limit is None else min(_CHUNK, limit + 1 - size))
            if not chunk:
                break
            sha.update(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return FileRecord(size, sha.hexdigest())


def merge_listings(parts: Sequence[Any]) -> dict[str, dict[str, FileRecord]]:
    listing: dict[str, dict[str, FileRecord]] = {}
    for part in parts:
        for state, records in part.items():
            row = listing.setdefault(state, {})
            for name, (size, sha256) in records.items():
                if name in row:
                    raise CheckpointError(
                        f"state {state!r}: two replicas both wrote the file {name!r}; each "
                        "file of a sharded state must be written by one replica"
                    )
                row[name] = FileRecord(size, sha256)
    return listing


def shares(listing: Listing, replicas: int) -> list[list[tuple[str, str, FileRecord]]]:
    """The files of ``listing`` split among ``replicas``: by size, largest to the least loaded.

    The same on every replica: ties go by name and then to the lowest rank.
    """
    check_int("replicas", replicas, min=1)
    files = sorted(files_of(listing), key=lambda f: (-f[2].size, f[0], f[1]))
    out: list[list[tuple[str, str, FileRecord]]] = [[] for _ in range(replicas)]
    load = [0] * replicas
    for file in files:
        rank = min(range(replicas), key=lambda r: (load[r], r))
        out[rank].append(file)
        load[rank] += file[2].size + 1
    return out


def files_of(listing: Listing) -> list[tuple[str, str, FileRecord]]:
    return [
        (state, name, record) for state, row in listing.items() for name, record in row.items()
    ]
