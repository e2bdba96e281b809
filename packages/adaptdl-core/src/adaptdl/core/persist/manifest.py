"""The format of one stored checkpoint: its label, its entry files and the manifest.

A checkpoint ``ckpt-NNNNNN`` (six or more digits, growing with every save) holds
one file per entry, ``entry-0000.bin`` ..., and :data:`MANIFEST`: a JSON object
with the schema, the label and its number, the job id, the metadata, the file,
size and SHA-256 of every entry, the creation time, and the SHA-256 ``digest`` of
all of that. :func:`layout` makes the files of a checkpoint; :func:`parse_manifest`
checks a manifest read back and raises :class:`Unusable` for anything a store must
not load. The store that reads and writes them is `adaptdl.core.persist.checkpoint`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

# The collective wire format is the project's one canonical JSON (sorted keys, ASCII,
# NaN/Infinity allowed for metrics); manifests use the same, with the same checks.
from adaptdl.core.collective import decode as _json_decode
from adaptdl.core.collective import encode as _json_encode

__all__ = [
    "LABEL",
    "MANIFEST",
    "MAX_MANIFEST_BYTES",
    "SCHEMA",
    "Foreign",
    "Unusable",
    "check_label",
    "digest",
    "label_of",
    "layout",
    "parse_manifest",
    "sequence_of",
]

SCHEMA = "adaptdl.checkpoint/1"
"""The manifest schema this version writes and reads."""

MANIFEST = "manifest.json"
"""The name of the manifest file inside a checkpoint directory."""

MAX_MANIFEST_BYTES = 1 << 24
"""A manifest longer than this (16 MiB, some 100 000 entries) is damage."""

LABEL = re.compile(r"ckpt-([0-9]{6,})\Z")
"""A checkpoint's label; its group is the sequence number."""

_FILE = re.compile(r"entry-[0-9]{4,}\.bin\Z")
_SHA256 = re.compile(r"[0-9a-f]{64}\Z")


class Unusable(Exception):
    """Why one stored checkpoint cannot be used."""


class Foreign(Unusable):
    """The checkpoint is another job's: skipped quietly when this job has its own."""


def check_label(label: Any) -> str:
    """``label`` if it looks like ``ckpt-000012``, else ValueError naming it."""
    if not isinstance(label, str) or not LABEL.match(label):
        raise ValueError(f"label must look like 'ckpt-000012', got {label!r}")
    return label


def sequence_of(label: str) -> int:
    """The number in a valid ``label``; larger is newer."""
    match = LABEL.match(label)
    assert match is not None
    return int(match.group(1))


def label_of(sequence: int) -> str:
    """The label of checkpoint number ``sequence``."""
    return f"ckpt-{sequence:06d}"


def digest(body: Mapping[str, Any]) -> str:
    """The manifest's checksum: SHA-256 of the canonical JSON of everything but it."""
    return hashlib.sha256(_json_encode(dict(body))).hexdigest()


def layout(
    label: str,
    entries: Mapping[str, bytes],
    *,
    job_id: str | None,
    metadata: Mapping[str, Any],
    created: float,
) -> tuple[dict[str, bytes], str]:
    """The files of checkpoint ``label`` (entries, then the manifest) and its digest.

    The manifest is the last file, so a store that writes the files in order
    makes a manifest mean that the entries are there.
    """
    files: dict[str, bytes] = {}
    listing: dict[str, Any] = {}
    for index, name in enumerate(sorted(entries)):
        file = f"entry-{index:04d}.bin"
        data = entries[name]
        files[file] = data
        listing[name] = {
            "file": file,
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    body: dict[str, Any] = {
        "schema": SCHEMA,
        "label": label,
        "sequence": sequence_of(label),
        "job_id": job_id,
        "metadata": dict(metadata),
        "entries": listing,
        "created": float(created),
    }
    body["digest"] = digest(body)
    files[MANIFEST] = _json_encode(body)
    return files, body["digest"]


def parse_manifest(label: str, raw: bytes) -> dict[str, Any]:
    """The manifest of checkpoint ``label`` read as ``raw``, checked; Unusable if damaged.

    Checks the schema, the digest, the label, and the shape of the metadata and of
    every entry's record; not the entries' bytes, nor whose job it is.
    """
    try:
        manifest = _json_decode(raw)
    except ValueError:
        raise Unusable(f"{MANIFEST} is not valid JSON (damaged or truncated)") from None
    if not isinstance(manifest, dict):
        raise Unusable(f"{MANIFEST} is not a JSON object")
    schema = manifest.get("schema")
    if schema != SCHEMA:
        raise Unusable(
            f"{MANIFEST} has unknown schema {schema!r} (this version of AdaptDL reads {SCHEMA!r})"
        )
    body = {k: v for k, v in manifest.items() if k != "digest"}
    if manifest.get("digest") != digest(body):
        raise Unusable(f"{MANIFEST} does not match its checksum (damaged or edited)")
    if manifest.get("label") != label or manifest.get("sequence") != sequence_of(label):
        raise Unusable(f"{MANIFEST} describes checkpoint {manifest.get('label')!r}, not {label!r}")
    if not isinstance(manifest.get("metadata"), dict):
        raise Unusable(f"{MANIFEST} has no metadata object")
    listing = manifest.get("entries")
    if not isinstance(listing, dict):
        raise Unusable(f"{MANIFEST} has no entries object")
    for name, info in listing.items():
        if not (
            isinstance(info, dict)
            and isinstance(info.get("file"), str)
            and _FILE.match(info["file"])
            and isinstance(info.get("size"), int)
            and info["size"] >= 0
            and isinstance(info.get("sha256"), str)
            and _SHA256.match(info["sha256"])
        ):
            raise Unusable(f"{MANIFEST} has a malformed record for entry {name!r}")
    return manifest
