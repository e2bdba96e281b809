"""Checkpoint state that every replica writes as files of its own (sharded model state).

A model too large for one device is saved shard by shard: each replica writes the
files of its own shards (torch's distributed checkpoint, DCP), and none gathers
the whole model. Such a state is a :class:`FileState`. At a checkpoint:

1. every replica agrees on one staging directory, a leftover name of the
   checkpoint directory's storage (:data:`~adaptdl.core.storage.TMP_PREFIX`, never
   listed, removed by the next save's cleanup if the save dies);
2. each :class:`FileState` writes, on every replica, into its own subdirectory
   there, and each replica hashes the files it wrote itself (SHA-256, in parallel);
3. the replicas gather the listings (names, sizes, hashes: a few bytes per file);
4. rank 0 saves the checkpoint as usual, with one more entry, :data:`FILES_ENTRY`,
   listing every file, and its manifest written into the staging directory, which
   is then renamed into place.

So the manifest's SHA-256 covers the listing and the listing's covers every shard
file: the checkpoint is one atomic directory rename like any other, and
:class:`ShardedCheckpointStore` verifies every file when loading, falling back to
the older checkpoint when one is missing, truncated or altered. With several
replicas each checks a share of the files (:func:`shares`) and all learn the
verdict (`adaptdl.core.restore.restore_agreed`). An :class:`AsyncFileState` writes
its files in the background; rank 0 then commits the checkpoint (steps 3-4) on a
thread once every replica's files are written.

On disk::

    ckpt-000012/  manifest.json  entry-0000.bin ...  adaptdl-fsdp/  .metadata  __0_0.distcp ...
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs

from adaptdl.core.checkpoint import (
    _SAVE_ATTEMPTS,
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    State,
)
from adaptdl.core.collective import Collective
from adaptdl.core.filelisting import (
    FILES_ENTRY,
    FILES_SCHEMA,
    FileRecord,
    Listing,
    check_name,
    decode_listing,
    encode_listing,
    file_record,
    files_of,
    merge_listings,
    shares,
)
from adaptdl.core.manifest import Unusable, check_label, label_of, sequence_of
from adaptdl.core.storage import TMP_PREFIX, LocalStorage

__all__ = [
    "FILES_ENTRY",
    "FILES_SCHEMA",
    "AsyncFileState",
    "FileRecord",
    "FileState",
    "ShardedCheckpointStore",
    "StagingStorage",
    "decode_listing",
    "encode_listing",
    "file_record",
    "shares",
]

MISSING, DAMAGED = "missing", "damaged"
# A problem a replica found with a file: [MISSING or DAMAGED, "state/name", message] (JSON).
Problem = list[str]

SHARED_HINT = (
    "every replica must see one shared checkpoint directory alike (check that the path "
    "is shared by every node and not served from a stale cache)"
)

_log = logging.getLogger("adaptdl.core.checkpoint")


@runtime_checkable
class FileState(State, Protocol):
    """A state saved as files that every replica writes (and reads) itself.

    Its :meth:`to_bytes` is a small description saved as an ordinary entry; the
    bulk goes through the two collectives below, which every replica calls at the
    same point.
    """

    def write_files(self, directory: Path) -> list[str]:
        """Write this replica's files into ``directory`` (shared by every replica, existing).

        Returns the names (relative to ``directory``) of the files this replica
        wrote; every file there must be named by exactly one replica.
        """
        ...

    def read_files(self, directory: Path) -> None:
        """Replace the state with the one the files in ``directory`` hold (verified)."""
        ...


@runtime_checkable
class AsyncFileState(FileState, Protocol):
    """A :class:`FileState` that can write its files while training goes on.

    A :class:`ShardedCheckpointStore` calls :meth:`start_files` instead of
    :meth:`~FileState.write_files`, and commits the checkpoint once the files are written.
    """

    def start_files(self, directory: Path) -> Future[Mapping[str, FileRecord] | None]:
        """Collective: start writing this replica's files into ``directory``; return at once.

        What the files will hold is fixed before it returns (the state may change
        right after). The future completes once every replica's files are
        written: on rank 0 with the record of every file of every replica (each
        hashed by the replica that wrote it), elsewhere with None; or with the
        error that stopped any replica's write.
        """
        ...


class StagingStorage(LocalStorage):
    """A :class:`~adaptdl.core.storage.LocalStorage` whose next directory can adopt staged files.

    :meth:`stage` makes a staging directory (a leftover name, cleaned up as any);
    after :meth:`adopt`, the next :meth:`write_directory` writes its files into the
    staged directory beside what the replicas put there, flushes every directory
    in it, and renames it into place: all of it appears at once or none.
    """

    def __init__(self, root: str | os.PathLike[str], *, owner: str | None = None) -> None:
        super().__init__(root, owner=owner)
        self._adopt: Path | None = None

    def stage(self, token: str) -> Path:
        """The staging directory for ``token`` (the same on every replica), created if absent."""
        check_name("token", token)
        tag = f"{self.tag}." if self.tag is not None else ""
        path = self.root / f"{TMP_PREFIX}{tag}stage-{token}"
        os.makedirs(path, exist_ok=True)
        return path

    def adopt(self, staged: Path | None) -> None:
        """Have the next :meth:`write_directory` take ``staged`` (None: stop adopting)."""
        self._adopt = staged

    def write_directory(self, name: str, files: Mapping[str, bytes]) -> None:
        staged = self._adopt
        if staged is None:
            super().write_directory(name, files)
            return
        # Kept until the rename: a name taken by debris makes the store try the next one.
        target = self.root / name
        if os.path.lexists(target):
            raise FileExistsError(errno.EEXIST, "name already taken", str(target))
        for file, data in files.items():
            self.write_durably(staged / file, data)
        for sub in sorted(p for p in staged.iterdir() if p.is_dir() and not p.is_symlink()):
            self._fsync_dir(sub)
        self._fsync_dir(staged)
        if os.path.lexists(target):
            raise FileExistsError(errno.EEXIST, "name already taken", str(target))
        os.rename(staged, target)
        self._adopt = None
        self._fsync_dir(self.root)

    def digest(self, path: Path, limit: int | None = None) -> FileRecord:
        """Size and SHA-256 of the regular file ``path`` (see :func:`file_record`)."""
        return file_record(path, limit)


class ShardedCheckpointStore(CheckpointStore):
    """A checkpoint store that also holds the files of :class:`FileState` s.

    ``root`` is a directory or a :class:`StagingStorage`; ``options`` are
    :class:`~adaptdl.core.checkpoint.CheckpointStore`'s. Every replica calls
    :meth:`write_files` before rank 0 calls :meth:`save`; loading verifies every
    listed file and falls back to the older checkpoint when one is damaged.

    An :class:`AsyncFileState` writes its files in the background: :meth:`save`
    then returns at once, and a thread of rank 0 commits the checkpoint (the
    listing, the manifest, the rename) once every replica's files are written,
    so that it appears whole or not at all. Until then it is :attr:`pending`;
    :meth:`wait` waits for it, and so does the next :meth:`write_files` or
    :meth:`save`. A background save that fails leaves the previous checkpoint
    the newest, and its error is raised by the next :meth:`wait`.
    """

    def __init__(self, root: str | os.PathLike[str] | StagingStorage, **options: Any) -> None:
        if isinstance(root, (str, os.PathLike)):
            root = StagingStorage(root, owner=options.get("job_id"))
        if not isinstance(root, StagingStorage):
            raise TypeError(f"root must be a path or a StagingStorage, got {root!r}")
        super().__init__(root, **options)
        self._staging: StagingStorage = root
        self._staged: _Staged | None = None
        # What `wait` waits for: rank 0's commit, another replica's own writes.
        self._pending: list[Future[Any]] = []
        self._committer: ThreadPoolExecutor | None = None
        # Labels whose files every replica, each checking a share, found intact.
        self._verified: set[str] = set()
        self._check_files: Callable[[str, Listing], list[str]] = self._check_all

    # -- writing -------------------------------------------------------------------------
    @property
    def pending(self) -> bool:
        """Whether a checkpoint is still being written in the background."""
        return bool(self._pending)

    def wait(self, collective: Collective | None = None) -> None:
        """Return once the checkpoint being written in the background is committed.

        Raises CheckpointError if writing or committing it failed (the previous
        checkpoint is then still the newest). With ``collective`` (every replica
        calls it at the same point, each with a checkpoint pending) the replicas
        agree on the outcome: all raise the first failing replica's error, so that
        none goes on to wait for a peer that stopped.
        """
        pending, self._pending = self._pending, []
        if not pending:
            return
        error: CheckpointError | None = None
        try:
            for future in pending:
                future.result()
        except CheckpointError as exc:
            error = exc
        except Exception as exc:  # whatever stopped a replica's write or rank 0's commit
            error = CheckpointError(
                f"a checkpoint written in the background into {self._where()} failed "
                f"({type(exc).__name__}: {exc}); the previous checkpoint is still the newest"
            )
            error.__cause__ = exc
        if collective is not None and collective.num_replicas > 1:
            texts = collective.allgather(None if error is None else str(error))
            first = next(((r, t) for r, t in enumerate(texts) if t is not None), None)
            if first is not None and first[0] != collective.rank:
                raise CheckpointError(f"replica {first[0]}: {first[1]}") from error
        if error is not None:
            raise error

    def write_files(self, states: Sequence[FileState], collective: Collective) -> None:
        """Collective: every replica writes ``states``' files into one staging directory.

        An :class:`AsyncFileState` only starts writing. Rank 0 keeps the staging
        directory and the listing for its next :meth:`save`. A checkpoint still
        pending is waited for first, and its outcome agreed (:meth:`wait`).
        """
        self.wait(collective)
        token = collective.broadcast(secrets.token_hex(8) if collective.rank == 0 else "")
        staged = self._staging.stage(token)
        mine: dict[str, dict[str, list[Any]]] = {}
        started: list[tuple[str, Future[Mapping[str, FileRecord] | None]]] = []
        for state in states:
            name = check_name("state name", state.name)
            directory = staged / name
            os.makedirs(directory, exist_ok=True)
            if isinstance(state, AsyncFileState):
                started.append((name, state.start_files(directory)))
                continue
            written = state.write_files(directory)
            row = mine.setdefault(name, {})
            for file in written:
                record = self._staging.digest(directory / check_name("file name", file))
                row[file] = [record.size, record.sha256]
        listing = merge_listings(collective.allgather(mine))
        if collective.rank == 0:
            self._staged = _Staged(staged, listing, started)
        else:
            self._pending = [future for _, future in started]

    def save(
        self, entries: Mapping[str, bytes], metadata: Mapping[str, Any] | None = None
    ) -> Checkpoint:
        """Save as the plain store does, with the staged files.

        While files are still being written (an :class:`AsyncFileState`), the
        checkpoint returned is the one a background thread commits, under its
        label, once they are: :meth:`wait` returns then.
        """
        staged, self._staged = self._staged, None
        if staged is None:
            self.wait()
            return super().save(entries, metadata)
        if FILES_ENTRY in entries:
            raise ValueError(f"{FILES_ENTRY!r} is a reserved entry name; rename that state")
        if not staged.started:
            return self._save_staged(staged.directory, staged.listing, entries, metadata)
        frozen, meta, labels = self._prepare(entries, metadata)
        label = self._free_label(labels)
        if self._committer is None:
            self._committer = ThreadPoolExecutor(1, thread_name_prefix="adaptdl-commit")
        self._pending = [
            self._committer.submit(self._commit_or_log, staged, frozen, meta, labels, label)
        ]
        return Checkpoint(label, frozen, meta)

    def _save_staged(
        self,
        directory: Path,
        listing: Listing,
        entries: Mapping[str, bytes],
        metadata: Mapping[str, Any] | None,
    ) -> Checkpoint:
        self._staging.adopt(directory)
        try:
            return super().save({**entries, FILES_ENTRY: encode_listing(listing)}, metadata)
        finally:
            self._staging.adopt(None)

    def _free_label(self, labels: list[str]) -> str:
        """The label the next checkpoint takes: after every one, skipping names taken by debris."""
        first = sequence_of(labels[-1]) + 1 if labels else 1
        for sequence in range(first, first + _SAVE_ATTEMPTS):
            if not os.path.lexists(self._staging.root / label_of(sequence)):
                return label_of(sequence)
        raise self._names_taken()

    def _commit_or_log(self, staged: _Staged, *args: Any) -> Checkpoint:
        """`_commit`, logging its failure: a process that exits without `wait` still says it."""
        try:
            return self._commit(staged, *args)
        except Exception as exc:
            _log.error(
                "a checkpoint written in the background into %s was not committed (%s: %s); "
                "the previous checkpoint is still the newest",
                self._where(),
                type(exc).__name__,
                exc,
            )
            raise

    def _commit(
        self,
        staged: _Staged,
        entries: Mapping[str, bytes],
        meta: dict[str, Any],
        labels: list[str],
        label: str,
    ) -> Checkpoint:
        """In the background: wait for every replica's files, then write the checkpoint."""
        listing = {state: dict(records) for state, records in staged.listing.items()}
        for state, future in staged.started:
            records = future.result()
            if records is None:
                raise CheckpointError(f"state {state!r} gave rank 0 no record of its files")
            listing[state] = {check_name("file name", n): r for n, r in records.items()}
        self._staging.adopt(staged.directory)
        try:
            checkpoint = self._write(
                label, {**entries, FILES_ENTRY: encode_listing(listing)}, meta
            )
        except FileExistsError:
            raise CheckpointError(
                f"checkpoint {self._where(label)} appeared while its files were written"
            ) from None
        finally:
            self._staging.adopt(None)
        self._prune(labels, label)
        _log.info("checkpoint %s committed: every replica's files are written", label)
        return checkpoint

    def files_directory(self, label: str, name: str) -> Path:
        """Where checkpoint ``label`` keeps the files of state ``name``."""
        return self._staging.root / label / check_name("state name", name)

    # -- loading -------------------------------------------------------------------------
    def _load_one(self, label: str) -> Checkpoint:
        checkpoint = super()._load_one(label)
        data = checkpoint.entries.get(FILES_ENTRY)
        if data is None or label in self._verified:
            return checkpoint
        try:
            listing = decode_listing(data)
        except ValueError as exc:
            raise Unusable(str(exc)) from None
        problems = self._check_files(label, listing)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise Unusable(problems[0] + more)
        return checkpoint

    def _check_all(self, label: str, listing: Listing) -> list[str]:
        return [text for _, _, text in self._check(label, files_of(listing))]

    def _check(self, label: str, files: Sequence[tuple[str, str, FileRecord]]) -> list[Problem]:
        """What is wrong with ``files`` (state, name, record) of checkpoint ``label``."""
        problems: list[Problem] = []
        for state, name, record in files:
            directory = self.files_directory(label, state)
            try:
                if not stat.S_ISDIR(os.lstat(directory).st_mode):
                    raise OSError(errno.ENOTDIR, "not a directory", str(directory))
                found = self._staging.digest(directory / name, limit=record.size)
            except FileNotFoundError as exc:
                problems.append(
                    [MISSING, f"{state}/{name}", f"file {state}/{name} is missing ({exc})"]
                )
                continue
            except OSError as exc:
                problems.append(
                    [DAMAGED, f"{state}/{name}", f"file {state}/{name} is unreadable ({exc})"]
                )
                continue
            if found != record:
                problems.append(
                    [
                        DAMAGED,
                        f"{state}/{name}",
                        f"file {state}/{name} does not match its size and SHA-256 in "
                        f"{FILES_ENTRY} (truncated, damaged or replaced)",
                    ]
                )
        return problems

    @contextlib.contextmanager
    def checking_files_with(self, collective: Collective) -> Iterator[None]:
        """On rank 0, around :meth:`load`: the replicas check each checkpoint's files together.

        Each replica hashes a share of the files (:func:`shares`, balanced by
        size) and all learn the verdict, so a damaged file still makes every
        replica fall back to the older checkpoint while none reads every file.
        The other replicas run :meth:`help_check_files` meanwhile. A file another
        replica does not find but rank 0 does raises CheckpointError: the replicas
        do not share one checkpoint directory, and no checkpoint is damaged.
        """

        def together(label: str, listing: Listing) -> list[str]:
            collective.broadcast([label, encode_listing(listing).decode("ascii")])
            parts = collective.allgather(self._share_problems(label, listing, collective))
            problems = []
            for rank, part in enumerate(parts):
                for kind, path, text in part:
                    if kind == MISSING and rank != 0 and self._sees(label, path):
                        raise CheckpointError(
                            f"replica {rank} does not see the file {path} of checkpoint "
                            f"{self._where(label)} that rank 0 sees; {SHARED_HINT}"
                        )
                    problems.append(text if rank == 0 else f"{text} (found by replica {rank})")
            return problems

        self._check_files = together
        try:
            yield
        finally:
            self._check_files = self._check_all
            collective.broadcast(None)  # the other replicas stop helping

    def help_check_files(self, collective: Collective) -> None:
        """On every replica but rank 0, while rank 0 is in :meth:`checking_files_with`.

        A label whose share this replica found intact, as every other replica
        did theirs, then loads without hashing (:meth:`forget_verified` ends that).
        """
        while True:
            request = collective.broadcast(None)
            if request is None:
                return
            try:
                label, text = request
                check_label(label)
                listing = decode_listing(text.encode("ascii"))
            except Exception as exc:  # sent all the same: rank 0 waits for every share
                collective.allgather(
                    [[DAMAGED, "", f"the listing rank 0 sent cannot be read ({exc})"]]
                )
                continue
            parts = collective.allgather(self._share_problems(label, listing, collective))
            if not any(parts):
                self._verified.add(label)

    def forget_verified(self) -> None:
        """Have every later load hash the files again (after a restore has used the verdicts)."""
        self._verified.clear()

    def _share_problems(
        self, label: str, listing: Listing, collective: Collective
    ) -> list[Problem]:
        """What is wrong with this replica's share of ``listing``; never raises."""
        try:
            return self._check(label, shares(listing, collective.num_replicas)[collective.rank])
        except Exception as exc:  # a helper that stopped would leave rank 0 waiting
            return [
                [DAMAGED, "", f"replica {collective.rank} could not check its share ({exc!r})"]
            ]

    def _sees(self, label: str, path: str) -> bool:
        try:
            return os.path.lexists(self._staging.root / label / path)
        except (OSError, ValueError):
            return False


@attrs.frozen
class _Staged:
    """What rank 0 keeps from :meth:`ShardedCheckpointStore.write_files` for its save."""

    directory: Path
    listing: Listing
    started: list[tuple[str, Future[Mapping[str, FileRecord] | None]]]
