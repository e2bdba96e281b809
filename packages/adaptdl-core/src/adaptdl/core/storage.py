"""Where checkpoints and the journal keep their bytes: a small storage protocol.

A :class:`Storage` holds *directories* of files, each written whole and
atomically (it appears complete or not at all, and survives a machine crash once
written), and single *files* overwritten in place (cheap, not flushed to disk).
The checkpoint store (:mod:`adaptdl.core.checkpoint`) and the journal
(:mod:`adaptdl.core.journal`) are built on it and know nothing of ``os``; a test
or a fault-injection harness hands them another storage (a full disk, a slow
write) instead of patching them.

Names are relative, ``/``-separated paths chosen by the callers (``ckpt-000012``,
``ckpt-000012/manifest.json``, ``progress.journal``); names starting with
:data:`TMP_PREFIX` belong to the storage itself (directories being written or
removed) and are never listed.

Implementations: :class:`LocalStorage` (a directory of the local file system) and
:class:`MemoryStorage` (for the simulator and tests).
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

__all__ = ["TMP_PREFIX", "LocalStorage", "MemoryStorage", "Storage"]

TMP_PREFIX = ".tmp-"
"""Names the storage uses for its own work in progress; never listed."""


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
        """The bytes of file ``name`` (at most ``limit`` of them)."""
        ...

    def write_directory(self, name: str, files: Mapping[str, bytes]) -> None:
        """Create directory ``name`` with ``files``, written in their order, atomically.

        Returns once the directory is complete and durable; on failure none of it
        is visible.
        """
        ...

    def remove(self, name: str) -> None:
        """Delete directory ``name``, which this storage wrote (it stops being listed at once)."""
        ...

    def cleanup(self) -> None:
        """Delete leftovers of interrupted writes and removals."""
        ...

    def overwrite(self, name: str, data: bytes) -> None:
        """Write ``data`` over the start of file ``name`` (created when absent), not flushed."""
        ...

    def close(self) -> None:
        """Release what :meth:`overwrite` keeps open."""
        ...


class LocalStorage:
    """A directory ``root`` of the local file system (created when first written).

    A directory is written under a temporary name, every file and the directory
    flushed to disk, then renamed into place, so a crash at any instant leaves all
    of it or none. Every new file goes through :meth:`write_durably`, the one place
    a subclass injects faults into writes.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        if not isinstance(root, (str, os.PathLike)):
            raise TypeError(f"root must be a path, got {root!r}")
        self._root = Path(root)
        self._open: dict[str, int] = {}

    @property
    def root(self) -> Path:
        """The directory."""
        return self._root

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self._root)!r})"

    def describe(self, name: str | None = None) -> str:
        return f"'{self._root if name is None else self._root / name}'"

    @staticmethod
    def write_durably(path: Path, data: bytes) -> None:
        """Create the new file ``path`` holding ``data`` and flush it to disk."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    def check_writable(self) -> None:
        probe = self._root / f"{TMP_PREFIX}probe-{secrets.token_hex(4)}"
        os.makedirs(self._root, exist_ok=True)
        self.write_durably(probe, b"probe")
        os.unlink(probe)

    def list(self) -> list[str]:
        try:
            names = os.listdir(self._root)
        except FileNotFoundError:
            return []
        return [n for n in names if not n.startswith(TMP_PREFIX) and (self._root / n).is_dir()]

    def read(self, name: str, limit: int | None = None) -> bytes:
        with open(self._root / name, "rb") as f:
            return f.read() if limit is None else f.read(limit)

    @staticmethod
    def _fsync_dir(path: Path) -> None:
        # A directory's entries (new files, a rename) are durable only once it is synced.
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def write_directory(self, name: str, files: Mapping[str, bytes]) -> None:
        tmp = self._root / f"{TMP_PREFIX}{name}-{secrets.token_hex(4)}"
        try:
            os.makedirs(self._root, exist_ok=True)
            os.mkdir(tmp)
            for file, data in files.items():
                self.write_durably(tmp / file, data)
            self._fsync_dir(tmp)
            os.rename(tmp, self._root / name)
            self._fsync_dir(self._root)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def remove(self, name: str) -> None:
        # Renamed out of the listed namespace first, so an interrupted delete
        # leaves a leftover for the next cleanup, never a half-deleted directory.
        doomed = self._root / f"{TMP_PREFIX}del-{name}-{secrets.token_hex(4)}"
        os.rename(self._root / name, doomed)
        shutil.rmtree(doomed, ignore_errors=True)

    def cleanup(self) -> None:
        for name in os.listdir(self._root):
            if name.startswith(TMP_PREFIX):
                path = self._root / name
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)

    def overwrite(self, name: str, data: bytes) -> None:
        fd = self._open.get(name)
        if fd is None:
            fd = self._open[name] = os.open(self._root / name, os.O_WRONLY | os.O_CREAT, 0o644)
        os.pwrite(fd, data, 0)

    def close(self) -> None:
        while self._open:
            os.close(self._open.popitem()[1])


class MemoryStorage:
    """Directories and files held in memory; :meth:`put` replaces a file's bytes (for tests)."""

    def __init__(self) -> None:
        self._directories: dict[str, dict[str, bytes]] = {}
        self._files: dict[str, bytes] = {}

    def __repr__(self) -> str:
        return f"MemoryStorage({len(self._directories)} directories)"

    def describe(self, name: str | None = None) -> str:
        return "the memory store" if name is None else name

    def check_writable(self) -> None:
        """Memory is always writable."""

    def list(self) -> list[str]:
        return list(self._directories)

    def _split(self, name: str) -> tuple[dict[str, bytes], str]:
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
        return data if limit is None else data[:limit]

    def put(self, name: str, data: bytes) -> None:
        """Replace the bytes of the existing file ``name`` (to damage it on purpose)."""
        files, file = self._split(name)
        if file not in files:
            raise FileNotFoundError(f"no file {name!r}")
        files[file] = bytes(data)

    def write_directory(self, name: str, files: Mapping[str, bytes]) -> None:
        self._directories[name] = {file: bytes(data) for file, data in files.items()}

    def remove(self, name: str) -> None:
        del self._directories[name]

    def cleanup(self) -> None:
        """Nothing is ever left over."""

    def overwrite(self, name: str, data: bytes) -> None:
        old = self._files.get(name, b"")
        self._files[name] = bytes(data) + old[len(data) :]

    def close(self) -> None:
        """Nothing is held open."""
