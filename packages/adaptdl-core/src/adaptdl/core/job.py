"""The object that owns every piece of core state for one training process."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from adaptdl.core._validate import check_float, check_int
from adaptdl.core.batchsize import BatchSizeDecision, GoodputDecision, RedecideSchedule
from adaptdl.core.checkpoint import (
    Checkpoint,
    CheckpointError,
    CollectiveState,
    JsonState,
    State,
)
from adaptdl.core.collective import Collective, Future, LocalCollective, logical_or
from adaptdl.core.config import JobConfig
from adaptdl.core.epoch import EpochState
from adaptdl.core.goodput import GoodputFunction
from adaptdl.core.journal import Journal, Mark
from adaptdl.core.metrics import MetricsState
from adaptdl.core.topology import Topology

if TYPE_CHECKING:
    from adaptdl.core.loader import LoaderHelper

LOG = logging.getLogger("adaptdl.core.job")

EXIT_CODE_PREEMPTED = 143  # 128 + SIGTERM, what a scheduler expects of a stopped job


class Preempted(SystemExit):
    """Raised after the job checkpointed because a stop was requested (exit 143)."""

    def __init__(self) -> None:
        super().__init__(EXIT_CODE_PREEMPTED)


@attrs.frozen
class CheckpointPolicy:
    """When to checkpoint besides a requested stop: every so many seconds or steps.

    Both None turns periodic checkpoints off. The default, every 10 minutes,
    bounds what a SIGKILL loses to 10 minutes of work at the cost of one state
    write per 10 minutes.
    """

    every_seconds: float | None = attrs.field(default=600.0)
    every_steps: int | None = attrs.field(default=None)

    @every_seconds.validator
    def _check_seconds(self, attribute: attrs.Attribute[float | None], value: Any) -> None:
        if value is not None:
            check_float("every_seconds", value, min=0.0, min_exclusive=True)

    @every_steps.validator
    def _check_steps(self, attribute: attrs.Attribute[int | None], value: Any) -> None:
        if value is not None:
            check_int("every_steps", value, min=1)

    @classmethod
    def from_config(cls, config: JobConfig) -> CheckpointPolicy:
        """The policy a job configuration asks for (``ADAPTDL_CHECKPOINT_INTERVAL`` and
        ``ADAPTDL_CHECKPOINT_STEPS``, read and checked by `JobConfig.from_env`)."""
        return cls(
            every_seconds=config.checkpoint_every_seconds,
            every_steps=config.checkpoint_every_steps,
        )

    def due(self, steps: int, seconds: float) -> bool:
        """Whether ``steps`` optimiser steps or ``seconds`` since the last checkpoint are due."""
        if self.every_steps is not None and steps >= self.every_steps:
            return True
        return self.every_seconds is not None and seconds >= self.every_seconds


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


@attrs.frozen
class Boundary:
    """What every replica agreed at one step boundary (see `Job.step_boundary`).

    ``stop``: checkpoint and exit; ``checkpoint``: write a periodic checkpoint and
    go on; ``redecide``: the training loop decides its batch size again. A value
    that `Job.step_boundary` returns never has ``stop``: it raised `Preempted`.
    """

    stop: bool = False
    checkpoint: bool = False
    redecide: bool = False

    def to_wire(self) -> list[bool]:
        """The three flags as a collective carries them (reduced with ``logical_or``)."""
        return [self.stop, self.checkpoint, self.redecide]

    @classmethod
    def from_wire(cls, flags: Any) -> Boundary:
        """The value of :meth:`to_wire`'s list (after the reduction)."""
        stop, checkpoint, redecide = flags
        return cls(bool(stop), bool(checkpoint), bool(redecide))


class JobState(JsonState):
    """Job-wide counters that survive restarts."""

    def __init__(self, name: str = "adaptdl-job") -> None:
        self.name = name
        self.samples_consumed = 0  # by all replicas in all loops, at step boundaries
        self.replayed_samples = 0  # consumed again after crashes (see journal.py)

    def to_json(self) -> dict[str, Any]:
        return {
            "samples_consumed": self.samples_consumed,
            "replayed_samples": self.replayed_samples,
        }

    def load_json(self, data: dict[str, Any]) -> None:
        self.samples_consumed = check_int("samples_consumed", data["samples_consumed"], min=0)
        self.replayed_samples = check_int("replayed_samples", data["replayed_samples"], min=0)


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The union of two replicas' views (keyed by rank)."""
    return {**a, **b}


class Job:
    """One process of an elastic job: topology, collective, checkpoints, loops, metrics.

    Core keeps no module-level state: a process may hold many jobs (tests and the
    simulator do). States registered with the job are restored from its newest
    checkpoint the moment they register, and saved by `checkpoint`.
    """

    def __init__(
        self,
        topology: Topology | None = None,
        *,
        collective: Collective | None = None,
        store: Store | None = None,
        clock: Callable[[], float] = time.perf_counter,
        batch_size_decision: BatchSizeDecision | None = None,
        checkpoint_policy: CheckpointPolicy | None = None,
        journal: Journal | None = None,
    ) -> None:
        self.topology = topology or Topology()
        self.collective: Collective = collective or LocalCollective()
        if self.collective.num_replicas != self.topology.num_replicas:
            raise ValueError(
                f"collective has {self.collective.num_replicas} replicas but the topology "
                f"has num_replicas={self.topology.num_replicas}"
            )
        self.store = store
        self.clock = clock
        self.batch_size_decision: BatchSizeDecision = batch_size_decision or GoodputDecision(
            self.goodput_fn, estimate_samples=self.estimate_samples
        )
        self._states: dict[str, State] = {}
        self._names: dict[str, int] = {}
        self._loaded: Checkpoint | None = self._restore(store) if store is not None else None
        self._base = self._loaded.sequence if self._loaded is not None else 0
        self.current_loader: LoaderHelper | None = None
        self.training_loader: LoaderHelper | None = None
        self._sync_time = 0.0
        self._stop_requested = False
        self._boundary_future: Future[Any] | None = None
        self._drains: list[Callable[[], None]] = []
        self.redecide_schedule = RedecideSchedule()
        self._redecide_interval: float | None = None
        self._next_redecide = clock() + self.redecide_schedule.next_interval(None)
        self._redecide_pending = False
        self.checkpoint_policy = checkpoint_policy or CheckpointPolicy()
        self._steps_since_checkpoint = 0
        self._last_checkpoint_time = clock()
        self.checkpoints_written = 0
        self.state = JobState()
        self.register(self.state)
        self.journal = journal if self.topology.rank == 0 else None
        self._count_replay()
        self.epoch = EpochState()
        self.register(self.epoch)
        self.metrics = MetricsState()
        self.register(self.metrics)

    # -- states and checkpoints ---------------------------------------------------------
    def _restore(self, store: Store) -> Checkpoint | None:
        """The checkpoint rank 0 chooses, loaded by every replica; CheckpointError on all if not.

        One collective: every replica contributes the labels it sees, rank 0 also
        its choice (label and manifest digest) or why it has none. A replica that
        does not see rank 0's choice (a stale directory listing, a path not shared
        across nodes) makes every replica raise, naming it, its newest and rank 0's
        choice, so that none waits for a peer that stopped. A replica that sees the
        label but reads other bytes raises on its own.
        """
        rank = self.topology.rank
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
        views: dict[str, Any] = self.collective.allreduce({str(rank): view}, _merge)
        where = self._where
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
                    f"replica {r} does not see checkpoint {where(label)} that rank 0 restores "
                    f"(the newest it sees is {newest or 'none'}); every replica must see one "
                    "shared checkpoint directory alike (check that the path is shared by every "
                    "node and not served from a stale cache)"
                )
        if rank == 0:
            return loaded
        mine = store.load_label(label)
        if mine.digest != digest:
            raise CheckpointError(
                f"replica {rank} reads checkpoint {where(label)} with manifest digest "
                f"{mine.digest} but rank 0 restores it with {digest}: the replicas see "
                "different checkpoint directories"
            )
        return mine

    def _where(self, label: str) -> str:
        root = self.store.root if self.store is not None else None
        return f"'{os.path.join(root, label)}'" if root is not None else label

    @property
    def restored_from(self) -> str | None:
        """Label of the checkpoint this job resumed from, or None for a fresh start."""
        return self._loaded.label if self._loaded is not None else None

    def register(self, state: State) -> None:
        """Add ``state`` to every checkpoint, restoring it now if the checkpoint has it."""
        if state.name in self._states:
            raise ValueError(f"a state named {state.name!r} is already registered")
        self._states[state.name] = state
        if self._loaded is not None and state.name in self._loaded.entries:
            try:
                state.from_bytes(self._loaded.entries[state.name])
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
                del self._states[state.name]
                where = self._where(self._loaded.label)
                raise CheckpointError(
                    f"checkpoint {where}: its entry {state.name!r} cannot be restored "
                    f"({type(exc).__name__}: {exc}). Remove that checkpoint directory to "
                    "resume from the one before it, or all of them to start from scratch."
                ) from exc

    def _count_replay(self) -> None:
        mark = self.journal.read() if self.journal is not None else None
        if mark is None:
            return
        if self._loaded is None and mark.checkpoint > 0:
            # Its run had checkpoints and none is left (removed to start afresh): the
            # journal describes another history; counting it would invent replays.
            LOG.info("fresh start: ignoring a journal left by a run whose checkpoints are gone")
            return
        # The journal's replays include those counted by runs that died before
        # writing a checkpoint; the checkpoint's never exceed them.
        counted = max(self.state.replayed_samples, mark.replayed)
        replayed = max(0, mark.samples - self.state.samples_consumed)
        self.state.replayed_samples = counted + replayed
        if replayed:
            LOG.warning(
                "resuming from checkpoint %s: the %d samples taken after it, before the "
                "previous run died, are consumed again (%d replayed in all)",
                self.restored_from,
                replayed,
                self.state.replayed_samples,
            )

    def _mark(self, samples: int) -> None:
        if self.journal is not None:
            self.journal.write(
                Mark(samples=samples, replayed=self.state.replayed_samples, checkpoint=self._base)
            )

    @property
    def replayed_samples(self) -> int:
        """Samples consumed twice because a run died after its last checkpoint."""
        return self.state.replayed_samples

    def count_samples(self, samples: int) -> None:
        """Add samples consumed by all replicas (the loader calls this every batch)."""
        self.state.samples_consumed += samples

    def taking_samples(self, samples: int) -> None:
        """The training loop is about to take a batch of ``samples`` (all replicas).

        Journals them as consumed before the loop sees them, so that a replica
        killed while training on them, or just after, has them counted as replayed
        when the job resumes from an earlier checkpoint.
        """
        self._mark(self.state.samples_consumed + samples)

    def unique_name(self, prefix: str) -> str:
        """``prefix-0``, ``prefix-1``, ...: the same names in the same creation order."""
        count = self._names.get(prefix, 0)
        self._names[prefix] = count + 1
        return f"{prefix}-{count}"

    def states(self) -> Iterator[State]:
        return iter(self._states.values())

    def checkpoint(self) -> None:
        """Save every registered state; rank 0 writes, then all replicas meet.

        States whose contents live partly on other replicas (accumulators) are
        synchronised first, on every replica, in registration order.
        """
        for state in self._states.values():
            if isinstance(state, CollectiveState):
                state.sync()
        entries = {name: state.to_bytes() for name, state in self._states.items()}
        if self.store is not None and self.topology.rank == 0:
            saved = self.store.save(
                entries,
                {
                    "num_replicas": self.topology.num_replicas,
                    "num_restarts": self.topology.num_restarts,
                    "finished_epochs": self.epoch.finished_epochs,
                },
            )
            LOG.info("checkpoint %s written", saved.label)
            self._base = saved.sequence
        self.collective.barrier()
        self.checkpoints_written += 1
        self._steps_since_checkpoint = 0
        self._last_checkpoint_time = self.clock()

    # -- stopping at a batch boundary ----------------------------------------------------
    def request_stop(self) -> None:
        """Ask the job to checkpoint and exit at the next step boundary (signal-safe)."""
        self._stop_requested = True

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    def step_boundary(self, *, training: bool = True) -> Boundary:
        """Called after every optimiser step, on every replica, at the same points.

        Each call starts a non-blocking reduction of (any replica asked to stop,
        rank 0 finds a periodic checkpoint due, rank 0 finds the batch size due for
        another decision) and reads the one started at the previous boundary, so
        every replica acts on the same answer at the same boundary without waiting
        on the network. The job acts on that `Boundary` and returns it: a stop
        checkpoints and raises `Preempted`; a due checkpoint is written and training
        goes on; a due decision is returned (``redecide``) at the next training
        boundary, for the training loop to act on. Boundaries of other loops
        (``training=False``, e.g. validation) still stop and checkpoint, but count
        no step toward ``every_steps``, schedule no decision and never carry one.
        """
        if training:
            self._steps_since_checkpoint += 1
        previous = self._boundary_future
        self._boundary_future = None
        agreed = Boundary.from_wire(previous.result()) if previous is not None else Boundary()
        if agreed.stop:
            self.checkpoint()
            raise Preempted()
        if agreed.checkpoint:
            self.checkpoint()
        # A decision waits for the next training boundary (a validation loop may run
        # in between).
        redecide = self._redecide_pending or agreed.redecide
        self._redecide_pending = redecide and not training
        now = self.clock()
        due_now = (
            self.store is not None
            and self.topology.rank == 0
            # +1: what is found due now is written at the next boundary.
            and self.checkpoint_policy.due(
                self._steps_since_checkpoint + 1, now - self._last_checkpoint_time
            )
        )
        redecide_now = training and self.topology.rank == 0 and now >= self._next_redecide
        if redecide_now:
            self._redecide_interval = self.redecide_schedule.next_interval(self._redecide_interval)
            self._next_redecide = now + self._redecide_interval
        self._boundary_future = self.collective.allreduce_async(
            Boundary(self._stop_requested, due_now, redecide_now).to_wire(), logical_or
        )
        return attrs.evolve(agreed, redecide=redecide and training)

    def on_drain(self, drain: Callable[[], None]) -> None:
        """Have `drain` also wait for a reduction an adapter keeps in flight."""
        self._drains.append(drain)

    def drain(self) -> None:
        """Wait for the reduction the last step boundary started, at the end of training.

        Every replica started it at the same boundary, so it completes at once; a
        process that exits with it still in flight can abort in the transport's
        teardown (gloo: "terminate called without an active exception"), and
        torchrun then restarts a job that had finished. Call it only where every
        replica got this far (a normal end), never after a peer failed. What was
        registered with `on_drain` (the step statistics' own reduction) is waited for
        first, in the order it was started.
        """
        for drain in self._drains:
            drain()
        pending, self._boundary_future = self._boundary_future, None
        if pending is not None:
            pending.result()

    # -- loops ------------------------------------------------------------------------
    def enter_loader(self, loader: LoaderHelper) -> None:
        if self.current_loader is not None:
            raise RuntimeError(
                f"{loader.name} started while {self.current_loader.name} is still being "
                "iterated: only one dataloader loop may run at a time"
            )
        self.current_loader = loader

    def exit_loader(self, loader: LoaderHelper) -> None:
        if self.current_loader is loader:
            self.current_loader = None

    def set_training_loader(self, loader: LoaderHelper) -> None:
        if self.training_loader is not None and self.training_loader is not loader:
            raise RuntimeError(
                f"{self.training_loader.name} is already the training loader; only one "
                f"dataloader may be used for training, not also {loader.name}"
            )
        self.training_loader = loader
        # Keep the parameter groups of a restored estimator: the model's adapter, built
        # later, knows them; reshaping to one group here would drop its statistics.
        gns = self.metrics.gns
        self.metrics.ensure_gns(loader.batch_size, gns.num_groups if gns is not None else 1)

    # -- metrics ------------------------------------------------------------------------
    def record_sync_time(self, seconds: float) -> None:
        """Add gradient-synchronisation time to the step being profiled."""
        self._sync_time += seconds

    def take_sync_time(self) -> float:
        seconds, self._sync_time = self._sync_time, 0.0
        return seconds

    def estimate_samples(self) -> float:
        """Samples in the gradient-noise estimate since it last restarted (0: none yet)."""
        gns = self.metrics.gns
        return gns.samples if gns is not None else 0.0

    def goodput_fn(self) -> GoodputFunction | None:
        """The goodput model fitted so far, or None before enough has been profiled."""
        loader = self.training_loader
        if loader is None:
            return None
        return self.metrics.profiler.goodput_fn(self.metrics.grad_params(), loader.batch_size)
