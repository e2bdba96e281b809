"""Job replay: one elastic job through a timeline of resizes, preemptions and crashes.

A scenario drives a real ``adaptdl.core.job.Job`` in simulated time: the core sampler
(``Shard``) chooses every replica's samples, the core loader walks the epoch and
decides when an adaptive loop ends, the core goodput engine (``GoodputDecision`` on
the job's ``Profiler`` and ``GradientNoiseScale``) picks the batch size and
accumulation, every optimiser step goes through core's step contract
(``adaptdl.core.stats.step``: the noise update with its one-step lag across replicas,
the non-finite skip, the scaling rule, progress, and a reported loss into the
noise floor) exactly as the torch adapter's does, and checkpoints go through a
``MemoryCheckpointStore``. The simulator only supplies time (step times from an
application model), the gradient statistics of the model (handed to core as the
squared norms a real step would measure), and the failures.

On a resize or a preemption the job is asked to stop: it checkpoints at the next
batch boundary and restarts with the new topology. On a crash it dies at once:
whatever it did since its last checkpoint is lost, and replayed after the restart.
The report says, per epoch, whether every sample was consumed exactly once by the
work that survived (padding aside).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import numpy as np

from adaptdl.core.collective import GroupMember, Ready, add, check_root, fold, wire_copy
from adaptdl.core.job import Job
from adaptdl.core.loop.boundary import AgreementCadence, CheckpointPolicy, Preempted
from adaptdl.core.loop.loader import LoaderHelper
from adaptdl.core.order.sampling import Shard
from adaptdl.core.persist.checkpoint import MemoryCheckpointStore
from adaptdl.core.stats.scaling import AdaScale, ScalingRule
from adaptdl.core.stats.step import (
    PairedNorms,
    StepDecision,
    StepLoss,
    StepMeasurement,
    StepStatistics,
)
from adaptdl.core.topology import Topology
from adaptdl.core.validate import check_float, check_int
from adaptdl.sim.apps import ApplicationModel, ParametricApplication, builtin_applications

T = TypeVar("T")

EVENT_KINDS = ("resize", "preempt", "crash")

#: The columns of `ReplayReport.timeline`, as `ReplayReport.to_json` names them.
TIMELINE_COLUMNS = (
    "time",
    "replicas",
    "local_bsz",
    "accum_steps",
    "batch_size",
    "goodput",
    "progress",
)


class SimClock:
    """Simulated seconds, advanced by the replay; callable like ``time.perf_counter``."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


#: A simulated exchange costs nothing: a simulated job agrees at every boundary (a real
#: job on fast steps agrees every few, which moves its stops and decisions by less than
#: half a second of steps).
EVERY_BOUNDARY = AgreementCadence(max_every=1)


class SimCollective(GroupMember):
    """The collective of rank 0 in a job of ``num_replicas`` identical replicas.

    Every replica of a simulated job holds the same values, so a reduction folds
    rank 0's value ``num_replicas`` times and a gather repeats it. Values travel as
    they would between real replicas (core's wire format, with its checks).
    """

    def __init__(self, num_replicas: int) -> None:
        super().__init__(0, num_replicas)

    def broadcast(self, value: T, root: int = 0) -> T:
        check_root(root, self.num_replicas)
        return wire_copy(value)

    def allreduce(self, value: T, op: Callable[[T, T], T] = add) -> T:
        return fold(self.allgather(value), op)

    def allreduce_async(self, value: T, op: Callable[[T, T], T] = add) -> Ready:
        return Ready(self.allreduce(value, op))

    def allgather(self, value: T) -> list[T]:
        return [wire_copy(value) for _ in range(self.num_replicas)]

    def barrier(self) -> None:
        """Every simulated replica is always at the barrier."""


@attrs.frozen
class TimelineEvent:
    """At ``time`` seconds: ``resize`` to ``replicas`` on ``nodes``; ``preempt`` (no GPUs
    for ``duration`` seconds, then ``replicas``/``nodes`` if given); or ``crash``."""

    time: float
    kind: str
    replicas: int | None = None
    nodes: int | None = None
    duration: float = 0.0

    def __attrs_post_init__(self) -> None:
        check_float("time", self.time, min=0.0)
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"event kind must be one of {list(EVENT_KINDS)}, got {self.kind!r}")
        if self.replicas is not None:
            check_int("replicas", self.replicas, min=1)
        if self.nodes is not None:
            check_int("nodes", self.nodes, min=1)
            if self.replicas is not None and self.nodes > self.replicas:
                raise ValueError(f"nodes ({self.nodes}) must be <= replicas ({self.replicas})")
        if self.kind == "resize" and self.replicas is None:
            raise ValueError("a resize event needs replicas")
        check_float("duration", self.duration, min=0.0)


@attrs.frozen
class Scenario:
    """One job and what happens to it. Times in seconds."""

    name: str
    application: str
    epochs: int
    dataset_size: int
    init_batch_size: int
    max_batch_size: int | None = None  # None: fixed batch size
    local_bsz_bounds: tuple[int | None, int | None] | None = None
    gradient_accumulation: bool = False
    replicas: int = 1
    nodes: int = 1
    gpus_per_node: int = 4
    timeline: tuple[TimelineEvent, ...] = ()
    restart_penalty: float = 30.0
    checkpoint_interval: float | None = 600.0
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        check_int("epochs", self.epochs, min=1)
        check_int("dataset_size", self.dataset_size, min=1)
        check_int("init_batch_size", self.init_batch_size, min=1)
        if self.max_batch_size is not None:
            check_int("max_batch_size", self.max_batch_size, min=self.init_batch_size)
        check_int("replicas", self.replicas, min=1)
        check_int("nodes", self.nodes, min=1, max=self.replicas)
        check_int("gpus_per_node", self.gpus_per_node, min=1)
        check_float("restart_penalty", self.restart_penalty, min=0.0)
        if self.checkpoint_interval is not None:
            check_float(
                "checkpoint_interval", self.checkpoint_interval, min=0.0, min_exclusive=True
            )
        times = [e.time for e in self.timeline]
        if times != sorted(times):
            raise ValueError("timeline events must be in time order")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Scenario:
        """Build from JSON data (as :meth:`to_dict` writes)."""
        known = {f.name for f in attrs.fields(cls)}
        extra = sorted(set(data) - known)
        if extra:
            raise ValueError(f"unknown scenario keys {extra}; known: {sorted(known)}")
        values = dict(data)
        values["timeline"] = tuple(TimelineEvent(**e) for e in data.get("timeline", ()))
        if values.get("local_bsz_bounds") is not None:
            values["local_bsz_bounds"] = tuple(values["local_bsz_bounds"])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        out = attrs.asdict(self, recurse=True)
        out["timeline"] = [attrs.asdict(e) for e in self.timeline]
        return out


def load_scenario(path: Path | str) -> Scenario:
    """Read a scenario JSON file; errors name the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        return Scenario.from_dict(data)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"{path}: bad scenario: {exc}") from exc


#: The sizes of the built-in replay application, which its scenarios share.
_REPLAY_SIZES: dict[str, Any] = {
    "epochs": 6,
    "dataset_size": 6000,
    "init_batch_size": 32,
    "max_batch_size": 1024,
    "local_bsz_bounds": (8, 256),
}


def replay_application(name: str = "replay-small") -> ParametricApplication:
    """A small parametric application for built-in replay scenarios.

    Its step-time and noise numbers not given here are `ParametricApplication`'s
    defaults.
    """
    return ParametricApplication(
        name=name,
        **_REPLAY_SIZES,
        beta_c=0.0015,
        alpha_r=0.005,
        alpha_n=0.04,
        noise_start=60.0,
        noise_end=2000.0,
    )


def builtin_scenarios() -> dict[str, Scenario]:
    """Named scenarios that need no external data."""
    base = {
        "application": "replay-small",
        **_REPLAY_SIZES,
        "gradient_accumulation": True,
        "checkpoint_interval": 15.0,
    }
    E = TimelineEvent
    return {
        "elastic": Scenario(
            name="elastic",
            timeline=(
                E(10.0, "resize", replicas=4, nodes=1),
                E(55.0, "crash"),
                E(75.0, "resize", replicas=8, nodes=2),
                E(115.0, "preempt", duration=60.0, replicas=2, nodes=1),
                E(230.0, "crash"),
                E(250.0, "resize", replicas=6, nodes=2),
            ),
            **base,
        ),
        "fixed": Scenario(
            name="fixed",
            **{**base, "max_batch_size": None, "local_bsz_bounds": None},
            replicas=2,
            timeline=(E(10.0, "resize", replicas=4, nodes=1), E(33.0, "crash")),
        ),
        "crashy": Scenario(
            name="crashy",
            replicas=4,
            timeline=tuple(E(11.0 * (i + 1), "crash") for i in range(8)),
            **base,
        ),
    }


@attrs.frozen
class EpochReport:
    epoch: int
    passes: int
    samples: int  # real samples that survived (not padding)
    padding: int
    duplicates: int  # real samples consumed more than once in a pass
    missing: int  # samples of completed passes never consumed
    replayed: int  # samples consumed by work that a crash threw away

    @property
    def exactly_once(self) -> bool:
        return self.duplicates == 0 and self.missing == 0


@attrs.frozen
class ReplayReport:
    scenario: str
    epochs: tuple[EpochReport, ...]
    #: (time, replicas, local_bsz, accum_steps, batch_size, goodput, progress) at every change.
    timeline: tuple[tuple[float, int, int, int, int, float, float], ...]
    restarts: int
    crashes: int
    restart_seconds: float
    lost_seconds: float  # work thrown away by crashes
    end_time: float
    checkpoints: int

    @property
    def exactly_once(self) -> bool:
        return all(e.exactly_once for e in self.epochs)

    def to_json(self) -> dict[str, Any]:
        summary = ("end_time", "restarts", "crashes", "restart_seconds", "lost_seconds")
        return {
            "scenario": self.scenario,
            "exactly_once": self.exactly_once,
            **{key: getattr(self, key) for key in (*summary, "checkpoints")},
            "epochs": [attrs.asdict(e) | {"exactly_once": e.exactly_once} for e in self.epochs],
            "timeline": [dict(zip(TIMELINE_COLUMNS, row, strict=True)) for row in self.timeline],
        }


class _Crash(Exception):
    """The simulated process died (no checkpoint)."""


def even_placement(replicas: int, nodes: int) -> tuple[int, ...]:
    """Replicas per node, ``replicas`` spread over ``nodes`` as evenly as they go
    (the first nodes take one more where they do not divide)."""
    check_int("replicas", replicas, min=1)
    check_int("nodes", nodes, min=1, max=replicas)
    base, extra = divmod(replicas, nodes)
    return tuple(base + (i < extra) for i in range(nodes))


class _Ledger:
    """Samples consumed, split into what a checkpoint made durable and what is pending."""

    def __init__(self) -> None:
        # (epoch, pass) -> counts of real indices; padding counted apart.
        self.counts: dict[tuple[int, int], np.ndarray] = {}
        self.padding: defaultdict[int, int] = defaultdict(int)
        self.replayed: defaultdict[int, int] = defaultdict(int)
        self.pending: list[tuple[int, int, np.ndarray, int]] = []

    def take(self, epoch: int, pass_: int, real: np.ndarray, padding: int) -> None:
        self.pending.append((epoch, pass_, real, padding))

    def commit(self, n: int) -> None:
        for epoch, pass_, real, padding in self.pending:
            counts = self.counts.setdefault((epoch, pass_), np.zeros(n, dtype=np.int64))
            np.add.at(counts, real, 1)
            self.padding[epoch] += padding
        self.pending = []

    def discard(self) -> None:
        for epoch, _, real, _ in self.pending:
            self.replayed[epoch] += len(real)
        self.pending = []


def run_replay(
    scenario: Scenario,
    application: ApplicationModel | None = None,
    *,
    max_runs: int = 1000,
) -> ReplayReport:
    """Run ``scenario`` through the real core; return the report."""
    app = application or _scenario_app(scenario)
    n = scenario.dataset_size
    clock = SimClock()
    store = MemoryCheckpointStore(clock=clock)
    events = list(scenario.timeline)
    ledger = _Ledger()
    replicas, nodes = scenario.replicas, scenario.nodes
    restarts = crashes = 0
    restart_seconds = lost_seconds = 0.0
    timeline: list[tuple[float, int, int, int, int, float, float]] = []
    checkpoints = 0

    for run in range(max_runs):
        topology = Topology(rank=0, num_replicas=replicas, num_nodes=nodes, num_restarts=run)
        policy = CheckpointPolicy(every_seconds=scenario.checkpoint_interval)
        job = Job(
            topology,
            collective=SimCollective(replicas),
            store=store,
            clock=clock,
            checkpoint_policy=policy,
            agreement_cadence=EVERY_BOUNDARY,
        )
        loader = LoaderHelper(job, batch_size=scenario.init_batch_size, name="replay")
        if scenario.max_batch_size is not None:
            loader.autoscale_batch_size(
                scenario.max_batch_size,
                scenario.local_bsz_bounds,
                gradient_accumulation=scenario.gradient_accumulation,
            )
        else:
            loader.train()
        steps = ReplaySteps(StepStatistics(job.metrics, job.collective), scenario.init_batch_size)
        micro = MicroBatches(app, job, loader, clock, steps, even_placement(replicas, nodes))
        written = job.checkpoints_written
        last_checkpoint_time = clock.now
        pending_stop: TimelineEvent | None = None
        prev_local = -1

        def batches(
            epoch: int, index: int, local_bsz: int, world: int = replicas
        ) -> Iterator[tuple[int, int, Any]]:
            shards = [
                Shard(n, index, world, r, seed=scenario.seed, epoch=epoch) for r in range(world)
            ]
            count = shards[0].count
            for lo in range(0, count, local_bsz):
                hi = min(lo + local_bsz, count)
                real = []
                pad = 0
                for s in shards:
                    mask = s.is_padding(lo, hi)
                    idx = s.indices(lo, hi)
                    real.append(idx[~mask])
                    pad += int(mask.sum())
                yield epoch, shards[0].pass_, (np.concatenate(real), pad)

        try:
            for _ in job.epoch.remaining_epochs_until(scenario.epochs):
                for ep, pass_, (real, pad) in loader.iterate(n, batches):
                    if job.checkpoints_written != written:
                        written = job.checkpoints_written
                        last_checkpoint_time = clock.now
                        checkpoints += 1
                        ledger.commit(n)
                    ledger.take(ep, pass_, real, pad)
                    local = loader.current_local_bsz
                    # The application's epochs are stretched over the scenario's.
                    micro.advance(int(ep * app.num_epochs / scenario.epochs))
                    if local != prev_local or not timeline or timeline[-1][1] != replicas:
                        prev_local = local
                        timeline.append(_sample(clock.now, job, loader, replicas, nodes))
                    if pending_stop is None and events and clock.now >= events[0].time:
                        event = events.pop(0)
                        if event.kind == "crash":
                            raise _Crash
                        pending_stop = event
                        job.request_stop()
            # Finished: what it did since the last checkpoint survives (the job ended).
            ledger.commit(n)
            break
        except Preempted:
            checkpoints += 1
            ledger.commit(n)
            restarts += 1
            assert pending_stop is not None
            event = pending_stop
            if event.kind == "preempt":
                clock.now += event.duration
            if event.replicas is not None:
                replicas = event.replicas
                # Without a node count, the replicas pack onto the fewest nodes.
                nodes = event.nodes or -(-replicas // scenario.gpus_per_node)
            nodes = min(event.nodes or nodes, replicas)
            clock.now += scenario.restart_penalty
            restart_seconds += scenario.restart_penalty
        except _Crash:
            crashes += 1
            restarts += 1
            lost_seconds += clock.now - last_checkpoint_time
            ledger.discard()
            clock.now += scenario.restart_penalty
            restart_seconds += scenario.restart_penalty
    return ReplayReport(
        scenario=scenario.name,
        epochs=tuple(_epoch_reports(ledger, n, scenario.epochs)),
        timeline=tuple(timeline),
        restarts=restarts,
        crashes=crashes,
        restart_seconds=restart_seconds,
        lost_seconds=lost_seconds,
        end_time=clock.now,
        checkpoints=checkpoints,
    )


def _scenario_app(scenario: Scenario) -> ApplicationModel:
    apps: dict[str, ApplicationModel] = dict(builtin_applications())
    apps["replay-small"] = replay_application()
    if scenario.application not in apps:
        raise ValueError(
            f"scenario {scenario.name!r}: unknown application {scenario.application!r}; "
            f"built in: {sorted(apps)} (pass an ApplicationModel for others)"
        )
    return apps[scenario.application]


def measurement(
    sqr: float,
    var: float,
    init_batch_size: int,
    local_bsz: int,
    micro_batches: int,
    num_replicas: int,
    prev_local_bsz: int | None = None,
) -> StepMeasurement:
    """The squared norms a step has, in expectation, when its gradient has these statistics.

    ``sqr`` is |G|^2 and ``var`` the variance at the initial batch size, so one
    sample's is ``var * init_batch_size``. Per replica: ``micro_batches`` gradients
    of ``local_bsz`` samples each. A step of one micro-batch in all pairs with the
    previous such step, of ``prev_local_bsz`` samples (None: no previous step).
    """
    v = var * init_batch_size
    count = num_replicas * micro_batches
    cur = sqr + v / local_bsz
    pair = None
    if count == 1 and prev_local_bsz is not None:
        # E|(g_p + g_c) / 2|^2 for independent g_p, g_c of these statistics.
        mixed = sqr + (v / prev_local_bsz + v / local_bsz) / 4
        prev = sqr + v / prev_local_bsz
        pair = PairedNorms(prev_sqr=(prev,), mixed_sqr=(mixed,), prev_batch_size=prev_local_bsz)
    return StepMeasurement(
        local_sqr=(micro_batches * cur,),
        total_sqr=(sqr + v / (local_bsz * count),),
        micro_batches=micro_batches,
        num_replicas=num_replicas,
        batch_size=local_bsz,
        pair=pair,
    )


class ReplaySteps:
    """One run's optimiser steps through core's step contract, as torch's adapter takes them.

    ``init_batch_size`` is the job's initial batch size; ``rule`` the scaling rule
    (default AdaScale, as torch's). Keeps what the adapter keeps between steps:
    whether the previous step (of one micro-batch) left a gradient to pair with,
    and of how many samples.
    """

    def __init__(
        self, stats: StepStatistics, init_batch_size: int, rule: ScalingRule | None = None
    ) -> None:
        self.stats = stats
        self.init_batch_size = check_int("init_batch_size", init_batch_size, min=1)
        self.rule: ScalingRule = rule or AdaScale()
        self.prev_local_bsz: int | None = None

    def step(
        self,
        sqr: float,
        var: float,
        local_bsz: int,
        micro_batches: int,
        num_replicas: int,
        loss: StepLoss | None = None,
    ) -> StepDecision:
        """Measure, decide and commit one step whose gradient has statistics (sqr, var);
        ``loss``: the training loss the program reported for it (None: none), which
        core folds into the job's noise floor as it does torch's."""
        m = measurement(
            sqr,
            var,
            self.init_batch_size,
            local_bsz,
            micro_batches,
            num_replicas,
            self.prev_local_bsz,
        )
        fold = self.stats.measure(m, self.init_batch_size)
        single = m.count == 1 and fold.pairable
        self.prev_local_bsz = local_bsz if single else None
        decision = self.stats.decide(
            local_bsz * micro_batches * num_replicas, self.rule, loss=loss
        )
        assert decision is not None  # measure made the estimator
        self.stats.commit(decision)
        return decision


class MicroBatches:
    """The simulated cost and effect of one run's micro-batches, as a real loop has them.

    Each `advance` is one micro-batch of ``loader``'s current configuration on
    ``placement``: the clock moves by the application's step time (without its
    synchronisation unless the micro-batch ends an optimiser step), and an
    optimiser step records its sync time and goes through core's step contract
    (``steps``) with the application's gradient statistics. Step times are cached
    per local batch size, statistics per (total batch size, application epoch).
    """

    def __init__(
        self,
        app: ApplicationModel,
        job: Job,
        loader: LoaderHelper,
        clock: SimClock,
        steps: ReplaySteps,
        placement: Sequence[int],
    ) -> None:
        self.app, self.job, self.loader, self.clock, self.steps = app, job, loader, clock, steps
        self.placement = tuple(placement)
        self.replicas = sum(self.placement)
        self._step_times: dict[int, tuple[float, float]] = {}
        self._grad_stats: dict[tuple[int, int], tuple[float, float]] = {}

    def advance(self, app_epoch: int) -> bool:
        """Account one micro-batch whose gradient is of ``app_epoch``; True if it ended
        an optimiser step."""
        loader = self.loader
        local = loader.current_local_bsz
        if local not in self._step_times:
            self._step_times[local] = self.app.step_time(self.placement, local)
        step, sync = self._step_times[local]
        if not loader.is_optim_step():
            # A positive floor: a model without compute time must still move the clock.
            self.clock.now += max(step - sync, 1e-6)
            return False
        self.clock.now += step
        self.job.record_sync_time(sync)
        key = (loader.current_batch_size, app_epoch)
        if key not in self._grad_stats:
            self._grad_stats[key] = self.app.grad_stats(*key)
        sqr, var = self._grad_stats[key]
        self.steps.step(sqr, var, local, loader.accumulation_steps + 1, self.replicas)
        return True


def _sample(
    now: float, job: Job, loader: LoaderHelper, replicas: int, nodes: int
) -> tuple[float, int, int, int, int, float, float]:
    fn = job.goodput_fn()
    goodput = 0.0
    if fn is not None and loader.current_local_bsz:
        goodput = float(fn(nodes, replicas, loader.current_local_bsz, loader.accumulation_steps))
    return (
        now,
        replicas,
        loader.current_local_bsz,
        loader.accumulation_steps,
        loader.current_batch_size,
        goodput,
        job.metrics.progress,
    )


def _epoch_reports(ledger: _Ledger, n: int, epochs: int) -> Iterator[EpochReport]:
    for epoch in range(epochs):
        keys = sorted(k for k in ledger.counts if k[0] == epoch)
        samples = duplicates = missing = 0
        for i, key in enumerate(keys):
            counts = ledger.counts[key]
            samples += int(counts.sum())
            duplicates += int(np.maximum(counts - 1, 0).sum())
            # Every pass but an adaptive loop's last one is complete.
            if i < len(keys) - 1 or int((counts > 0).sum()) >= n:
                missing += int((counts == 0).sum())
        yield EpochReport(
            epoch=epoch,
            passes=len(keys),
            samples=samples,
            padding=ledger.padding[epoch],
            duplicates=duplicates,
            missing=missing,
            replayed=ledger.replayed[epoch],
        )
