"""Checkpoints: the :class:`State` protocol and stores that write a whole checkpoint atomically.

A checkpoint is a set of named byte strings (one per :class:`State`) plus a little
JSON metadata, saved under a label ``ckpt-NNNNNN`` whose number grows with every
save. A store keeps the newest ``keep`` checkpoints. Loading verifies everything
(manifest schema and checksum, size and SHA-256 of every entry, job id, expected
metadata such as the dataset length) and falls back to an older checkpoint, with a
logged warning, when the newest is damaged. Nothing is ever unpickled: entries are
bytes and the manifest is JSON, so loading a checkpoint cannot run code.

The bytes live on a :class:`~adaptdl.core.storage.Storage`. On disk
(:class:`CheckpointStore` on a directory)::

    root/
      ckpt-000011/  manifest.json  entry-0000.bin  entry-0001.bin ...
      ckpt-000012/  ...
      .tmp-...      leftovers of a crash: ignored by load, removed by the next save

A checkpoint is one atomic directory write of the storage (manifest last): a
crash at any instant leaves either the new complete checkpoint or none of it.

Concurrency: one process (rank 0) writes; any number of processes may read at the
same time (a checkpoint appears and disappears by a rename). A job holds its
directory with :meth:`~adaptdl.core.storage.LocalStorage.lock`; should two jobs
still share one (a file system that ignores the lock), each removes only
checkpoints whose manifest names its own job id and only its own leftovers, and
loads only its own checkpoints. A new checkpoint takes the next free number
after every checkpoint in the directory; anything else already holding that name
(a stray file, a dangling symlink) is skipped, never removed.

Hostile files: the storage opens every file without following symlinks and
refuses anything but a regular file; the manifest is read up to
:data:`MAX_MANIFEST_BYTES` and every entry up to its size in the manifest plus
one byte, so a FIFO, a link to ``/dev/zero`` or a huge sparse file is damage
like any other, and loading falls back to the older checkpoint.
"""

from __future__ import annotations

import abc
import hashlib
import logging
import os
import re
import time
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs

from adaptdl.core._validate import check_int

# The collective wire format is the project's one canonical JSON (sorted keys, ASCII,
# NaN/Infinity allowed for metrics); checkpoints use the same, with the same checks.
from adaptdl.core.collective import decode as _json_decode
from adaptdl.core.collective import encode as _json_encode
from adaptdl.core.storage import LocalStorage, MemoryStorage, Storage

__all__ = [
    "MANIFEST",
    "MAX_MANIFEST_BYTES",
    "SCHEMA",
    "Checkpoint",
    "CheckpointError",
    "CheckpointStore",
    "CollectiveState",
    "JsonState",
    "MemoryCheckpointStore",
    "State",
]

SCHEMA = "adaptdl.checkpoint/1"
"""The manifest schema this version writes and reads."""

MANIFEST = "manifest.json"
"""The name of the manifest file inside a checkpoint directory."""

MAX_MANIFEST_BYTES = 1 << 24
"""A manifest longer than this (16 MiB, some 100 000 entries) is damage."""

_SAVE_ATTEMPTS = 100  # names taken by debris that a save skips before giving up

_LABEL = re.compile(r"ckpt-([0-9]{6,})\Z")
_FILE = re.compile(r"entry-[0-9]{4,}\.bin\Z")
_SHA256 = re.compile(r"[0-9a-f]{64}\Z")

_log = logging.getLogger("adaptdl.core.checkpoint")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or no stored checkpoint can be used.

    The message says what is wrong and which directory to fix or remove.
    """


class State(Protocol):
    """A piece of job state saved in every checkpoint under its ``name``."""

    @property
    def name(self) -> str:
        """The entry name, unique within a job."""
        ...

    def to_bytes(self) -> bytes:
        """The state as bytes (data only: JSON, tensors saved without pickle, ...)."""
        ...

    def from_bytes(self, data: bytes) -> None:
        """Replace the state with the one ``data`` (from :meth:`to_bytes`) describes."""
        ...


@runtime_checkable
class CollectiveState(State, Protocol):
    """A state whose bytes need every replica's contribution (e.g. an accumulator's sums).

    Before a checkpoint, the job calls :meth:`sync` on every replica, at the same
    point, and only then :meth:`to_bytes`.
    """

    def sync(self) -> None:
        """Collective: gather what the other replicas hold, so to_bytes is complete."""
        ...


class JsonState(abc.ABC):
    """Base for states that are a JSON object; subclasses provide ``name`` and the two hooks.

    :meth:`to_bytes` is the canonical JSON text of :meth:`to_json` (sorted keys,
    ASCII); :meth:`from_bytes` parses it and hands the object to :meth:`load_json`.
    """

    name: str

    @abc.abstractmethod
    def to_json(self) -> dict[str, Any]:
        """The state as a JSON object."""

    @abc.abstractmethod
    def load_json(self, data: dict[str, Any]) -> None:
        """Replace the state with the one ``data`` (from :meth:`to_json`) describes."""

    def to_bytes(self) -> bytes:
        """Canonical JSON of :meth:`to_json`."""
        return _json_encode(self.to_json())

    def from_bytes(self, data: bytes) -> None:
        """Parse ``data`` and pass the object to :meth:`load_json`; CheckpointError if not JSON."""
        try:
            value = _json_decode(data)
        except ValueError as exc:
            raise CheckpointError(f"state {self.name!r}: saved data is not JSON ({exc})") from exc
        if not isinstance(value, dict):
            raise CheckpointError(
                f"state {self.name!r}: saved data is a JSON {type(value).__name__}, not an object"
            )
        self.load_json(value)


# --------------------------------------------------------------------------- Checkpoint


def _freeze_entries(entries: Mapping[str, bytes]) -> Mapping[str, bytes]:
    if not isinstance(entries, Mapping):
        raise TypeError(f"entries must be a mapping of str to bytes, got {type(entries).__name__}")
    frozen: dict[str, bytes] = {}
    for name, data in entries.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"entry names must be non-empty str, got {name!r}")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"entry {name!r} must be bytes, got {type(data).__name__}")
        frozen[name] = bytes(data)
    return types.MappingProxyType(frozen)


def _freeze_metadata(metadata: Mapping[str, Any]) -> Mapping[str, Any]:
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a mapping, got {type(metadata).__name__}")
    # A JSON round trip both checks that the metadata can be stored and deep-copies it.
    copied: dict[str, Any] = _json_decode(_json_encode(dict(metadata)))
    return types.MappingProxyType(copied)


def _check_label(_: Any, __: Any, label: str) -> None:
    if not isinstance(label, str) or not _LABEL.match(label):
        raise ValueError(f"label must look like 'ckpt-000012', got {label!r}")


@attrs.frozen
class Checkpoint:
    """One saved checkpoint: its label, the bytes of every entry, and its metadata.

    ``digest`` is the manifest's checksum when the checkpoint came from a store
    (replicas compare it to know they loaded the very same checkpoint).
    """

    label: str = attrs.field(validator=_check_label)
    entries: Mapping[str, bytes] = attrs.field(converter=_freeze_entries)
    metadata: Mapping[str, Any] = attrs.field(factory=dict, converter=_freeze_metadata)
    digest: str | None = attrs.field(default=None, kw_only=True)

    @property
    def sequence(self) -> int:
        """The number in the label; larger is newer."""
        return _sequence(self.label)


def _sequence(label: str) -> int:
    match = _LABEL.match(label)
    assert match is not None
    return int(match.group(1))


def _label(sequence: int) -> str:
    return f"ckpt-{sequence:06d}"


# --------------------------------------------------------------------------- stores


class _Unusable(Exception):
    """Why one stored checkpoint cannot be used."""


class _Foreign(_Unusable):
    """The checkpoint is another job's: skipped quietly when this job has its own."""


def _digest(body: Mapping[str, Any]) -> str:
    return hashlib.sha256(_json_encode(dict(body))).hexdigest()


class CheckpointStore:
    """Checkpoints on a :class:`~adaptdl.core.storage.Storage`; see the module docstring.

    ``root`` is a directory (a :class:`~adaptdl.core.storage.LocalStorage` there,
    created when needed) or any storage. ``keep`` newest checkpoints are kept.
    ``job_id``, when given, is written into every checkpoint and a checkpoint of
    another job is refused on load. ``expected`` metadata (for example
    ``{"dataset_len": 50000}``) is written into every checkpoint and a checkpoint
    whose metadata differs is refused on load. ``clock`` gives the wall time
    recorded in each manifest.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Storage,
        *,
        keep: int = 2,
        job_id: str | None = None,
        expected: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._keep = check_int("keep", keep, min=1)
        if job_id is not None and not isinstance(job_id, str):
            raise TypeError(f"job_id must be a str or None, got {job_id!r}")
        self._job_id = job_id
        self._expected = _freeze_metadata({} if expected is None else expected)
        self._clock = clock
        if isinstance(root, (str, os.PathLike)):
            self._storage: Storage = LocalStorage(root, owner=job_id)
        elif isinstance(root, Storage):
            self._storage = root
        else:
            raise TypeError(f"root must be a path, got {root!r}")

    def __repr__(self) -> str:
        root = self.root
        where = repr(self._storage) if root is None else repr(str(root))
        return f"{type(self).__name__}({where}, keep={self._keep}, job_id={self._job_id!r})"

    @property
    def storage(self) -> Storage:
        """Where the checkpoints' bytes live."""
        return self._storage

    @property
    def root(self) -> Path | None:
        """The checkpoint directory, or None when the storage is not a local directory."""
        return self._storage.root if isinstance(self._storage, LocalStorage) else None

    @property
    def keep(self) -> int:
        """How many of the newest checkpoints are kept."""
        return self._keep

    @property
    def job_id(self) -> str | None:
        """The job the checkpoints belong to, or None to accept any."""
        return self._job_id

    @property
    def expected(self) -> Mapping[str, Any]:
        """Metadata every loaded checkpoint must have."""
        return self._expected

    def check_writable(self) -> None:
        """Raise CheckpointError now if checkpoints could not be saved."""
        try:
            self._storage.check_writable()
        except OSError as exc:
            raise CheckpointError(
                f"checkpoint directory {self._storage.describe()} cannot be created or written "
                f"({exc.strerror or exc}); choose a writable directory for checkpoints"
            ) from exc

    def _list(self) -> list[str]:
        try:
            names = self._storage.list()
        except OSError as exc:
            raise CheckpointError(
                f"checkpoint directory {self._storage.describe()} cannot be listed "
                f"({exc.strerror or exc})"
            ) from exc
        return [name for name in names if _LABEL.match(name)]

    def _read(self, label: str, file: str, size: int) -> bytes:
        """At most ``size`` + 1 bytes: one more than expected shows a file grew."""
        return self._storage.read(f"{label}/{file}", limit=size + 1)

    def _where(self, label: str | None = None) -> str:
        return self._storage.describe(label)

    # ---- public interface

    def labels(self) -> list[str]:
        """Labels of the complete checkpoints, oldest first (damaged ones included)."""
        return sorted(self._list(), key=_sequence)

    def latest_label(self) -> str | None:
        """The newest complete checkpoint's label, or None if there is none."""
        labels = self.labels()
        return labels[-1] if labels else None

    def save(
        self, entries: Mapping[str, bytes], metadata: Mapping[str, Any] | None = None
    ) -> Checkpoint:
        """Write a new checkpoint with ``entries`` and ``metadata`` (plus ``expected``).

        Returns it once it is complete and durable; then deletes checkpoints older
        than the newest ``keep`` and leftovers of interrupted saves.
        """
        frozen_entries = _freeze_entries(entries)
        meta = dict(_freeze_metadata({} if metadata is None else metadata))
        for key, value in self._expected.items():
            if key in meta and meta[key] != value:
                raise ValueError(
                    f"metadata[{key!r}] is {meta[key]!r} but this store expects {value!r}"
                )
            meta[key] = value
        labels = self.labels()
        sequence = _sequence(labels[-1]) + 1 if labels else 1
        for _ in range(_SAVE_ATTEMPTS):
            label = _label(sequence)
            try:
                checkpoint = self._write(label, frozen_entries, meta)
                break
            except FileExistsError:
                # Debris (a stray file, a dangling symlink) or another job took the
                # name: not ours to remove, so the next number is tried.
                _log.warning(
                    "%s already exists and is not a checkpoint of this job; saving as the "
                    "next one instead",
                    self._where(label),
                )
                sequence += 1
        else:
            raise CheckpointError(
                f"could not write a checkpoint into {self._where()}: the next "
                f"{_SAVE_ATTEMPTS} checkpoint names are all taken by other files; remove them"
            )

        # The new checkpoint is durable: failing to delete old ones must not fail the save.
        try:
            own = [old for old in labels if self._owns(old)]
            for old in [*own, label][: -self._keep]:
                self._storage.remove(old)
            self._storage.cleanup()
        except OSError as exc:
            _log.warning(
                "checkpoint %s was saved, but older checkpoints or leftovers in %s could "
                "not be deleted (%s); they will be retried at the next save",
                label,
                self._where(),
                exc,
            )
        return checkpoint

    def _owns(self, label: str) -> bool:
        """Whether ``label``'s manifest is intact and names this store's job id."""
        try:
            manifest = self._parse_manifest(label, self._read(label, MANIFEST, MAX_MANIFEST_BYTES))
        except (OSError, _Unusable):
            return False  # unknown owner: never removed
        return bool(manifest.get("job_id") == self._job_id)

    def _write(
        self, label: str, frozen_entries: Mapping[str, bytes], meta: dict[str, Any]
    ) -> Checkpoint:
        files: dict[str, bytes] = {}
        listing: dict[str, Any] = {}
        for index, name in enumerate(sorted(frozen_entries)):
            file = f"entry-{index:04d}.bin"
            data = frozen_entries[name]
            files[file] = data
            listing[name] = {
                "file": file,
                "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        body: dict[str, Any] = {
            "schema": SCHEMA,
            "label": label,
            "sequence": _sequence(label),
            "job_id": self._job_id,
            "metadata": meta,
            "entries": listing,
            "created": float(self._clock()),
        }
        body["digest"] = _digest(body)
        files[MANIFEST] = _json_encode(body)  # last: a manifest means the entries are there
        try:
            self._storage.write_directory(label, files)
        except FileExistsError:
            raise
        except OSError as exc:
            raise CheckpointError(
                f"could not write checkpoint {label} into {self._where()} "
                f"({exc.strerror or exc}); check that the directory is writable and has space"
            ) from exc
        return Checkpoint(label, frozen_entries, meta, digest=body["digest"])

    def load(self) -> Checkpoint | None:
        """The newest usable checkpoint, or None when no checkpoint exists at all.

        A damaged newest checkpoint (or one of another job or dataset) is skipped
        with a warning naming what is wrong, and the next older one is tried. If
        checkpoints exist but none is usable, raises CheckpointError saying what is
        wrong with each and which directory to remove.
        """
        labels = self.labels()[::-1]
        problems: list[str] = []
        for i, label in enumerate(labels):
            try:
                return self._load_one(label)
            except _Unusable as exc:
                problem = f"checkpoint {self._where(label)}: {exc}"
                problems.append(problem)
                if isinstance(exc, _Foreign):
                    _log.debug("%s; skipped", problem)
                elif i + 1 < len(labels):
                    _log.warning(
                        "%s; falling back to the older checkpoint %s", problem, labels[i + 1]
                    )
        if not problems:
            return None
        raise CheckpointError(
            f"no usable checkpoint in {self._where()}: "
            + "; ".join(problems)
            + f". Remove these checkpoint directories (or all of {self._where()} to start "
            f"from scratch), or point the job at the checkpoint directory it owns."
        )

    def load_label(self, label: str) -> Checkpoint:
        """Checkpoint ``label``, verified as :meth:`load` verifies; CheckpointError naming it."""
        _check_label(None, None, label)
        if label not in self._list():
            raise CheckpointError(f"checkpoint {self._where(label)} does not exist")
        try:
            return self._load_one(label)
        except _Unusable as exc:
            raise CheckpointError(f"checkpoint {self._where(label)}: {exc}") from None

    def _load_one(self, label: str) -> Checkpoint:
        try:
            raw = self._read(label, MANIFEST, MAX_MANIFEST_BYTES)
        except OSError as exc:
            raise _Unusable(f"{MANIFEST} is missing or unreadable ({exc})") from None
        if len(raw) > MAX_MANIFEST_BYTES:
            raise _Unusable(f"{MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes (damaged)")
        manifest = self._parse_manifest(label, raw)
        self._check_identity(manifest)
        entries: dict[str, bytes] = {}
        for name, info in manifest["entries"].items():
            try:
                data = self._read(label, info["file"], info["size"])
            except OSError as exc:
                raise _Unusable(
                    f"entry {name!r} ({info['file']}) is missing or unreadable ({exc})"
                ) from None
            if len(data) != info["size"]:
                raise _Unusable(
                    f"entry {name!r} ({info['file']}) has "
                    f"{'more than ' if len(data) > info['size'] else ''}"
                    f"{min(len(data), info['size'])} bytes but the manifest "
                    f"says {info['size']} (truncated or overwritten)"
                )
            if hashlib.sha256(data).hexdigest() != info["sha256"]:
                raise _Unusable(
                    f"entry {name!r} ({info['file']}) does not match its SHA-256 in the "
                    f"manifest (damaged or replaced)"
                )
            entries[name] = data
        return Checkpoint(label, entries, manifest["metadata"], digest=manifest["digest"])

    def _parse_manifest(self, label: str, raw: bytes) -> dict[str, Any]:
        try:
            manifest = _json_decode(raw)
        except ValueError:
            raise _Unusable(f"{MANIFEST} is not valid JSON (damaged or truncated)") from None
        if not isinstance(manifest, dict):
            raise _Unusable(f"{MANIFEST} is not a JSON object")
        schema = manifest.get("schema")
        if schema != SCHEMA:
            raise _Unusable(
                f"{MANIFEST} has unknown schema {schema!r} (this version of AdaptDL reads "
                f"{SCHEMA!r})"
            )
        body = {k: v for k, v in manifest.items() if k != "digest"}
        if manifest.get("digest") != _digest(body):
            raise _Unusable(f"{MANIFEST} does not match its checksum (damaged or edited)")
        if manifest.get("label") != label or manifest.get("sequence") != _sequence(label):
            raise _Unusable(
                f"{MANIFEST} describes checkpoint {manifest.get('label')!r}, not {label!r}"
            )
        if not isinstance(manifest.get("metadata"), dict):
            raise _Unusable(f"{MANIFEST} has no metadata object")
        listing = manifest.get("entries")
        if not isinstance(listing, dict):
            raise _Unusable(f"{MANIFEST} has no entries object")
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
                raise _Unusable(f"{MANIFEST} has a malformed record for entry {name!r}")
        return manifest

    def _check_identity(self, manifest: Mapping[str, Any]) -> None:
        if self._job_id is not None and manifest.get("job_id") != self._job_id:
            raise _Foreign(
                f"it belongs to job {manifest.get('job_id')!r}, not to this job {self._job_id!r}"
            )
        metadata = manifest["metadata"]
        for key, value in self._expected.items():
            if key not in metadata:
                raise _Unusable(f"its metadata has no {key!r} (this job has {key}={value!r})")
            if metadata[key] != value:
                raise _Unusable(
                    f"it was written with {key}={metadata[key]!r} but this job has {key}={value!r}"
                )


class MemoryCheckpointStore(CheckpointStore):
    """Checkpoints in a :class:`~adaptdl.core.storage.MemoryStorage`, verified like any store's.

    For the simulator and tests; ``options`` are :class:`CheckpointStore`'s, and
    ``storage`` lets two stores share one memory. :meth:`corrupt` damages a stored
    checkpoint on purpose.
    """

    def __init__(self, *, storage: MemoryStorage | None = None, **options: Any) -> None:
        super().__init__(MemoryStorage() if storage is None else storage, **options)

    def __repr__(self) -> str:
        return f"MemoryCheckpointStore(keep={self._keep}, job_id={self._job_id!r})"

    @property
    def storage(self) -> MemoryStorage:
        """The memory the checkpoints live in."""
        assert isinstance(self._storage, MemoryStorage)
        return self._storage

    def corrupt(self, label: str, entry: str | None = None, data: bytes | None = None) -> None:
        """Replace the bytes of ``entry`` (the manifest if None) of checkpoint ``label``.

        With ``data`` None, the first byte is flipped (an empty file gains a byte).
        """
        if label not in self._list():
            raise KeyError(f"no checkpoint {label!r}; have {self.labels()}")
        if entry is None:
            file = MANIFEST
        else:
            listing = _json_decode(self._read(label, MANIFEST, MAX_MANIFEST_BYTES))["entries"]
            if entry not in listing:
                raise KeyError(f"checkpoint {label} has no entry {entry!r}; has {sorted(listing)}")
            file = listing[entry]["file"]
        if data is None:
            old = self._storage.read(f"{label}/{file}")
            data = bytes([old[0] ^ 0xFF]) + old[1:] if old else b"\0"
        self.storage.put(f"{label}/{file}", data)
