"""Which checkpoint a starting job restores: one choice, agreed by every replica."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from adaptdl.core.checkpoint import Checkpoint, CheckpointError
from adaptdl.core.collective import Collective

__all__ = ["Store", "restore_agreed", "where"]


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

    def labels(self) -> list[str]: ...

    def load_label(self, label: str) -> Checkpoint: ...


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The union of two replicas' views (keyed by rank)."""
    return {**a, **b}


def restore_agreed(store: Store, collective: Collective, rank: int) -> Checkpoint | None:
    """The checkpoint rank 0 chooses, loaded by every replica; CheckpointError on all if not.

    One collective: every replica contributes the labels it sees, rank 0 also
    its choice (label and manifest digest) or why it has none. A replica that
    does not see rank 0's choice (a stale directory listing, a path not shared
    across nodes) makes every replica raise, naming it, its newest and rank 0's
    choice, so that none waits for a peer that stopped. A replica that sees the
    label but reads other bytes raises on its own.
    """
    view: dict[str, Any] = {}
    loaded: Checkpoint | None = None
    error: CheckpointError | None = None
    try:
        if rank == 0:
            loaded = store.load()
            view["choice"] = None if loaded is None else [loaded.label, loaded.digest]
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
                f"(the newest it sees is {newest or 'none'}); every replica must see one "
                "shared checkpoint directory alike (check that the path is shared by every "
                "node and not served from a stale cache)"
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
    return f"'{os.path.join(root, label)}'" if root is not None else label
