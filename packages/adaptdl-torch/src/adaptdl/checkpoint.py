"""A program's own state in the job's checkpoints, with the original AdaptDL's `State` API.

Subclass `State`, give it a name, and override `State.save` (write the state to a
binary file object), `State.load` (read it back) and, if replicas hold parts of
it, `State.sync` (make it whole on every replica)::

    class Counter(adaptdl.checkpoint.State):
        def __init__(self):
            super().__init__("counter")
            self.steps = 0

        def save(self, fileobj):
            fileobj.write(json.dumps(self.steps).encode())

        def load(self, fileobj):
            self.steps = json.loads(fileobj.read())

    counter = Counter()
    adaptdl.checkpoint.load_state(counter)  # True after a restart

A `State` joins the process's job (`adaptdl.torch.init_process_group`, which it
starts if nothing has) the moment it is made, and is written with every
checkpoint the job takes (on SIGTERM, periodically, or by `save_all_states`) as
one entry of that checkpoint, whose SHA-256 its manifest records: it is saved
atomically with the model, the optimiser and the data position, and restored from
the same checkpoint. The library stores the bytes `State.save` writes and hands
them back to `State.load`; it never interprets them, so the subclass chooses the
format (JSON, ``torch.save``/``torch.load(weights_only=True)``, ...). Unpickling
them is the subclass's choice, and its risk.
"""

from __future__ import annotations

import io
import logging
from typing import BinaryIO

from adaptdl.core.job import Job
from adaptdl.torch import current_job

__all__ = ["State", "load_state", "save_all_states", "save_state"]

LOG = logging.getLogger("adaptdl.checkpoint")

# Entry names of program states in a checkpoint, apart from the library's own entries.
_ENTRY_PREFIX = "program-state:"


class _Entry:
    """A `State` as the job's checkpoint entry (core's ``CollectiveState`` protocol).

    Rank 0 alone runs `State.save`, as the original did; the job writes only rank
    0's bytes. The bytes restored from the job's checkpoint wait here for
    `load_state`: the subclass's constructor has not finished when it registers.
    """

    def __init__(self, state: State, job: Job) -> None:
        self.state = state
        self.job = job
        self.name = _ENTRY_PREFIX + state._adaptdl_name
        self.restored: bytes | None = None

    def sync(self) -> None:
        self.state.sync()

    def to_bytes(self) -> bytes:
        if self.job.topology.rank != 0:
            return b""
        buffer = io.BytesIO()
        self.state.save(buffer)
        return buffer.getvalue()

    def from_bytes(self, data: bytes) -> None:
        self.restored = data


def _entry(state: State) -> _Entry:
    """The entry of ``state`` in the process's current job, registering it if needed.

    A test (or a program) that starts a new job in the same process registers its
    states again there.
    """
    job = current_job()
    entry = state._adaptdl_entry
    if entry is None or entry.job is not job:
        entry = _Entry(state, job)
        job.register(entry, allow_missing=True)  # load_state says whether it was there
        state._adaptdl_entry = entry
    return entry


class State:
    """A piece of a program's state saved in every checkpoint of the job, under ``name``.

    ``name`` must be a non-empty str, unique among the job's states: a second
    `State` with the same name raises ValueError. Subclasses override `save`,
    `load` and `sync`; the base class saves nothing. As in the original, the base
    class defines no public attribute, so a subclass may use any name (``name``
    too) for its own.
    """

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        job = current_job()
        if any(s.name == _ENTRY_PREFIX + name for s in job.states()):
            raise ValueError(f"State {name!r} already exists: each State needs its own name")
        self._adaptdl_name = name
        self._adaptdl_entry: _Entry | None = None
        _entry(self)

    def save(self, fileobj: BinaryIO) -> None:
        """Write the state to ``fileobj`` (binary, writable); called on rank 0 only."""

    def load(self, fileobj: BinaryIO) -> None:
        """Read the state back from ``fileobj`` (binary, readable), as `save` wrote it."""

    def sync(self) -> None:
        """Make the state consistent across replicas; every replica calls it before a save.

        Collectives (`adaptdl.collective`) may be used here: every replica runs the
        syncs of all its states in the order they were made.
        """


def save_all_states() -> str | None:
    """Checkpoint the whole job now: every `State` and the library's own state, atomically.

    Collective: every replica must call it at the same point, between optimiser
    steps. Each state's `State.sync` runs on every replica, then rank 0 writes
    the checkpoint. Returns the checkpoint directory on rank 0 when checkpoints
    are on (``ADAPTDL_CHECKPOINT_PATH``), else None.
    """
    job = current_job()
    job.checkpoint()
    if job.topology.rank != 0 or job.store is None or job.store.root is None:
        return None
    return str(job.store.root)


def save_state(state: State, checkpoint_dir: str | None = None, sync: bool = True) -> None:
    """Save ``state`` in a checkpoint: `save_all_states`, since a checkpoint here is whole.

    Every state of the job is saved with it, at the same step, so that the
    checkpoint stays consistent. ``checkpoint_dir`` may only name the job's own
    directory (``ADAPTDL_CHECKPOINT_PATH``), and ``sync`` must be True: every state
    is synchronised before a checkpoint. ValueError otherwise.
    """
    if not isinstance(state, State):
        raise TypeError(f"state must be an adaptdl.checkpoint.State, got {type(state).__name__}")
    job = _entry(state).job
    own = None if job.store is None or job.store.root is None else str(job.store.root)
    if checkpoint_dir is not None and checkpoint_dir != own:
        raise ValueError(
            f"checkpoint_dir={checkpoint_dir!r} is not the job's checkpoint directory "
            f"({own!r}, from ADAPTDL_CHECKPOINT_PATH): states are saved only there"
        )
    if sync is not True:
        raise ValueError(
            f"sync={sync!r} is not supported: every state is synchronised before a checkpoint"
        )
    save_all_states()


def load_state(state: State) -> bool:
    """Restore ``state`` from the checkpoint the job resumed from.

    Calls ``state.load`` with a readable binary file object of the bytes its
    `State.save` wrote, on every replica, and returns True; returns False (and
    leaves ``state`` as it is) on a fresh start or when that checkpoint holds no
    state of this name.
    """
    if not isinstance(state, State):
        raise TypeError(f"state must be an adaptdl.checkpoint.State, got {type(state).__name__}")
    entry = _entry(state)
    if entry.restored is None:
        if entry.job.restored_from is not None:
            LOG.warning(
                "checkpoint %s holds no state named %r",
                entry.job.restored_from,
                state._adaptdl_name,
            )
        return False
    state.load(io.BytesIO(entry.restored))
    return True
