"""Checkpoints: the :class:`State` protocol and stores that write a whole checkpoint atomically.

A checkpoint is a set of named byte strings (one per :class:`State`) plus a little
JSON metadata, saved under a label ``ckpt-NNNNNN`` whose number grows with every
save, in the format `adaptdl.core.persist.manifest` describes. A store keeps the newest
``keep`` checkpoints. Loading verifies everything (manifest schema and checksum,
size and SHA-256 of every entry, job id, expected metadata such as the dataset
length) and falls back to an older checkpoint, with a logged warning, when the
newest is damaged. Nothing is ever unpickled: entries are bytes and the manifest
is JSON, so loading a checkpoint cannot run code.

The bytes live on a :class:`~adaptdl.core.persist.storage.Storage`. On disk
(:class:`CheckpointStore` on a directory)::

    root/
      ckpt-000011/  manifest.json  entry-0000.bin  entry-0001.bin ...
      ckpt-000012/  ...
      .tmp-...      leftovers of a crash: ignored by load, removed by the next save

A checkpoint is one atomic directory write of the storage (manifest last): a
crash at any instant leaves either the new complete checkpoint or none of it.

Concurrency: one process (rank 0) writes; any number of processes may read at the
same time (a checkpoint appears and disappears by a rename). A job holds its
directory with :meth:`~adaptdl.core.persist.storage.Storage.lock`; should two jobs
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
import time
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs

# The collective wire format is the project's one canonical JSON (sorted keys, ASCII,
# NaN/Infinity allowed for metrics); checkpoints use the same, with the same checks.
from adaptdl.core.collective import Collective
from adaptdl.core.collective import decode as _json_decode
from adaptdl.core.collective import encode as _json_encode
from adaptdl.core.persist.localfs import LocalStorage
from adaptdl.core.persist.manifest import (
    LABEL,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    Foreign,
    Unusable,
    check_label,
    label_of,
    layout,
    parse_manifest,
    sequence_of,
)
from adaptdl.core.persist.storage import MemoryStorage, Storage
from adaptdl.core.validate import check_int

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointStore",
    "CollectiveState",
    "JsonState",
    "MemoryCheckpointStore",
    "SavableAlone",
    "State",
]

_SAVE_ATTEMPTS = 100  # names taken by debris that a save skips before giving up

_log = logging.getLogger("adaptdl.core.persist.checkpoint")


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


@runtime_checkable
class SavableAlone(State, Protocol):
    """A state whose entry rank 0 can make by itself, with no other replica taking part.

    A `CollectiveState` (or a `~adaptdl.core.persist.shardedfiles.FileState`) needs every
    replica to save it; where the replicas are not at one agreed point (a stop
    outside any loop that could not wait for them, `Job.stop_overdue`), rank 0 may
    still write a checkpoint
    alone if each such state is also a `SavableAlone`: its entry is then
    :meth:`bytes_alone`, not :meth:`to_bytes`.
    """

    def bytes_alone(self) -> bytes:
        """The entry rank 0 saves on its own: no collective, and :meth:`from_bytes` reads it."""
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
    check_label(label)


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
        return sequence_of(self.label)


# --------------------------------------------------------------------------- stores


class CheckpointStore:
    """Checkpoints on a :class:`~adaptdl.core.persist.storage.Storage`; see the module docstring.

    ``root`` is a directory (a :class:`~adaptdl.core.persist.localfs.LocalStorage` there,
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

    @property
    def pending(self) -> bool:
        """Whether a checkpoint is still being written in the background (never, here)."""
        return False

    def wait(self, collective: Collective | None = None) -> None:
        """Return once no checkpoint is being written in the background (at once, here)."""

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
        return [name for name in names if LABEL.match(name)]

    def _read(self, label: str, file: str, size: int) -> bytes:
        """At most ``size`` + 1 bytes: one more than expected shows a file grew."""
        return self._storage.read(f"{label}/{file}", limit=size + 1)

    def _where(self, label: str | None = None) -> str:
        return self._storage.describe(label)

    # ---- public interface

    def labels(self) -> list[str]:
        """Labels of the complete checkpoints, oldest first (damaged ones included)."""
        return sorted(self._list(), key=sequence_of)

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
        frozen_entries, meta, labels = self._prepare(entries, metadata)
        sequence = sequence_of(labels[-1]) + 1 if labels else 1
        for _ in range(_SAVE_ATTEMPTS):
            label = label_of(sequence)
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
            raise self._names_taken()
        self._prune(labels, label)
        return checkpoint

    def _names_taken(self) -> CheckpointError:
        """The error when every one of the next `_SAVE_ATTEMPTS` names is taken by debris."""
        return CheckpointError(
            f"could not write a checkpoint into {self._where()}: the next "
            f"{_SAVE_ATTEMPTS} checkpoint names are all taken by other files; remove them"
        )

    def _prepare(
        self, entries: Mapping[str, bytes], metadata: Mapping[str, Any] | None
    ) -> tuple[Mapping[str, bytes], dict[str, Any], list[str]]:
        """The checked entries, the metadata with ``expected``, and the labels saved so far."""
        frozen_entries = _freeze_entries(entries)
        meta = dict(_freeze_metadata({} if metadata is None else metadata))
        for key, value in self._expected.items():
            if key in meta and meta[key] != value:
                raise ValueError(
                    f"metadata[{key!r}] is {meta[key]!r} but this store expects {value!r}"
                )
            meta[key] = value
        return frozen_entries, meta, self.labels()

    def _prune(self, labels: list[str], label: str) -> None:
        """After ``label`` is durable: delete own checkpoints beyond ``keep``, and leftovers."""
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

    def _owns(self, label: str) -> bool:
        """Whether ``label``'s manifest is intact and names this store's job id."""
        try:
            manifest = parse_manifest(label, self._read(label, MANIFEST, MAX_MANIFEST_BYTES))
        except (OSError, Unusable):
            return False  # unknown owner: never removed
        return bool(manifest.get("job_id") == self._job_id)

    def _write(
        self, label: str, frozen_entries: Mapping[str, bytes], meta: dict[str, Any]
    ) -> Checkpoint:
        # The manifest comes last in `files`: a manifest means the entries are there.
        files, digest = layout(
            label, frozen_entries, job_id=self._job_id, metadata=meta, created=self._clock()
        )
        try:
            self._storage.write_directory(label, files)
        except FileExistsError:
            raise
        except OSError as exc:
            raise CheckpointError(
                f"could not write checkpoint {label} into {self._where()} "
                f"({exc.strerror or exc}); check that the directory is writable and has space"
            ) from exc
        return Checkpoint(label, frozen_entries, meta, digest=digest)

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
            except Unusable as exc:
                problem = f"checkpoint {self._where(label)}: {exc}"
                problems.append(problem)
                if isinstance(exc, Foreign):
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
        check_label(label)
        if label not in self._list():
            raise CheckpointError(f"checkpoint {self._where(label)} does not exist")
        try:
            return self._load_one(label)
        except Unusable as exc:
            raise CheckpointError(f"checkpoint {self._where(label)}: {exc}") from None

    def _load_one(self, label: str) -> Checkpoint:
        try:
            raw = self._read(label, MANIFEST, MAX_MANIFEST_BYTES)
        except OSError as exc:
            raise Unusable(f"{MANIFEST} is missing or unreadable ({exc})") from None
        if len(raw) > MAX_MANIFEST_BYTES:
            raise Unusable(f"{MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes (damaged)")
        manifest = parse_manifest(label, raw)
        self._check_identity(manifest)
        entries: dict[str, bytes] = {}
        for name, info in manifest["entries"].items():
            try:
                data = self._read(label, info["file"], info["size"])
            except OSError as exc:
                raise Unusable(
                    f"entry {name!r} ({info['file']}) is missing or unreadable ({exc})"
                ) from None
            if len(data) != info["size"]:
                raise Unusable(
                    f"entry {name!r} ({info['file']}) has "
                    f"{'more than ' if len(data) > info['size'] else ''}"
                    f"{min(len(data), info['size'])} bytes but the manifest "
                    f"says {info['size']} (truncated or overwritten)"
                )
            if hashlib.sha256(data).hexdigest() != info["sha256"]:
                raise Unusable(
                    f"entry {name!r} ({info['file']}) does not match its SHA-256 in the "
                    f"manifest (damaged or replaced)"
                )
            entries[name] = data
        return Checkpoint(label, entries, manifest["metadata"], digest=manifest["digest"])

    def _check_identity(self, manifest: Mapping[str, Any]) -> None:
        if self._job_id is not None and manifest.get("job_id") != self._job_id:
            raise Foreign(
                f"it belongs to job {manifest.get('job_id')!r}, not to this job {self._job_id!r}"
            )
        metadata = manifest["metadata"]
        for key, value in self._expected.items():
            if key not in metadata:
                raise Unusable(f"its metadata has no {key!r} (this job has {key}={value!r})")
            if metadata[key] != value:
                raise Unusable(
                    f"it was written with {key}={metadata[key]!r} but this job has {key}={value!r}"
                )


class MemoryCheckpointStore(CheckpointStore):
    """Checkpoints in a :class:`~adaptdl.core.persist.storage.MemoryStorage`, verified as any are.

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
