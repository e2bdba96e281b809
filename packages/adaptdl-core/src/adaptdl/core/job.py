"""The object that owns every piece of core state for one training process."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

from adaptdl.core.collective import Collective, Future, LocalCollective, logical_or, maximum
from adaptdl.core.config import DEFAULT_STOP_WAIT, JobConfig
from adaptdl.core.decide.batchsize import BatchSizeDecision, GoodputDecision, RedecideSchedule
from adaptdl.core.goodput import GoodputFunction
from adaptdl.core.jobreport import REPORT_INTERVAL, Reporter, Share
from adaptdl.core.loop import lifecycle
from adaptdl.core.loop.boundary import (
    EXIT_CODE_PREEMPTED,
    AgreementCadence,
    Boundary,
    CheckpointPolicy,
    Preempted,
)
from adaptdl.core.loop.epoch import EpochState
from adaptdl.core.loop.lifecycle import Event, Lifecycle, Replay, Stop, Train, Write
from adaptdl.core.persist.checkpoint import (
    Checkpoint,
    CheckpointError,
    CollectiveState,
    SavableAlone,
    State,
)
from adaptdl.core.persist.jobstate import JobState
from adaptdl.core.persist.journal import Journal
from adaptdl.core.persist.restore import (
    Store,
    check_missing,
    files_store,
    restore_agreed,
    restore_state,
    where,
)
from adaptdl.core.persist.shardedfiles import FileState
from adaptdl.core.stats.estimators import ESTIMATORS, EstimatorFactory
from adaptdl.core.stats.metrics import MetricsConfig, MetricsState
from adaptdl.core.topology import Topology
from adaptdl.core.validate import check_float, check_int

if TYPE_CHECKING:
    from adaptdl.core.loop.loader import LoaderHelper

__all__ = ["Job"]

LOG = logging.getLogger("adaptdl.core.job")
_NOTHING = Boundary.of(False, False, False)  # a boundary that agreed on nothing
_REDECIDE = Boundary.of(False, False, True)
# A scheduler's one stop may reach a process twice at once (torchrun's forward and
# scancel's own signal): requests this close together count as one.
SAME_STOP_SECONDS = 1.0
OVERDUE_RETRY_SECONDS = 1.0  # an overdue stop that found a checkpoint being written
_NO_STORE = "no checkpoint path (ADAPTDL_CHECKPOINT_PATH) is set"


class Job:
    """One process of an elastic job: topology, collective, checkpoints, loops, metrics.

    Core keeps no module-level state: a process may hold many jobs (tests and the
    simulator do). States registered with the job are restored from its newest
    checkpoint the moment they register, and saved by `checkpoint`. Given a
    ``share`` (the scheduler's share directory of the job), rank 0 publishes the
    job's hints and progress there at step boundaries (`jobreport.Reporter`).
    ``config`` is the configuration the job was built from, read from the
    environment once at start (`JobConfig.from_env`), kept as `config` for whatever
    asks later (default: `JobConfig` with ``topology``, as the simulator's jobs have;
    ``topology`` defaults to the config's).

    It also knows the dataloader loops that run in it: the replay after a restart until
    a loop that is not skipped starts (`replaying`, `on_resume`, `loop_resumes`), the
    loop that runs now and the one that trains (`enter_loader`, `exit_loader`,
    `accumulating`, `set_training_loader`), and what the training loop measures
    (`record_sync_time`, `goodput`, `goodput_fn`).

    ``metrics_config`` (`MetricsConfig`) names the gradient-noise estimator, one of
    ``estimators`` (the declared factory, `adaptdl.core.stats.estimators`), and
    configures the experimental loss floor.
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
        agreement_cadence: AgreementCadence | None = None,
        journal: Journal | None = None,
        allow_missing_state: Collection[str] = (),
        stop_wait: float = DEFAULT_STOP_WAIT,
        share: Share | None = None,
        report_interval: float = REPORT_INTERVAL,
        config: JobConfig | None = None,
        metrics_config: MetricsConfig | None = None,
        estimators: Mapping[str, EstimatorFactory] = ESTIMATORS,
    ) -> None:
        self.topology = topology or (config.topology if config is not None else Topology())
        self.config = config if config is not None else JobConfig(topology=self.topology)
        if self.config.topology != self.topology:
            raise ValueError(
                f"topology {self.topology} disagrees with config.topology {self.config.topology}"
            )
        self.allow_missing_state = frozenset(allow_missing_state)
        self.collective: Collective = collective or LocalCollective()
        if self.collective.num_replicas != self.topology.num_replicas:
            raise ValueError(
                f"collective has {self.collective.num_replicas} replicas but the topology "
                f"has num_replicas={self.topology.num_replicas}"
            )
        self.store = store
        self.clock = clock
        self.batch_size_decision: BatchSizeDecision = batch_size_decision or GoodputDecision(
            self.goodput_fn,
            # (Lambdas: `metrics` is made below.)
            estimate_samples=lambda: self.metrics.estimate_samples(),
            bound_fn=self.bound_goodput_fn,
            resolved=lambda: self.metrics.gradient_resolved(),
            explore_fn=lambda accumulation: self.metrics.profiler.optimistic_fit(accumulation),
        )
        self._states: dict[str, State] = {}
        # name -> the epoch a state belongs to (see `register`).
        self._epoch_scoped: dict[str, int] = {}
        self._names: dict[str, int] = {}
        self._loaded: Checkpoint | None = None
        if store is not None:
            self._loaded = restore_agreed(store, self.collective, self.topology.rank)
        self._base = self._loaded.sequence if self._loaded is not None else 0
        # Rank 0: a checkpoint being committed in the background, and when it was taken;
        # `_base` advances to it only once it is committed.
        self._uncommitted: tuple[Checkpoint, float] | None = None
        self.current_loader: LoaderHelper | None = None
        self.training_loader: LoaderHelper | None = None
        # Loop runs entered so far in this process: a run's identity, where the index
        # alone repeats (every run of a loader starts at 0).
        self.loop_runs = 0
        self._sync_time = 0.0
        self.stop_wait = check_float("stop_wait", stop_wait, min=0.0)
        # The reduction started at the last step boundary; with one replica, its result.
        self._boundary_future: Future[Any] | Boundary | None = None
        self._one_replica = getattr(self.collective, "in_process", False) is True
        self.agreement_cadence = agreement_cadence or AgreementCadence()
        # Boundaries to pass before the next agreement (0: the next one agrees); rank 0's
        # mean step time proposes how many the agreement after it waits.
        self._until_agreement = 0
        self._last_boundary_time: float | None = None
        self._step_time = 0.0  # rank 0's mean seconds per training step (0: unknown)
        self._last_step = 0.0  # and its latest
        self._rank0 = self.topology.rank == 0
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
        # The stop, write, epoch-loop and replay phases (`lifecycle.TRANSITIONS`): a job
        # restored from a checkpoint taken inside a loop replays until a loop resumes.
        in_loop = self._loaded is not None and self.state.in_loop
        self.lifecycle = Lifecycle(replay=Replay.REPLAYING if in_loop else Replay.LIVE)
        self._on_resume: list[Callable[[], None]] = []
        self.boundaries = 0  # step boundaries passed in this process
        self.journal = journal if self.topology.rank == 0 else None
        # Rank 0 tells a scheduler about the job through its share directory.
        self.reporter = (
            Reporter(share, interval=report_interval)
            if share is not None and self._rank0
            else None
        )
        self._record: Callable[[int], None] | None = None  # `samples_recorder`'s
        self._count_replay()
        self.epoch = EpochState()
        self.register(self.epoch)
        # The estimator by name from ``estimators`` (the declared factory), and the
        # experimental loss floor's configuration.
        self.metrics = MetricsState(config=metrics_config, estimators=estimators)
        self.register(self.metrics)
        self.started_at = clock()
        if self._loaded is not None and self._rank0:
            before = self._loaded.metadata.get("num_replicas")
            lifecycle.resumed(
                self._where(self._loaded.label),
                epoch=self.epoch.finished_epochs,
                replicas=self.topology.num_replicas,
                replicas_before=before if isinstance(before, int) else None,
                restart=self.topology.num_restarts,
            )

    # -- states and checkpoints ---------------------------------------------------------
    # -- replay ----------------------------------------------------------------------
    @property
    def replaying(self) -> bool:
        """Whether the program is re-running code that ran before the restart.

        True from the restore of a checkpoint taken inside a dataloader loop until a
        loop that is not skipped starts (`loop_resumes`): the interrupted one, since
        every loop that finished before it in its epoch is skipped.
        """
        return self.lifecycle.replay is Replay.REPLAYING

    def on_resume(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the replay ends (never if the job is not replaying)."""
        if self.replaying:
            self._on_resume.append(callback)

    def loop_resumes(self) -> None:
        """A dataloader loop that was not skipped starts: any replay ends here."""
        if not self.replaying:
            return
        self.lifecycle.fire(Event.RESUME)
        callbacks, self._on_resume = self._on_resume, []
        for callback in callbacks:
            callback()

    # -- loops ------------------------------------------------------------------------
    def enter_loader(self, loader: LoaderHelper) -> None:
        if self.current_loader is not None:
            raise RuntimeError(
                f"{loader.name} started while {self.current_loader.name} is still being "
                "iterated: only one dataloader loop may run at a time"
            )
        self.current_loader = loader
        self.loop_runs += 1

    def in_training_loop(self) -> bool:
        """Whether a loop runs and it is the training loader's (any loop, before one is
        marked for training)."""
        current = self.current_loader
        return current is not None and current is (self.training_loader or current)

    def exit_loader(self, loader: LoaderHelper) -> None:
        if self.current_loader is loader:
            self.current_loader = None

    def accumulating(self) -> bool:
        """Whether the micro-batch in hand only accumulates its gradient (no optimiser
        step follows it): the running loop's `LoaderHelper.is_accum_step`, False
        outside a loop. What the model wrappers ask before each micro-batch."""
        loader = self.current_loader
        return loader is not None and loader.is_accum_step()

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

    def goodput(self) -> float | None:
        """Goodput (useful samples per second) of the training loader's configuration now.

        None before the model is fitted or the training loader decided its batch size.
        """
        loader = self.training_loader
        fn = self.goodput_fn()
        if fn is None or loader is None or loader.current_local_bsz == 0:
            return None
        topo = self.topology
        return float(
            fn.evaluate(
                topo.num_nodes,
                topo.num_replicas,
                loader.current_local_bsz,
                loader.accumulation_steps,
            )
        )

    def goodput_fn(self) -> GoodputFunction | None:
        """The goodput model fitted so far, or None before enough has been profiled."""
        loader = self.training_loader
        return None if loader is None else self.metrics.goodput_fn(loader.batch_size)

    def bound_goodput_fn(self, z: float) -> GoodputFunction | None:
        """`goodput_fn` with the noise scale at its lower confidence bound (``z`` errors)."""
        loader = self.training_loader
        return None if loader is None else self.metrics.bound_goodput_fn(z, loader.batch_size)

    def _where(self, label: str) -> str:
        return where(self.store, label)

    @property
    def restored_from(self) -> str | None:
        """Label of the checkpoint this job resumed from, or None for a fresh start."""
        return self._loaded.label if self._loaded is not None else None

    def register(
        self, state: State, *, epoch: int | None = None, allow_missing: bool = False
    ) -> None:
        """Add ``state`` to every checkpoint, restoring it now from the restored checkpoint.

        A state the restored checkpoint lacks (a renamed model wrapper, an object
        added since, a dropped entry) raises CheckpointError naming the state and
        the checkpoint, unless ``allow_missing`` or the job's ``allow_missing_state``
        (``ADAPTDL_ALLOW_MISSING_STATE``) names it or holds ``"*"``: then it starts
        fresh, with a warning. A state of an ``epoch`` (an accumulator made inside
        it) may always be missing (it may belong to an epoch the checkpoint never
        reached), and leaves the job, and its checkpoints, once that epoch has
        finished: finished epochs never run again, so nothing would ever restore it.
        """
        if state.name in self._states:
            raise ValueError(f"a state named {state.name!r} is already registered")
        if epoch is not None:
            self._epoch_scoped[state.name] = check_int("epoch", epoch, min=0)
        elif self._loaded is not None and state.name not in self._loaded.entries:
            check_missing(
                self._loaded,
                state.name,
                self.store,
                allow_missing=allow_missing,
                allowed=self.allow_missing_state,
            )
        self._states[state.name] = state
        if self._loaded is not None and state.name in self._loaded.entries:
            try:
                restore_state(state, self._loaded, self.store)
            except CheckpointError:
                del self._states[state.name]
                raise

    def _count_replay(self) -> None:
        mark = self.journal.read() if self.journal is not None else None
        if mark is not None:
            self.state.count_replay(mark, fresh=self._loaded is None, resumed=self.restored_from)

    @property
    def global_step(self) -> int:
        """Optimiser steps the training loop took, counting those before restarts.

        Restored from the checkpoint, so that a curve plotted against it continues
        where the previous run left off instead of starting again at 0.
        """
        return self.state.steps

    @property
    def samples_consumed(self) -> int:
        """Samples all replicas consumed in all loops, counting those before restarts."""
        return self.state.samples_consumed

    @property
    def replayed_samples(self) -> int:
        """Samples consumed twice because a run died after its last checkpoint."""
        return self.state.replayed_samples

    def count_samples(self, samples: int) -> None:
        """Add samples consumed by all replicas (the loader calls this every batch)."""
        self.state.samples_consumed += samples

    def samples_recorder(self) -> Callable[[int], None] | None:
        """What the loader calls before the loop sees each batch; None without a journal.

        ``record(samples)`` journals the job's running count of samples with that
        batch included (`Journal.recorder`: one store), so that a replica killed
        while training on it, or just after, has it counted as replayed when the job
        resumes from an earlier checkpoint. The first call writes the run's whole
        record (its replays and checkpoint); checkpoints rewrite it.
        """
        journal = self.journal
        if journal is None:
            return None
        if self._record is None:
            state = self.state
            journal.write_counts(state.samples_consumed, state.replayed_samples, self._base)
            self._record = journal.recorder()
        return self._record

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
        synchronised first, on every replica, in registration order; the
        reductions that adapters keep in flight (`on_drain`) are folded in before.
        """
        started = self.clock()
        self.lifecycle.fire(Event.BEGIN_WRITE)
        try:
            for name, epoch in list(self._epoch_scoped.items()):
                if epoch < self.epoch.finished_epochs:
                    del self._epoch_scoped[name]
                    del self._states[name]
            for drain in self._drains:
                drain()
            for state in self._states.values():
                if isinstance(state, CollectiveState):
                    state.sync()
            files = [state for state in self._states.values() if isinstance(state, FileState)]
            if files and self.store is not None:
                previous, self._uncommitted = self._uncommitted, None
                files_store(self.store, files[0]).write_files(files, self.collective)
                self._commit_known(previous)  # it waited for the previous commit
            self.state.in_loop = self.current_loader is not None
            # Every replica serialises: some states' bytes are made by collectives.
            entries = {name: state.to_bytes() for name, state in self._states.items()}
            saved = self._save(entries) if self._rank0 else None
            self.collective.barrier()
        finally:
            self.lifecycle.fire(Event.END_WRITE)
        self.checkpoints_written += 1
        self._steps_since_checkpoint = 0
        self._last_checkpoint_time = self.clock()
        if saved is None:
            return
        if self._uncommitted is not None:  # committed in the background: said when known
            lifecycle.checkpoint_started(
                self._where(saved.label), epoch=self.epoch.current_epoch, steps=self.state.steps
            )
            self._uncommitted = (saved, started)
        else:
            lifecycle.checkpoint_written(
                self._where(saved.label),
                seconds=self._last_checkpoint_time - started,
                epoch=self.epoch.current_epoch,
                steps=self.state.steps,
            )

    def _commit_known(self, uncommitted: tuple[Checkpoint, float] | None) -> None:
        """``uncommitted``, a checkpoint committed in the background, is now committed."""
        if uncommitted is None:
            return
        saved, started = uncommitted
        self._set_base(saved.sequence)
        lifecycle.checkpoint_written(
            self._where(saved.label),
            seconds=self.clock() - started,
            epoch=self.epoch.current_epoch,
            steps=self.state.steps,
        )

    def _save(self, entries: Mapping[str, bytes]) -> Checkpoint | None:
        saved = None
        if self.store is not None:
            saved = self.store.save(
                entries,
                {
                    "num_replicas": self.topology.num_replicas,
                    "num_restarts": self.topology.num_restarts,
                    "finished_epochs": self.epoch.finished_epochs,
                },
            )
            # A plain save first waited for any checkpoint still being committed.
            self._uncommitted = (saved, self.clock()) if self.store.pending else None
            if self._uncommitted is None:
                self._set_base(saved.sequence)
        return saved

    def _set_base(self, sequence: int) -> None:
        """Checkpoint ``sequence`` is committed: replays count from it, the journal says so."""
        self._base = sequence
        if self.journal is not None:
            self.journal.rebase(self.state.replayed_samples, sequence)

    # -- stopping at a batch boundary ----------------------------------------------------
    def request_stop(self, code: int = EXIT_CODE_PREEMPTED) -> None:
        """Ask the job to checkpoint and exit at the next step boundary (signal-safe).

        ``code`` is the exit status of the `Preempted` that follows; the first
        request's code wins.
        """
        self.lifecycle.fire(Event.REQUEST, code=code)

    @property
    def stop_requested(self) -> bool:
        return self.lifecycle.stop is not Stop.NONE

    @property
    def stop_code(self) -> int:
        """The exit status a stop ends the process with (143 unless asked otherwise)."""
        return self.lifecycle.stop_code

    @property
    def stop_deferred(self) -> bool:
        """Whether a checkpoint is being written (a stop must let it finish first)."""
        return self.lifecycle.write is not Write.IDLE

    def stop_outside_loop(self) -> float | None:
        """Decide what a stop requested where no loop runs does (`request_stop` first).

        One replica checkpoints at once (inside an epoch) and exits. Several replicas
        are not at one agreed point here, and a collective state (an `Accumulator`)
        needs every one of them to save it, so the stop waits for the next point
        every replica reaches: the next loop's step boundaries (`step_boundary`),
        its end (`end_loop`), or where the epoch loop moves on or ends
        (`remaining_epochs_until`); there every replica checkpoints and exits.
        Returns the seconds it may wait (``stop_wait``), after which the caller
        calls `stop_overdue`. It does not wait where no such point will come: after
        the epoch loop ended (its final checkpoint holds everything), when
        ``stop_wait`` is 0, or on a further request at least `SAME_STOP_SECONDS`
        after the first (a scheduler insisting: Slurm's second SIGTERM); then it acts
        as `stop_overdue` does. Raises `Preempted` when it acts now. A stop already
        being acted on (a signal during the stop's own checkpoint) is left to finish:
        None.
        """
        life = self.lifecycle
        if life.stop in (Stop.STOPPING, Stop.STOPPED):
            return None
        if self.topology.num_replicas == 1:
            self._stop_now("")
        now = self.clock()
        if life.waiting_since is not None:
            if now - life.waiting_since < SAME_STOP_SECONDS:
                return life.waiting_since + self.stop_wait - now  # the same stop
            self._stop_now("a second stop signal came while the replicas had not met")
        if life.train is Train.TRAINED:
            self._stop_now("")
        if self.stop_wait == 0:
            self._stop_now("ADAPTDL_STOP_WAIT=0: a stop outside a loop does not wait")
        life.fire(Event.WAIT, now=now)
        if self._rank0:
            lifecycle.stop_waits(
                epoch=self.epoch.current_epoch,
                steps=self.state.steps,
                exit_code=life.stop_code,
                seconds=self.stop_wait,
            )
        return self.stop_wait

    def stop_overdue(self) -> float | None:
        """``stop_wait`` seconds after a stop outside any loop: act on it if still waiting.

        Nothing happens when no stop waits or a loop runs (it acts at its next step
        boundary); while a checkpoint is being written, returns the seconds after
        which to ask again (`OVERDUE_RETRY_SECONDS`), else None. Otherwise the
        replicas did not meet in time: the process exits now, after rank 0 wrote a
        checkpoint alone if every state can be saved by one replica (`SavableAlone`);
        a state that needs every replica (an `Accumulator`) means no checkpoint and
        the job resumes from its newest. Raises `Preempted` when it acts.
        """
        if self.lifecycle.stop is not Stop.WAITING or self.current_loader is not None:
            return None
        if self.stop_deferred:
            return OVERDUE_RETRY_SECONDS
        self._stop_now(f"the replicas did not meet within {self.stop_wait:g} s")

    def _stop_now(self, why: str) -> NoReturn:
        """Exit at once, writing what one replica can write here; ``why`` it cannot wait.

        Inside an epoch, between its loops, every loop that ran ended at a boundary
        all replicas agreed (`end_loop`), so the states are complete and alike: one
        replica checkpoints as usual; of several, rank 0 writes the checkpoint alone,
        without a collective, unless a state needs one (a `CollectiveState` or
        `FileState` that is not `SavableAlone`). Before the first epoch and after
        the last (a finished training wrote its own) nothing is written.
        """
        self.lifecycle.fire(Event.ACT_ALONE)
        epoch, steps, code = self.epoch.current_epoch, self.state.steps, self.stop_code
        together = self.topology.num_replicas == 1
        reason = None
        if self.store is None:
            reason = _NO_STORE
        elif epoch is None:
            reason = (
                "the epoch loop has finished; its final checkpoint holds everything"
                if self.lifecycle.train is Train.TRAINED
                else "no epoch is running (nothing trained since the newest checkpoint)"
            )
        elif not together and any(
            isinstance(s, (CollectiveState, FileState)) and not isinstance(s, SavableAlone)
            for s in self._states.values()
        ):
            reason = (
                f"{why}, and a state (an Accumulator or sharded files) needs every replica "
                "to save it; the job resumes from the newest checkpoint"
            )
        if reason is not None:
            if self._rank0:
                lifecycle.stopping_without_checkpoint(
                    epoch=epoch, steps=steps, exit_code=code, reason=reason
                )
            self._exit()
        if together:
            if self._rank0:
                lifecycle.stopping(epoch=epoch, steps=steps, exit_code=code)
            self.checkpoint()
            self._committed()
            self._exit()
        if self._rank0:
            LOG.warning("%s: rank 0 writes the checkpoint alone", why)
            lifecycle.stopping(epoch=epoch, steps=steps, exit_code=code)
            self.lifecycle.fire(Event.BEGIN_WRITE)  # a second signal must not cut it short
            try:
                self.state.in_loop = False
                self._save(
                    {
                        name: s.bytes_alone() if isinstance(s, SavableAlone) else s.to_bytes()
                        for name, s in self._states.items()
                    }
                )
            finally:
                self.lifecycle.fire(Event.END_WRITE)
        self._committed(together=False)  # the replicas are not at one point here
        self._exit()

    def _exit(self) -> NoReturn:
        """The stop is done: raise `Preempted` with its exit status."""
        self.lifecycle.fire(Event.EXIT)
        raise Preempted(self.stop_code)

    def collective_failed(self, error: BaseException) -> BaseException:
        """What to raise for a collective that failed with ``error``.

        A replica asked to stop whose peer left (it stopped first: its wait ran out,
        or a second signal came) exits with the stop's status, `Preempted`, instead
        of a traceback: the peer's exit was the stop, not a failure. Else ``error``.
        """
        if self.lifecycle.stop is Stop.NONE:
            return error
        LOG.warning(
            "a collective failed while this replica was stopping (%s): a peer stopped "
            "first; exiting with status %d without a checkpoint",
            error,
            self.stop_code,
        )
        self.lifecycle.fire(Event.PEER_LEFT)
        stopped = Preempted(self.stop_code)
        stopped.__cause__ = error
        return stopped

    def _agree_stop(self) -> bool:
        """At a point every replica reaches: whether any of them was asked to stop.

        The caller acts on a True at once (`_stop_here`, or the exit after training),
        firing `Event.AGREE`.
        """
        stop = self.stop_requested
        if not self._one_replica:
            stop = bool(self.collective.allreduce([stop], logical_or)[0])
        return stop

    def step_boundary(self, *, training: bool = True) -> Boundary:
        """Called after every optimiser step, on every replica, at the same points.

        At an agreeing boundary it starts a non-blocking reduction of (any replica
        asked to stop, rank 0 finds a periodic checkpoint due, rank 0 finds the batch
        size due for another decision, rank 0's proposed cadence) and reads the one
        started at the previous agreement, so every replica acts on the same answer at
        the same boundary without waiting on the network. Agreements come every
        ``k``-th boundary, ``k`` agreed from rank 0's step times by
        `agreement_cadence` (1 for slow steps, more for fast ones, whose step the
        reduction's fixed cost would otherwise burden); the boundaries between them
        only pass on a decision a validation loop deferred. The job acts on the agreed
        `Boundary` and returns it: a stop checkpoints and raises `Preempted`; a due
        checkpoint is written and training goes on; a due decision is returned
        (``redecide``) at the next training boundary, for the training loop to act
        on. Boundaries of other loops (``training=False``, e.g. validation) still
        stop and checkpoint, but count no step toward ``every_steps``, schedule no
        decision and never carry one.
        """
        self.boundaries += 1
        if training:
            self._steps_since_checkpoint += 1
            self.state.steps += 1
        now = self.clock()
        if self._rank0:
            if training:
                self._report(now)
            if not self._one_replica:
                self._time_step(now, training)
        if self._until_agreement > 0:
            # Between agreements: nothing to read, nothing to start.
            self._until_agreement -= 1
            if self._redecide_pending and training:
                self._redecide_pending = False
                return _REDECIDE
            return _NOTHING
        pending, self._boundary_future = self._boundary_future, None
        agreed, every = self._agreed(pending)
        if agreed.stop:
            self._stop_here()
        if agreed.checkpoint:
            self.checkpoint()
        # A decision waits for the next training boundary (a validation loop may run
        # in between).
        redecide = self._redecide_pending or agreed.redecide
        self._redecide_pending = redecide and not training
        due_now = redecide_now = False
        proposed = 1
        if self._rank0:
            # +1: what is found due now is written at the next agreement (at the next
            # boundary when checkpoints are counted in steps: those agree at every one).
            due_now = self.store is not None and self.checkpoint_policy.due(
                self._steps_since_checkpoint + 1, now - self._last_checkpoint_time
            )
            if training and now >= self._next_redecide:
                redecide_now = True
                interval = self.redecide_schedule.next_interval(self._redecide_interval)
                self._redecide_interval = interval
                self._next_redecide = now + interval
            if self.checkpoint_policy.every_steps is None:
                # The latest step counts whole when it is slower than the mean: steps that
                # just became slower (a larger batch) must not keep a fast step's spacing.
                proposed = self.agreement_cadence.every(max(self._step_time, self._last_step))
        stop = self.stop_requested
        if self._one_replica:
            # One replica's reduction is its own flags, kept as their Boundary: no future
            # to build every step, and no exchange to space out.
            if stop or due_now or redecide_now:
                self._boundary_future = Boundary.of(stop, due_now, redecide_now)
            else:
                self._boundary_future = _NOTHING
        else:
            # Integers reduced by their maximum: the flags' logical or, and rank 0's
            # proposal (the others propose 1), which a collective may send as one
            # small tensor.
            self._boundary_future = self.collective.allreduce_async(
                [int(stop), int(due_now), int(redecide_now), proposed], maximum
            )
            self._until_agreement = every - 1
        if agreed.redecide == (redecide and training):  # the common case: no new value
            return agreed
        return Boundary.of(agreed.stop, agreed.checkpoint, redecide and training)

    def _report(self, now: float) -> None:
        """Rank 0, at a training boundary: tell the scheduler about the job when due."""
        reporter = self.reporter
        if reporter is not None and now >= reporter.due:
            reporter.report(
                now,
                topology=self.topology,
                step=self.state.steps,
                loader=self.training_loader or self.current_loader,
                metrics=self.metrics,
            )

    def _time_step(self, now: float, training: bool) -> None:
        """Rank 0: fold the time since the last training boundary into the mean step
        time it proposes the agreements' cadence from (a boundary of another loop, and
        the first of a loop, time no step)."""
        last = self._last_boundary_time
        self._last_boundary_time = now if training else None
        if last is None or not training:
            return
        interval = now - last
        self._last_step = interval
        if self._step_time <= 0.0:
            self._step_time = interval
        else:
            self._step_time += 0.1 * (interval - self._step_time)

    def _settle(self) -> Boundary:
        """What the replicas agreed at the last agreement (nothing if none is pending).

        Every replica settles at the same points (the end of a loop, of training), so
        the next step boundary agrees again on every replica.
        """
        pending, self._boundary_future = self._boundary_future, None
        self._until_agreement = 0
        self._last_boundary_time = None
        return self._agreed(pending)[0]

    @staticmethod
    def _agreed(pending: Future[Any] | Boundary | None) -> tuple[Boundary, int]:
        """The boundary a pending reduction (or one replica's own flags) agreed on, and
        the agreed count of boundaries to the next agreement (1: none pending)."""
        if pending is None:
            return _NOTHING, 1
        if isinstance(pending, Boundary):
            return pending, 1
        flags = pending.result()
        return Boundary.from_wire(flags[:3]), max(1, int(flags[3]))

    def _stop_here(self) -> NoReturn:
        """Every replica at one boundary: checkpoint and raise `Preempted`."""
        # Agreed: no deadline acts on it any more (rank 0 would write alone while its
        # peers checkpoint together), and a replica that got no signal stops as one
        # asked (a peer's exit during the checkpoint is the stop, not a failure).
        self.lifecycle.fire(Event.AGREE)
        if self._rank0:
            epoch, steps, code = self.epoch.current_epoch, self.state.steps, self.stop_code
            if self.store is None:
                lifecycle.stopping_without_checkpoint(
                    epoch=epoch, steps=steps, exit_code=code, reason=_NO_STORE
                )
            else:
                lifecycle.stopping(epoch=epoch, steps=steps, exit_code=code)
        self.checkpoint()
        self._committed()
        self._exit()

    def _committed(self, *, together: bool = True) -> None:
        """Wait for a checkpoint being written in the background to be committed.

        ``together`` (every replica here): then the replicas agree on its outcome,
        which keeps every replica alive until rank 0 has committed it (a launcher
        may end the others once one exits) and has all raise if it failed. A
        signal meanwhile waits too.
        """
        if self.store is None or not self.store.pending:
            return
        self.lifecycle.fire(Event.BEGIN_WRITE)
        previous, self._uncommitted = self._uncommitted, None
        try:
            self.store.wait(self.collective if together else None)
            self._commit_known(previous)
        finally:
            self.lifecycle.fire(Event.END_WRITE)

    def end_loop(self) -> None:
        """At the normal end of a loop, on every replica: settle its last step boundary.

        Waits for the reduction the last boundary started and agrees once more on a
        stop (one blocking reduction per loop), so that a SIGTERM which arrived
        after the last boundary still checkpoints and exits here, at a point every
        replica reaches together, rather than being left for a loop that may never
        come. A due checkpoint is written; a due decision waits for the next
        training boundary. Raises `Preempted` after checkpointing on a stop.
        """
        agreed = self._settle()
        if self.collective.allreduce([agreed.stop or self.stop_requested], logical_or)[0]:
            self._stop_here()
        if agreed.checkpoint:
            self.checkpoint()
        self._redecide_pending = self._redecide_pending or agreed.redecide

    def remaining_epochs_until(self, epoch: int) -> Iterator[int]:
        """The epoch loop (`EpochState.remaining_epochs_until`) that ends training well.

        When it runs to its end, having run an epoch, the reductions in flight are
        waited for (`drain`) and a final checkpoint is written, so that a relaunch
        of the finished job, or a stop during what the program does afterwards,
        trains nothing again; a stop requested meanwhile then raises `Preempted`.
        Raises ValueError for a bad ``epoch``, RuntimeError inside another epoch loop.
        """
        return self._epochs(self.epoch.remaining_epochs_until(epoch))

    def _epochs(self, epochs: Iterator[int]) -> Iterator[int]:
        self.lifecycle.fire(Event.BEGIN_EPOCHS)
        ran = False
        for current in epochs:
            # Where the epoch loop moves on every replica meets: a stop requested
            # between loops (an evaluation) checkpoints here, the epoch before finished.
            if ran and self._agree_stop():
                self._stop_here()
            ran = True
            yield current
        self.lifecycle.fire(Event.BEGIN_FINISH)  # a stop now waits for the final checkpoint
        try:
            self.drain()
            if ran and self.store is not None:
                self.checkpoint()
                self._committed()
        finally:
            self.lifecycle.fire(Event.END_FINISH)
        stop = self._agree_stop()
        # From here on a stop has nothing to save and exits at once.
        self.lifecycle.fire(Event.END_EPOCHS)
        if stop:
            self.lifecycle.fire(Event.AGREE)
            if self._rank0:
                lifecycle.stopped_after_training(steps=self.state.steps, exit_code=self.stop_code)
            self._exit()

    def on_drain(self, drain: Callable[[], None]) -> None:
        """Have `drain` also wait for a reduction an adapter keeps in flight."""
        self._drains.append(drain)

    def batch_size_changed(self) -> None:
        """The training loader's total batch size changed: report it at the next step."""
        if self.reporter is not None:
            self.reporter.report_soon()

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
        self._settle()
