"""The one module of core that touches the local file system.

Everything core does with files is here: :class:`LocalStorage` (the
:class:`~adaptdl.core.persist.storage.Storage` of a local directory, with its lock, its
staging of sharded files and its memory-mapped journal file), and the few file
primitives the adapters share (:func:`open_regular`, :func:`file_record`,
:func:`exclusive`, :func:`replace_durably`). The rest of core reaches files only
through a storage handed to it, so that a test or a fault-injection harness can
hand it another one (``tests/core/test_localfs.py`` checks that no other module
of core imports ``os``'s file functions, ``fcntl``, ``mmap`` or ``shutil``, or
calls ``open``).

A checkpoint directory may be shared by mistake (a reused template) or hold files
planted by whoever can write it. :class:`LocalStorage` therefore opens every file
without following symlinks and refuses anything but a regular file (a FIFO, a
device, a directory), reads at most what the caller allows, tags its leftovers
with its ``owner`` so that :meth:`~LocalStorage.cleanup` removes only its own, and
holds :meth:`~LocalStorage.lock` for the life of the job (until
:meth:`~LocalStorage.unlock`), so that a second job on the same directory is
refused at start.
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import BinaryIO

from adaptdl.core.persist.storage import (
    LOCK,
    TMP_PREFIX,
    FileRecord,
    StorageLocked,
    check_name,
    owner_tag,
)

__all__ = [
    "LocalShare",
    "LocalStorage",
    "exclusive",
    "file_record",
    "fsync_directory",
    "open_regular",
    "replace_durably",
    "write_durably",
]

_LOCK_POLL = 0.1  # seconds between attempts while a previous run of the same job holds it
_CHUNK = 1 << 20


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


def fsync_directory(path: Path) -> None:
    """Flush directory ``path``: its entries (new files, a rename) are durable only then."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def _try_lock(fd: int) -> bool:
    """Take an exclusive ``flock`` on ``fd`` if no other holds it; whether it did."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@contextlib.contextmanager
def exclusive(path: Path, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing), waiting for it if held.

    ``on_wait`` is called once before waiting. The kernel releases the lock when
    the holder's process ends, however it ends; on a network file system it is as
    good as the file system's locks.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = open_regular(path, os.O_RDWR | os.O_CREAT)
    try:
        if not _try_lock(fd):
            if on_wait is not None:
                on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def replace_durably(path: Path, data: bytes) -> None:
    """Replace ``path`` by a file holding ``data``: readers see the old file or the new one.

    The new file is written under a name of its own (created exclusively, never
    through a symlink) and flushed before it is renamed over ``path``.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        write_durably(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class LocalShare:
    """A job's share directory (``ADAPTDL_SHARE_PATH``): a `jobreport.Share` of files.

    :meth:`publish` writes a file under a name of its own and renames it over the
    old one, so a reader (the scheduler) sees the old report or the new one. It is
    not flushed to disk: a report is rewritten within seconds, and a torn one after
    a machine crash reads as none.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        if not isinstance(root, (str, os.PathLike)):
            raise TypeError(f"root must be a path, got {root!r}")
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.root)!r})"

    def publish(self, name: str, data: bytes) -> None:
        check_name("name", name)
        path = self.root / name
        tmp = path.with_name(f"{TMP_PREFIX}{name}.{os.getpid()}.{secrets.token_hex(4)}")
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def read(self, name: str, limit: int | None = None) -> bytes:
        check_name("name", name)
        fd = open_regular(self.root / name, os.O_RDONLY)
        with os.fdopen(fd, "rb") as f:
            return f.read() if limit is None else f.read(limit)


class LocalStorage:
    """A directory ``root`` of the local file system (created when first written).

    A directory is written under a temporary name, every file and the directory
    flushed to disk, then renamed into place, so a crash at any instant leaves all
    of it or none. Every new file goes through :meth:`write_durably` (a file the
    storage writes whole) or :meth:`open_new` (a staged file a writer streams into,
    :meth:`create`): the two places a subclass injects faults into writes.

    It is a :class:`~adaptdl.core.persist.storage.StagingStorage`: a staged directory
    (:meth:`stage`) is a leftover name like any directory being written, and the
    :meth:`write_directory` after :meth:`adopt` flushes every directory in it
    before renaming it into place.

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
        self._adopt: str | None = None

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
        write_durably(path, data)

    @staticmethod
    def open_new(path: Path) -> BinaryIO:
        """The new file ``path``, created exclusively (never through a symlink), for writing."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC)
        return os.fdopen(fd, "wb")

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

    def write_directory(self, name: str, files: Mapping[str, bytes]) -> None:
        target = self._root / name
        if os.path.lexists(target):
            raise FileExistsError(errno.EEXIST, "name already taken", str(target))
        if self._adopt is not None:
            self._commit_staged(self._root / self._adopt, target, files)
            return
        tmp = self._tmp(name)
        try:
            os.makedirs(self._root, exist_ok=True)
            os.mkdir(tmp)
            for file, data in files.items():
                self.write_durably(tmp / file, data)
            fsync_directory(tmp)
            if os.path.lexists(target):  # appeared meanwhile: rename would replace an empty dir
                raise FileExistsError(errno.EEXIST, "name already taken", str(target))
            os.rename(tmp, target)
            fsync_directory(self._root)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _commit_staged(self, staged: Path, target: Path, files: Mapping[str, bytes]) -> None:
        # The staged directory is kept on failure: a name taken by debris makes the
        # store try the next one, with the same staged files.
        for file, data in files.items():
            self.write_durably(staged / file, data)
        for sub in sorted(p for p in staged.iterdir() if p.is_dir() and not p.is_symlink()):
            fsync_directory(sub)
        fsync_directory(staged)
        if os.path.lexists(target):
            raise FileExistsError(errno.EEXIST, "name already taken", str(target))
        os.rename(staged, target)
        self._adopt = None
        fsync_directory(self._root)

    # -- staging (StagingStorage) ------------------------------------------------------
    def stage(self, token: str, *parts: str) -> str:
        check_name("token", token)
        for part in parts:
            check_name("staged directory name", part)
        tag = f"{self._tag}." if self._tag is not None else ""
        name = "/".join([f"{TMP_PREFIX}{tag}stage-{token}", *parts])
        os.makedirs(self._root / name, exist_ok=True)
        return name

    def create(self, name: str) -> BinaryIO:
        self._real_directories(name)
        return self.open_new(self._root / name)

    def digest(self, name: str, limit: int | None = None) -> FileRecord:
        self._real_directories(name)
        return file_record(self._root / name, limit)

    def taken(self, name: str) -> bool:
        return os.path.lexists(self._root / name)

    def local_path(self, name: str) -> Path:
        return self._root / name

    def adopt(self, staged: str | None) -> None:
        self._adopt = staged

    def _real_directories(self, name: str) -> None:
        """OSError unless every directory on the way to file ``name`` is a real directory."""
        path = self._root
        for part in name.split("/")[:-1]:
            path = path / part
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                raise OSError(errno.ENOTDIR, "not a directory", str(path))

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
            while not _try_lock(fd):
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
