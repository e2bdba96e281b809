"""Where checkpoints and the journal keep their bytes: a small storage protocol.

A :class:`Storage` holds *directories* of files, each written whole and
atomically (it appears complete or not at all, and survives a machine crash once
written), and single *files* overwritten in place (cheap, not flushed to disk);
it is held by one job at a time (:meth:`~Storage.lock`). The checkpoint store
(:mod:`adaptdl.core.persist.checkpoint`), the sharded store
(:mod:`adaptdl.core.persist.shardedfiles`) and the journal (:mod:`adaptdl.core.persist.journal`)
are built on it and know nothing of ``os``; a test or a fault-injection harness
hands them another storage (a full disk, a slow write, a lost write) instead of
patching them.

Two optional capabilities extend it, each a protocol of its own:
:class:`MappableStorage` (files written through memory, for the journal) and
:class:`StagingStorage` (a directory filled beforehand, file by file, by every
replica, then committed as one: the files of sharded states, which torch's
distributed checkpoint writes itself).

Names are relative, ``/``-separated paths chosen by the callers (``ckpt-000012``,
``ckpt-000012/manifest.json``, ``progress.journal``); names starting with
:data:`TMP_PREFIX` belong to the storage itself (directories being written,
staged or removed) and are never listed.

Implementations: :class:`~adaptdl.core.persist.localfs.LocalStorage` (a directory of the
local file system, in :mod:`adaptdl.core.persist.localfs`, the one module of core that
touches files) and :class:`MemoryStorage` (for the simulator and tests).
"""

from __future__ import annotations

import errno
import hashlib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, runtime_checkable

import attrs

if TYPE_CHECKING:  # the type of a mapped file only
    import mmap

__all__ = [
    "LOCK",
    "TMP_PREFIX",
    "FileRecord",
    "MappableStorage",
    "MemoryStorage",
    "StagingStorage",
    "Storage",
    "StorageLocked",
    "check_name",
    "owner_tag",
]

TMP_PREFIX = ".tmp-"
"""Names the storage uses for its own work in progress; never listed."""

LOCK = "adaptdl.lock"
"""The lock file :meth:`~adaptdl.core.persist.localfs.LocalStorage.lock` holds in its directory."""

# A file or state name inside a checkpoint: one path component, never "." or "..".
_NAME = re.compile(r"(?!\.\.?\Z)[A-Za-z0-9_.-]{1,200}\Z")
_SHA256 = re.compile(r"[0-9a-f]{64}\Z")


class StorageLocked(RuntimeError):
    """Another job (or a previous run of this one that did not let go) holds the directory."""


def owner_tag(owner: str) -> str:
    """A short file-name-safe tag of ``owner`` (any string, a job id)."""
    return hashlib.sha256(owner.encode("utf-8")).hexdigest()[:12]


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


@runtime_checkable
class Storage(Protocol):
    """Named directories written atomically, and single files overwritten in place.

    Every method raises OSError (``FileNotFoundError`` for a missing name) when the
    underlying medium fails; callers translate it into their own errors.
    """

    def describe(self, name: str | None = None) -> str:
        """Where ``name`` (or the whole storage) lives, quoted for messages."""
        ...

    def check_writable(self) -> None:
        """Write and remove a probe now; OSError if that fails."""
        ...

    def list(self) -> list[str]:
        """The complete directories, in any order (an absent storage has none)."""
        ...

    def read(self, name: str, limit: int | None = None) -> bytes:
        """The bytes of file ``name`` (at most ``limit`` of them).

        A name that is not a regular file (a symlink, a FIFO, a directory) raises
        OSError rather than being followed or blocking.
        """
        ...

    def write_directory(self, name: str, files: Mapping[str, bytes]) -> None:
        """Create directory ``name`` with ``files``, written in their order, atomically.

        Returns once the directory is complete and durable; on failure none of it
        is visible. Raises FileExistsError, writing nothing, when anything (even a
        file or a dangling symlink) already has the name.
        """
        ...

    def remove(self, name: str) -> None:
        """Delete directory ``name``, which this storage wrote (it stops being listed at once)."""
        ...

    def cleanup(self) -> None:
        """Delete leftovers of this storage's own interrupted writes and removals."""
        ...

    def overwrite(self, name: str, data: bytes) -> None:
        """Write ``data`` over the start of file ``name`` (created when absent), not flushed."""
        ...

    def close(self) -> None:
        """Release what :meth:`overwrite` keeps open (the :meth:`lock` stays held)."""
        ...

    def lock(self, wait: float) -> None:
        """Hold the storage for its owner (a job) until :meth:`unlock` or the process ends.

        Raises :class:`StorageLocked` at once, naming the storage and the holder,
        when another owner holds it; when a previous run of the same owner still
        holds it (a relaunch while it is finishing a save), retries for up to
        ``wait`` seconds and then raises. Holding it already is no error.
        """
        ...

    def unlock(self) -> None:
        """Release the :meth:`lock` (the end of the process releases it too)."""
        ...


@runtime_checkable
class MappableStorage(Storage, Protocol):
    """A storage whose overwritten files can also be written through memory.

    Optional: the journal writes through :meth:`mapped` where a storage offers it,
    and through :meth:`~Storage.overwrite` otherwise.
    """

    def mapped(self, name: str, size: int) -> mmap.mmap | bytearray:
        """The first ``size`` bytes of file ``name``, writable in place.

        The file must exist, written by :meth:`~Storage.overwrite`, with at least
        ``size`` bytes. A write to the buffer reaches the file without a system call
        and outlives the process, as an :meth:`~Storage.overwrite` does; :meth:`close`
        releases it. Raises OSError when the file cannot be mapped.
        """
        ...


@runtime_checkable
class StagingStorage(Storage, Protocol):
    """A storage whose next directory every replica fills beforehand, file by file.

    The files of a sharded state are written by every replica, each its own,
    before rank 0 writes the checkpoint (`adaptdl.core.persist.shardedfiles`): they go
    into a *staging* directory (:meth:`stage`, a leftover name that the next
    :meth:`~Storage.cleanup` removes if the save dies), and after :meth:`adopt`
    the next :meth:`~Storage.write_directory` writes its files beside them and
    makes the whole directory appear at once, or none of it.

    A file goes in through :meth:`create`, where a storage may fail or damage
    the write as any other. A writer that must handle files itself (torch's
    distributed checkpoint renames its metadata into place; its reader opens
    the files it reads) gets the directory's :meth:`local_path`.
    """

    def stage(self, token: str, *parts: str) -> str:
        """The name of the staging directory for ``token`` (the same on every replica).

        With ``parts``, of its subdirectory ``token/parts...``. Created (with its
        parents) if absent; ``token`` and each part are single names
        (:func:`check_name`).
        """
        ...

    def create(self, name: str) -> BinaryIO:
        """A new file ``name`` in a staged directory, open for writing.

        Raises OSError if anything has the name already. The file is durable once
        the directory is committed (:meth:`adopt`), not when it is closed.
        """
        ...

    def digest(self, name: str, limit: int | None = None) -> FileRecord:
        """Size and SHA-256 of the regular file ``name`` (reading at most ``limit`` + 1 bytes).

        Anything but a regular file, or a path through anything but directories,
        raises OSError rather than being followed.
        """
        ...

    def taken(self, name: str) -> bool:
        """Whether anything (a file, a directory, even a dangling symlink) has ``name``."""
        ...

    def local_path(self, name: str) -> Path:
        """Where ``name`` lies on the local file system, for a writer or reader that must
        handle the files itself (its files there bypass :meth:`create`)."""
        ...

    def adopt(self, staged: str | None) -> None:
        """Have the next :meth:`~Storage.write_directory` take staged directory ``staged``.

        It writes its files into ``staged``, beside what the replicas put there,
        makes every directory in it durable, and gives it its name. None: stop adopting.
        """
        ...


class MemoryStorage:
    """Directories and files held in memory; :meth:`put` replaces a file's bytes (for tests)."""

    def __init__(self) -> None:
        self._directories: dict[str, dict[str, bytes | bytearray]] = {}
        # A file handed out by `mapped` is a bytearray, changed in place by its holder.
        self._files: dict[str, bytes | bytearray] = {}

    def __repr__(self) -> str:
        return f"MemoryStorage({len(self._directories)} directories)"

    def describe(self, name: str | None = None) -> str:
        return "the memory store" if name is None else name

    def check_writable(self) -> None:
        """Memory is always writable."""

    def list(self) -> list[str]:
        return list(self._directories)

    def _split(self, name: str) -> tuple[dict[str, bytes | bytearray], str]:
        directory, _, file = name.rpartition("/")
        if not directory:
            return self._files, file
        try:
            return self._directories[directory], file
        except KeyError:
            raise FileNotFoundError(f"no directory {directory!r}") from None

    def read(self, name: str, limit: int | None = None) -> bytes:
        files, file = self._split(name)
        try:
            data = files[file]
        except KeyError:
            raise FileNotFoundError(f"no file {name!r}") from None
        return bytes(data if limit is None else data[:limit])

    def put(self, name: str, data: bytes) -> None:
        """Replace the bytes of the existing file ``name`` (to damage it on purpose)."""
        files, file = self._split(name)
        if file not in files:
            raise FileNotFoundError(f"no file {name!r}")
        if isinstance(files[file], bytearray):  # mapped: damage the buffer its holder writes
            files[file][:] = data  # type: ignore[index]
        else:
            files[file] = bytes(data)

    def write_directory(self, name: str, files: Mapping[str, bytes]) -> None:
        if name in self._directories or name in self._files:
            raise FileExistsError(f"{name!r} already exists")
        self._directories[name] = {file: bytes(data) for file, data in files.items()}

    def remove(self, name: str) -> None:
        del self._directories[name]

    def cleanup(self) -> None:
        """Nothing is ever left over."""

    def overwrite(self, name: str, data: bytes) -> None:
        old = self._files.get(name, b"")
        new = bytes(data) + old[len(data) :]
        if isinstance(old, bytearray):  # mapped: its holder keeps writing this very buffer
            old[:] = new
        else:
            self._files[name] = new

    def mapped(self, name: str, size: int) -> bytearray:
        """The file's bytes as a bytearray that stays the file: writes to it are the file's."""
        data = self._files.get(name)
        if data is None:
            raise FileNotFoundError(f"no file {name!r}: write it with overwrite() first")
        if len(data) < size:
            raise OSError(errno.EINVAL, f"shorter than {size} bytes", name)
        if not isinstance(data, bytearray):
            data = self._files[name] = bytearray(data)
        return data

    def close(self) -> None:
        """Nothing is held open."""

    def lock(self, wait: float) -> None:
        """Memory is this process's alone: it is always held."""

    def unlock(self) -> None:
        """Nothing to release."""
