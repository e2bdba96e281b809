"""The listing of a sharded checkpoint's files: each file's size and SHA-256, and its codec.

Rank 0 saves it as the :data:`FILES_ENTRY` of the checkpoint
(`adaptdl.core.persist.shardedfiles.ShardedCheckpointStore`), so the manifest's SHA-256
covers it and it covers every file; :func:`shares` splits it among the replicas
that check it together.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from adaptdl.core.collective import decode as _json_decode
from adaptdl.core.collective import encode as _json_encode
from adaptdl.core.persist.checkpoint import CheckpointError
from adaptdl.core.persist.storage import FileRecord, check_name
from adaptdl.core.validate import check_int

__all__ = [
    "FILES_ENTRY",
    "FILES_SCHEMA",
    "FileRecord",
    "Listing",
    "check_name",
    "decode_listing",
    "encode_listing",
    "merge_listings",
    "shares",
]

FILES_ENTRY = "adaptdl-files"
"""The checkpoint entry listing every file the :class:`FileState` s wrote."""

FILES_SCHEMA = "adaptdl.files/1"
"""The schema of that entry."""

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
