"""Checkpoint state that every replica writes as files of its own (sharded model state).

A model too large for one device is saved shard by shard: each replica writes the
files of its own shards (torch's distributed checkpoint, DCP), and none gathers
the whole model. Such a state is a :class:`FileState`. At a checkpoint:

1. every replica agrees on one staging directory of the checkpoint storage, a
   :class:`~adaptdl.core.persist.storage.StagingStorage` (a leftover name, never listed,
   removed by the next save's cleanup if the save dies);
2. each :class:`FileState` writes, on every replica, into its own subdirectory
   there (:class:`StagedFiles`: through the storage, which may fail or damage the
   writes as any other), and each replica hashes the files it wrote itself
   (SHA-256, in parallel);
3. the replicas gather the listings (names, sizes, hashes: a few bytes per file);
4. rank 0 saves the checkpoint as usual, with one more entry, :data:`FILES_ENTRY`,
   listing every file, and its manifest written into the staging directory, which
   the storage then gives its name (:meth:`~adaptdl.core.persist.storage.StagingStorage.adopt`).

This module touches no file itself: every file goes through the storage.

So the manifest's SHA-256 covers the listing and the listing's covers every shard
file: the checkpoint is one atomic directory rename like any other, and
:class:`ShardedCheckpointStore` verifies every file when loading, falling back to
the older checkpoint when one is missing, truncated or altered. With several
replicas each checks a share of the files (:func:`shares`) and all learn the
verdict (`adaptdl.core.persist.restore.restore_agreed`). An :class:`AsyncFileState` writes
its files in the background; rank 0 then commits the checkpoint (steps 3-4) on a
thread once every replica's files are written.

On disk::

    ckpt-000012/  manifest.json  entry-0000.bin ...  adaptdl-fsdp/  .metadata  __0_0.distcp ...
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, Protocol, runtime_checkable

import attrs

from adaptdl.core.collective import Collective
from adaptdl.core.persist.checkpoint import (
    _SAVE_ATTEMPTS,
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    State,
)
from adaptdl.core.persist.filelisting import (
    FILES_ENTRY,
    FILES_SCHEMA,
    FileRecord,
    Listing,
    check_name,
    decode_listing,
    encode_listing,
    files_of,
    merge_listings,
    shares,
)
from adaptdl.core.persist.localfs import LocalStorage
from adaptdl.core.persist.manifest import Unusable, check_label, label_of, sequence_of
from adaptdl.core.persist.storage import StagingStorage

__all__ = [
    "FILES_ENTRY",
    "FILES_SCHEMA",
    "AsyncFileState",
    "FileRecord",
    "FileState",
    "ShardedCheckpointStore",
    "StagedFiles",
    "StagingStorage",
    "decode_listing",
    "encode_listing",
    "shares",
]

MISSING, DAMAGED = "missing", "damaged"
# A problem a replica found with a file: [MISSING or DAMAGED, "state/name", message] (JSON).
Problem = list[str]

SHARED_HINT = (
    "every replica must see one shared checkpoint directory alike (check that the path "
    "is shared by every node and not served from a stale cache)"
)

_log = logging.getLogger("adaptdl.core.persist.checkpoint")


@attrs.frozen
class StagedFiles:
    """Where a :class:`FileState` writes its files at a checkpoint: its staged directory.

    ``name`` is the directory's name in ``storage`` (every replica's files go into
    the same one). A file written through :meth:`create` goes through the
    storage, which may fail or damage the write as it does any other.
    """

    storage: StagingStorage
    name: str

    def create(self, file: str) -> BinaryIO:
        """The new file ``file`` (a single name) of this directory, open for writing."""
        return self.storage.create(f"{self.name}/{check_name('file name', file)}")

    def record(self, file: str) -> FileRecord:
        """The size and SHA-256 of file ``file`` of this directory, as written."""
        return self.storage.digest(f"{self.name}/{check_name('file name', file)}")

    @property
    def path(self) -> Path:
        """The directory on the local file system, for a writer that handles files itself
        (torch's distributed checkpoint renames its metadata into place there)."""
        return self.storage.local_path(self.name)


@runtime_checkable
class FileState(State, Protocol):
    """A state saved as files that every replica writes (and reads) itself.

    Its :meth:`to_bytes` is a small description saved as an ordinary entry; the
    bulk goes through the two collectives below, which every replica calls at the
    same point.
    """

    def write_files(self, directory: StagedFiles) -> list[str]:
        """Write this replica's files into ``directory`` (shared by every replica, existing).

        Each file goes in through :meth:`StagedFiles.create`. Returns the names
        (single names in ``directory``) of the files this replica wrote; every file
        there must be named by exactly one replica.
        """
        ...

    def read_files(self, directory: Path) -> None:
        """Replace the state with the one the files in ``directory`` hold (verified).

        ``directory`` is on the local file system (the storage's
        :meth:`~adaptdl.core.persist.storage.StagingStorage.local_path`): readers such as
        torch's distributed checkpoint open the files themselves.
        """
        ...


@runtime_checkable
class AsyncFileState(FileState, Protocol):
    """A :class:`FileState` that can write its files while training goes on.

    A :class:`ShardedCheckpointStore` calls :meth:`start_files` instead of
    :meth:`~FileState.write_files`, and commits the checkpoint once the files are written.
    """

    def start_files(self, directory: StagedFiles) -> Future[Mapping[str, FileRecord] | None]:
        """Collective: start writing this replica's files into ``directory``; return at once.

        What the files will hold is fixed before it returns (the state may change
        right after). The future completes once every replica's files are
        written: on rank 0 with the record of every file of every replica (each
        hashed by the replica that wrote it), elsewhere with None; or with the
        error that stopped any replica's write.
        """
        ...


class ShardedCheckpointStore(CheckpointStore):
    """A checkpoint store that also holds the files of :class:`FileState` s.

    ``root`` is a directory (a :class:`~adaptdl.core.persist.localfs.LocalStorage` there) or a
    :class:`~adaptdl.core.persist.storage.StagingStorage`; ``options`` are
    :class:`~adaptdl.core.persist.checkpoint.CheckpointStore`'s. Every replica calls
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
            root = LocalStorage(root, owner=options.get("job_id"))
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
            directory = StagedFiles(self._staging, self._staging.stage(token, name))
            if isinstance(state, AsyncFileState):
                started.append((name, state.start_files(directory)))
                continue
            written = state.write_files(directory)
            row = mine.setdefault(name, {})
            for file in written:
                record = directory.record(file)
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
        directory: str,
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
            if not self._staging.taken(label_of(sequence)):
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
        """Where checkpoint ``label`` keeps the files of state ``name`` (for its reader)."""
        return self._staging.local_path(f"{label}/{check_name('state name', name)}")

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
            try:
                found = self._staging.digest(f"{label}/{state}/{name}", limit=record.size)
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
            return self._staging.taken(f"{label}/{path}")
        except (OSError, ValueError):
            return False


@attrs.frozen
class _Staged:
    """What rank 0 keeps from :meth:`ShardedCheckpointStore.write_files` for its save."""

    directory: str  # the staged directory's name in the storage
    listing: Listing
    started: list[tuple[str, Future[Mapping[str, FileRecord] | None]]]
