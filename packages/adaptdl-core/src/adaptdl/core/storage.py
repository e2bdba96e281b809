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

A checkpoint directory may be shared by mistake (a reused template) or hold files
planted by whoever can write it. :class:`LocalStorage` therefore opens every file
without following symlinks and refuses anything but a regular file (a FIFO, a
device, a directory), reads at most what the caller allows, tags its leftovers
with its ``owner`` so that :meth:`~Storage.cleanup` removes only its own, and
offers :meth:`LocalStorage.lock`, held for the life of the job (until
:meth:`LocalStorage.unlock`), so that a second job on the same directory is
refused at start.

Implementations: :class:`LocalStorage` (a directory of the local file system) and
:class:`MemoryStorage` (for the simulator and tests).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import mmap
import os
import secrets
import shutil
import socket
import stat
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

__all__ = [
    "LOCK",
    "TMP_PREFIX",
    "LocalStorage",
    "MappableStorage",
    "MemoryStorage",
    "Storage",
    "StorageLocked",
]

TMP_PREFIX = ".tmp-"
"""Names the storage uses for its own work in progress; never listed."""

LOCK = "adaptdl.lock"
"""The lock file :meth:`LocalStorage.lock` holds in its directory."""

_LOCK_POLL = 0.1  # seconds between attempts while a previous run of the same job holds it


class StorageLocked(RuntimeError):
    """Another job (or a previous run of this one that did not let go) holds the directory."""


def owner_tag(owner: str) -> str:
    """A short file-name-safe tag of ``owner`` (any string, a job id)."""
    return hashlib.sha256(owner.encode("utf-8")).hexdigest()[:12]


def open_regular(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` without following a symlink and without blocking on a FIFO.

    Raises OSError unless ``path`` is a regular file: a symlink (ELOOP), a FIFO, a
    device, a socket or a directory in its place is damage, never followed.
    """
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


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
        """Release what :meth:`overwrite` keeps open."""
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


class LocalStorage:
    """A directory ``root`` of the local file system (created when first written).

    A directory is written under a temporary name, every file and the directory
    flushed to disk, then renamed into place, so a crash at any instant leaves all
    of it or none. Every new file goes through :meth:`write_durably`, the one place
    a subclass injects faults into writes.

    ``owner`` (a job id) tags the temporary names, so that :meth:`cleanup` removes
    only this owner's leftovers, never another job's save in progress; None
    removes every leftover (a directory known to hold one job).
    """

    def __init__(self, root: str | os.PathLike[str], *, owner: str | None = None) -> None:
        if not isinstance(root, (str, os.PathLike)):
            raise TypeError(f"root must be a path, got {root!r}")
        if owner is not None and not isinstance(owner, str):
            raise TypeError(f"owner must be a str or None, got {owner!r}")
        self._root = Path(root)
        self._owner = owner
        self._tag = owner_tag(owner) if owner is not None else None
        self._open: dict[str, int] = {}
        self._maps: dict[str, mmap.mmap] = {}
        self._lock_fd: int | None = None

    @property
    def owner(self) -> str | None:
        """Whose leftovers :meth:`cleanup` removes (None: everyone's)."""
        return self._owner

    @property
    def tag(self) -> str | None:
        """The tag of :attr:`owner` in temporary names."""
        return self._tag

    def _tmp(self, what: str) -> Path:
        tagged = what if self._tag is None else f"{self._tag}.{what}"
        return self._root / f"{TMP_PREFIX}{tagged}-{secrets.token_hex(4)}"

    def _mine(self, name: str) -> bool:
        return self._tag is None or name.startswith(f"{TMP_PREFIX}{self._tag}.")

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
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    def check_writable(self) -> None:
        probe = self._tmp("probe")
        os.makedirs(self._root, exist_ok=True)
        self.write_durably(probe, b"probe")
        os.unlink(probe)

    def list(self) -> list[str]:
        try:
            names = os.listdir(self._root)
        except FileNotFoundError:
            return []
        # A symlink is never a directory this storage wrote: not listed, never followed.
        return [n for n in names if not n.startswith(TMP_PREFIX) and self._is_dir(n)]

    def _is_dir(self, name: str) -> bool:
        try:
            return stat.S_ISDIR(os.lstat(self._root / name).st_mode)
        except FileNotFoundError:  # removed since it was listed (by another job)
            return False

    def read(self, name: str, limit: int | None = None) -> bytes:
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be >= 0 or None, got {limit!r}")
        # A checkpoint directory in the path that is a symlink is damage too.
        directory, _, _ = name.rpartition("/")
        if directory and not stat.S_ISDIR(os.lstat(self._root / directory).st_mode):
            raise OSError(errno.ENOTDIR, "not a directory", str(self._root / directory))
        fd = open_regular(self._root / name, os.O_RDONLY)
        try:
            with os.fdopen(fd, "rb", closefd=False) as f:
                return f.read() if limit is None else f.read(limit)
        finally:
            os.close(fd)

    @staticmethod
    def _fsync_dir(path: Path) -> None:
        # A directory's entries (new files, a rename) are durable only once it is synced.
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def write_directory(self, name: str, files: Mapping[str, bytes]) -> None:
        target = self._root / name
        if os.path.lexists(target):
            raise FileExistsError(errno.EEXIST, "name already taken", str(target))
        tmp = self._tmp(name)
        try:
            os.makedirs(self._root, exist_ok=True)
            os.mkdir(tmp)
            for file, data in files.items():
                self.write_durably(tmp / file, data)
            self._fsync_dir(tmp)
            if os.path.lexists(target):  # appeared meanwhile: rename would replace an empty dir
                raise FileExistsError(errno.EEXIST, "name already taken", str(target))
            os.rename(tmp, target)
            self._fsync_dir(self._root)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def remove(self, name: str) -> None:
        # Renamed out of the listed namespace first, so an interrupted delete
        # leaves a leftover for the next cleanup, never a half-deleted directory.
        doomed = self._tmp(f"del-{name}")
        os.rename(self._root / name, doomed)
        shutil.rmtree(doomed, ignore_errors=True)

    def cleanup(self) -> None:
        for name in os.listdir(self._root):
            if name.startswith(TMP_PREFIX) and self._mine(name):
                path = self._root / name
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)

    def overwrite(self, name: str, data: bytes) -> None:
        fd = self._open.get(name)
        if fd is None:
            path = self._root / name
            try:
                # Read-write: `mapped` maps the same descriptor, and a shared map needs both.
                fd = open_regular(path, os.O_RDWR | os.O_CREAT)
            except OSError:
                # Not a regular file (a planted symlink, a FIFO): the name is this
                # storage's own file, so the debris is replaced, never written through.
                # Any other failure (EMFILE, EACCES, EIO) keeps the file it could not open.
                try:
                    mode = os.lstat(path).st_mode
                    debris = not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))
                except FileNotFoundError:
                    debris = False
                if not debris:
                    raise
                os.unlink(path)
                fd = open_regular(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
            self._open[name] = fd
        os.pwrite(fd, data, 0)

    def mapped(self, name: str, size: int) -> mmap.mmap:
        """A shared memory map of the first ``size`` bytes of the file :meth:`overwrite` wrote.

        Its writes land in the page cache, like :meth:`overwrite`'s, so they outlive
        the process but not the machine. Raises OSError if ``name`` was not written
        by :meth:`overwrite` or is shorter than ``size``.
        """
        view = self._maps.get(name)
        if view is None or len(view) != size:
            fd = self._open.get(name)
            if fd is None:
                raise FileNotFoundError(errno.ENOENT, "not written by overwrite()", name)
            if os.fstat(fd).st_size < size:
                raise OSError(errno.EINVAL, f"shorter than {size} bytes", name)
            if view is not None:
                view.close()
            view = self._maps[name] = mmap.mmap(fd, size)
        return view

    def lock(self, wait: float) -> None:
        """Hold the directory for this owner until :meth:`unlock` or the process ends.

        An exclusive ``flock`` on :data:`LOCK` (created, never followed if a
        symlink), which records the owner, its host and process. When another
        owner holds it, raises :class:`StorageLocked` at once naming the directory
        and that owner; when a previous run of the same owner still holds it (a
        relaunch while it is finishing a save), retries for up to ``wait`` seconds
        and then raises.
        """
        if self._lock_fd is not None:
            return
        os.makedirs(self._root, exist_ok=True)
        path = self._root / LOCK
        fd = open_regular(path, os.O_RDWR | os.O_CREAT)
        deadline = time.monotonic() + wait
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    holder = self._holder(fd)
                    if holder.get("job_id") != self._owner and "job_id" in holder:
                        raise StorageLocked(
                            f"checkpoint directory {self.describe()} is in use by job "
                            f"{holder.get('job_id')!r} ({self._where(holder)}); give each job its "
                            "own checkpoint directory (ADAPTDL_CHECKPOINT_PATH)"
                        ) from None
                    if time.monotonic() >= deadline:
                        raise StorageLocked(
                            f"checkpoint directory {self.describe()} is still held by a previous "
                            f"run of job {self._owner!r} ({self._where(holder)}) after waiting "
                            f"{wait:g} s; stop that run (or wait for it to finish) and relaunch"
                        ) from None
                    time.sleep(_LOCK_POLL)
            record = {"job_id": self._owner, "host": socket.gethostname(), "pid": os.getpid()}
            data = json.dumps(record, sort_keys=True).encode("utf-8")
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
        except BaseException:
            os.close(fd)  # releases the lock if it was taken
            raise
        self._lock_fd = fd

    @staticmethod
    def _holder(fd: int) -> dict[str, object]:
        try:
            record = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
        except (OSError, ValueError, RecursionError):
            return {}
        return record if isinstance(record, dict) else {}

    @staticmethod
    def _where(holder: dict[str, object]) -> str:
        return f"process {holder.get('pid', '?')} on host {holder.get('host', '?')!s}"

    def close(self) -> None:
        """Close the files :meth:`overwrite` keeps open and the maps of :meth:`mapped`
        (the :meth:`lock` stays held)."""
        while self._maps:
            self._maps.popitem()[1].close()
        while self._open:
            os.close(self._open.popitem()[1])

    def unlock(self) -> None:
        """Release the :meth:`lock` (the end of the process releases it too)."""
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            os.close(fd)


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
