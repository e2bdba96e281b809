"""What a starting job restores: one checkpoint agreed by every replica, then each state.

`restore_agreed` chooses the checkpoint; `restore_state` replaces a registered
state with its entry (and files), and `check_missing` decides whether a state
the checkpoint lacks may start fresh.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Protocol

from adaptdl.core.collective import Collective
from adaptdl.core.persist.checkpoint import Checkpoint, CheckpointError, State
from adaptdl.core.persist.shardedfiles import SHARED_HINT, FileState, ShardedCheckpointStore

__all__ = [
    "ALL_STATES",
    "Store",
    "check_missing",
    "files_store",
    "restore_agreed",
    "restore_state",
    "where",
]

# The job's messages: an operator filters them under the job's logger.
LOG = logging.getLogger("adaptdl.core.job")

ALL_STATES = "*"
"""In ``allow_missing_state``: every state may be missing from the restored checkpoint."""


class Store(Protocol):
    """What the job and its loaders need of a checkpoint store (directory or memory)."""

    @property
    def root(self) -> Path | None:
        """The checkpoint directory, for messages; None for a store without one."""
        ...

    def save(
        self, entries: Mapping[str, bytes], metadata: Mapping[str, Any] | None = None
    ) -> Checkpoint: ...

    def load(self) -> Checkpoint | None: ...

    @property
    def pending(self) -> bool:
        """Whether a checkpoint is still being written in the background."""
        ...

    def wait(self, collective: Collective | None = None) -> None:
        """Return once no checkpoint is being written in the background.

        With ``collective`` (every replica at the same point) all agree on whether it failed.
        """
        ...

    def labels(self) -> list[str]: ...

    def load_label(self, label: str) -> Checkpoint: ...


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The union of two replicas' views (keyed by rank)."""
    return {**a, **b}


def restore_agreed(store: Store, collective: Collective, rank: int) -> Checkpoint | None:
    """The checkpoint rank 0 chooses, loaded by every replica; CheckpointError on all if not.

    The files of sharded states (a `ShardedCheckpointStore`) are checked by every
    replica together, each hashing a share, for each checkpoint rank 0 tries; then one
    collective: every replica contributes the labels it sees, rank 0 also
    its choice (label and manifest digest) or why it has none. A replica that
    does not see rank 0's choice (a stale directory listing, a path not shared
    across nodes) makes every replica raise, naming it, its newest and rank 0's
    choice, so that none waits for a peer that stopped. A replica that sees the
    label but reads other bytes raises on its own.
    """
    try:
        return _restore_agreed(store, collective, rank)
    finally:
        if isinstance(store, ShardedCheckpointStore):
            store.forget_verified()  # a later load of the same label hashes its files again


def _restore_agreed(store: Store, collective: Collective, rank: int) -> Checkpoint | None:
    view: dict[str, Any] = {}
    loaded: Checkpoint | None = None
    error: CheckpointError | None = None
    # Sharded files: every replica checks a share of each checkpoint rank 0 tries,
    # rather than each reading every file.
    several = collective.num_replicas > 1
    sharded = store if isinstance(store, ShardedCheckpointStore) and several else None
    try:
        if rank == 0:
            with sharded.checking_files_with(collective) if sharded else nullcontext():
                loaded = store.load()
            view["choice"] = None if loaded is None else [loaded.label, loaded.digest]
        elif sharded is not None:
            sharded.help_check_files(collective)
        view["labels"] = store.labels()
    except CheckpointError as exc:
        error = exc
        view = {"error": str(exc)}
    views: dict[str, Any] = collective.allreduce({str(rank): view}, _merge)
    for r in sorted(views, key=int):
        if "error" in views[r]:
            if error is not None:
                raise error
            raise CheckpointError(
                f"replica {r} could not read the checkpoints: {views[r]['error']}"
            )
    choice = views["0"]["choice"]
    if choice is None:
        return None
    label, digest = choice
    for r in sorted(views, key=int):
        labels = views[r]["labels"]
        if label not in labels:
            # Labels are ckpt-NNNNNN with 6 or more digits: longer is newer.
            newest = max(labels, key=lambda name: (len(name), name), default=None)
            raise CheckpointError(
                f"replica {r} does not see checkpoint {where(store, label)} that rank 0 restores "
                f"(the newest it sees is {newest or 'none'}); {SHARED_HINT}"
            )
    if rank == 0:
        return loaded
    mine = store.load_label(label)
    if mine.digest != digest:
        raise CheckpointError(
            f"replica {rank} reads checkpoint {where(store, label)} with manifest digest "
            f"{mine.digest} but rank 0 restores it with {digest}: the replicas see "
            "different checkpoint directories"
        )
    return mine


def where(store: Store | None, label: str) -> str:
    """``label`` as a quoted path in ``store``'s directory (the bare label without one)."""
    root = store.root if store is not None else None
    return f"'{root / label}'" if root is not None else label


def restore_state(state: State, loaded: Checkpoint, store: Store | None) -> None:
    """Replace ``state`` with its entry in ``loaded`` (and, for a `FileState`, its files).

    An entry that passed the store's checks but does not decode raises
    CheckpointError naming the checkpoint and the entry.
    """
    try:
        state.from_bytes(loaded.entries[state.name])
        if isinstance(state, FileState):
            state.read_files(files_store(store, state).files_directory(loaded.label, state.name))
    except (
        CheckpointError,
        ValueError,
        TypeError,
        KeyError,
        AttributeError,
        IndexError,
        RecursionError,
    ) as exc:
        # Bytes that passed the store's checks but do not decode (a crafted or
        # foreign entry, a list where a mapping belongs): say which checkpoint
        # and entry, not just a decoder's traceback.
        raise CheckpointError(
            f"checkpoint {where(store, loaded.label)}: its entry {state.name!r} cannot be "
            f"restored ({type(exc).__name__}: {exc}). Remove that checkpoint directory to "
            "resume from the one before it, or all of them to start from scratch."
        ) from exc


def files_store(store: Store | None, state: FileState) -> ShardedCheckpointStore:
    """``store``, if it keeps the files each replica writes for ``state``; else CheckpointError."""
    if not isinstance(store, ShardedCheckpointStore):
        raise CheckpointError(
            f"state {state.name!r} is saved as files each replica writes, which needs a "
            f"checkpoint directory (a ShardedCheckpointStore), not {store!r}"
        )
    return store


def check_missing(
    loaded: Checkpoint,
    name: str,
    store: Store | None,
    *,
    allow_missing: bool,
    allowed: Collection[str],
) -> None:
    """Let state ``name``, which ``loaded`` lacks, start fresh, or raise CheckpointError.

    It may when ``allow_missing`` (the program's own choice) or when ``allowed``
    (the job's ``allow_missing_state``) names it or holds `ALL_STATES`.
    """
    location = where(store, loaded.label)
    if allow_missing:  # the program's own choice (e.g. a loader made after training)
        LOG.debug("checkpoint %s has no entry %r: it starts fresh", location, name)
        return
    if name in allowed or ALL_STATES in allowed:
        LOG.warning("checkpoint %s has no entry %r: it starts fresh, as allowed", location, name)
        return
    held = ", ".join(repr(n) for n in sorted(loaded.entries))
    raise CheckpointError(
        f"checkpoint {location} has no entry {name!r} (it holds {held}): restoring the "
        f"rest would resume training with {name!r} fresh. Create the same objects, "
        "with the same names, as the run that saved it; or, to start that state "
        f"afresh on purpose, set ADAPTDL_ALLOW_MISSING_STATE={name} (names separated "
        "by commas, or * for any)."
    )
