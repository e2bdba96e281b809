"""A training job in the simulated cluster, advanced analytically between events.

Between two events a job's configuration (GPUs, batch size, epoch) is constant, so
its progress grows linearly: ``gain / iteration_time`` of scale-invariant progress per
second. The job's *decisions* are core's, reached as the real loader reaches them:
its :class:`JobGoodput` records the step times the job experiences in a core
``Profiler``, which fits the core performance model to them; with the gradient
statistics the job measures, core's ``GoodputDecision`` answers the loader's query
(``batch_size_query``), and the job publishes core's scheduling hints for the
scheduler to read.
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from typing import Any

from adaptdl.core.decide.batchsize import (
    BatchSizeQuery,
    GoodputDecision,
    batch_size_query,
    even_split,
    pass_capped,
)
from adaptdl.core.decide.hints import hints
from adaptdl.core.goodput import GoodputFunction, GradParams, PerfParams
from adaptdl.core.stats.profiler import Profiler
from adaptdl.core.stats.timings import FIT_AFTER
from adaptdl.core.validate import check_float, check_int
from adaptdl.sim.apps import ApplicationModel, Placement, normalize_placement
from adaptdl.sim.workload import JobSpec

# The job's profiler records a configuration the first time its atomic batch size
# falls in a new geometric bucket of this ratio (step times in the simulation are
# exact, and every new configuration costs the core a full refit: for the smooth
# model, one point per bucket says as much as one per batch size).
_BSZ_BUCKET = 1.25


class JobGoodput:
    """One job's goodput engine: a core ``Profiler`` of the step times it experienced,
    the performance model the profiler fits, the job's gradient statistics, and the
    core batch-size decision that uses them."""

    def __init__(
        self,
        init_batch_size: int,
        max_batch_size: int,
        local_bsz_bounds: tuple[int, int],
        *,
        accumulation: bool = True,
        dataset_size: int = 0,
    ) -> None:
        self.init_batch_size = init_batch_size
        # Capped at one pass by core's rule, for the queries and the hints alike.
        self.max_batch_size = pass_capped(max_batch_size, init_batch_size, dataset_size)
        self.local_bsz_bounds = local_bsz_bounds
        self.accumulation = accumulation
        self.profiler = Profiler()
        self._buckets: set[tuple[int, int, int]] = set()
        self._params: PerfParams | None = None
        self.grad = GradParams(0.0, 0.0)
        self._fn: GoodputFunction | None = None
        self._hints: dict[str, Any] | None = None
        #: Samples the job has trained on: what its gradient-noise estimate has seen,
        #: which core's decision measures the estimate's warm-up in.
        self.samples = 0.0
        #: The decision the real loader makes by default (core's).
        self.decision = GoodputDecision(
            self.goodput_fn,
            estimate_samples=lambda: self.samples,
            explore_fn=self.profiler.optimistic_fit,
        )

    @property
    def fits(self) -> int:
        """How many times the profiler fitted the performance model."""
        return self.profiler.num_fits

    @property
    def has_profile(self) -> bool:
        """Whether any step has been observed (and a model can be fitted)."""
        return bool(self._buckets)

    @property
    def max_profiled_replicas(self) -> int:
        """Most replicas of any observed configuration (0 before any)."""
        return self.profiler.max_profiled_replicas

    def record(
        self,
        num_nodes: int,
        num_replicas: int,
        atomic_bsz: int,
        accum_time: float,
        optim_time: float,
        sync_time: float = 0.0,
    ) -> None:
        """Profile the accumulation micro-batches and optimiser steps a configuration
        needs to enter the fit (`FIT_AFTER` of each, all at the modelled time): its
        accumulation time counts as measured, as a real job's does once it has
        accumulated that often, so the fit identifies the optimiser step's own cost
        (``alpha_o``; the apps' is 0) and the decision has no accumulation to try."""
        bucket = round(math.log(atomic_bsz) / math.log(_BSZ_BUCKET))
        key = (num_nodes, num_replicas, bucket)
        if key in self._buckets:
            return
        self._buckets.add(key)
        p = self.profiler
        # The modelled times are steady steps; as many as a configuration needs to enter
        # the fit (a real job's first few could hold a spike; these cannot).
        for _ in range(FIT_AFTER):
            p.record(num_nodes, num_replicas, atomic_bsz, accum_step=True, step_time=accum_time)
            p.record(
                num_nodes,
                num_replicas,
                atomic_bsz,
                accum_step=False,
                step_time=optim_time,
                sync_time=sync_time,
            )

    @property
    def perf_params(self) -> PerfParams | None:
        """The performance model the profiler fitted (it refits when it learnt more)."""
        params = self.profiler.perf_params()
        if params is not self._params:
            self._params = params
            self._fn = None
            self._hints = None
        return params

    def set_grad(self, grad: GradParams) -> None:
        """Set the gradient statistics (variance at the initial batch size)."""
        if grad != self.grad:
            self.grad = grad
            self._fn = None
            self._hints = None

    def goodput_fn(self) -> GoodputFunction | None:
        """The core goodput function of this job now, or None before any profile.

        The same model the real job's ``goodput_fn`` builds from its profiler; kept
        while neither the fit nor the gradient statistics change, so that a caller can
        tell by identity whether the model changed.
        """
        params = self.perf_params
        if params is None:
            return None
        if self._fn is None:
            self._fn = self.profiler.goodput_fn(self.grad, self.init_batch_size)
        return self._fn

    def query(
        self, num_nodes: int, num_replicas: int, current: tuple[int, int] | None
    ) -> BatchSizeQuery:
        """The query the job's loader asks on ``num_replicas`` replicas (core's builder)."""
        local, accum = current or (0, 0)
        return batch_size_query(
            num_nodes,
            num_replicas,
            self.init_batch_size,
            max_batch_size=self.max_batch_size,
            local_bsz_bounds=self.local_bsz_bounds,
            gradient_accumulation=self.accumulation,
            local_bsz=local,
            accum_steps=accum,
        )

    @property
    def mature(self) -> bool:
        """Whether the decision's growth cap is lifted (its noise estimate warmed up)."""
        query = self.query(1, 1, None)
        return self.decision.maturity(query) >= 1.0

    def decide(
        self, num_nodes: int, num_replicas: int, current: tuple[int, int] | None = None
    ) -> tuple[int, int]:
        """(atomic_bsz, accum_steps) by core's decision, from the last one ``current``."""
        return self.decision(self.query(num_nodes, num_replicas, current))

    def hints(self) -> dict[str, Any]:
        """The job's scheduling hints, core's document (rebuilt when the model changes)."""
        self.goodput_fn()  # refits if due, and drops stale hints
        if self._hints is None:
            self._hints = hints(
                self.profiler,
                self.grad,
                self.init_batch_size,
                self.max_batch_size,
                self.local_bsz_bounds,
                self.accumulation,
            )
        return self._hints


class SimJob:
    """State of one job in the cluster simulation (read by policies, written by the sim).

    It is the simulator's ``adaptdl.sched.view.OracleJobView``: a policy reads it as it
    reads a live job, plus its true speed. ``max_replicas`` bounds its GPUs (the
    cluster's, by default: none); ``restart_cost`` is what the policy is told a
    restart costs it (the cluster's restart penalty).
    """

    #: A simulated job runs on any number of GPUs from one.
    min_replicas = 1

    def __init__(
        self,
        spec: JobSpec,
        app: ApplicationModel,
        *,
        adaptive: bool,
        accumulation: bool = True,
        max_replicas: int = sys.maxsize,
        restart_cost: float = 30.0,
    ) -> None:
        check_int("max_replicas", max_replicas, min=1)
        check_float("restart_cost", restart_cost, min=0.0)
        self.max_replicas = max_replicas
        self.restart_cost = restart_cost
        self.spec = spec
        self.app = app
        self.name = spec.name
        self.submit = spec.submit
        self.adaptive = adaptive
        self.progress = 0.0
        self.epoch = 0
        self.checkpoint_progress = 0.0
        self.nodes: list[int] = []  # node index of each allocated GPU
        self.placement: Placement = ()
        self.restart_until = -math.inf
        self.atomic_bsz = 0
        self.accum_steps = 0
        self.batch_size = spec.batch_size
        self.iter_time = math.inf
        self.rate = 0.0  # progress per second once running
        self.last_time = spec.submit
        self.attained_service = 0.0  # GPU-seconds held
        self.run_time = 0.0  # seconds with any GPU allocated
        self.restarts = 0
        self.failures = 0
        self.started: float | None = None
        self.finish: float | None = None
        self.last_change = spec.submit  # when the allocation last changed
        self.version = 0
        self.restart_time = 0.0  # seconds spent restarting
        self.history: list[tuple[float, int, int, int]] = []  # (time, GPUs, batch, accum)
        self._decided_with: GoodputFunction | None = None
        # The samples seen at a decision made under the warm-up's growth cap (None: none).
        self._capped_at: float | None = None
        self.goodput = JobGoodput(
            app.init_batch_size,
            app.max_batch_size,
            app.local_bsz_bounds,
            accumulation=accumulation,
            dataset_size=app.dataset_size,
        )
        self._update_grad()

    # -- views for policies ----------------------------------------------------

    @property
    def num_gpus(self) -> int:
        """GPUs allocated now."""
        return len(self.nodes)

    @property
    def num_nodes(self) -> int:
        """Distinct nodes allocated now."""
        return len(set(self.nodes))

    @property
    def requested_replicas(self) -> int:
        """The GPUs its user asked for (what non-adaptive policies give it)."""
        return self.spec.num_replicas

    @property
    def submitted_batch_size(self) -> int:
        """The batch size its user asked for (what non-adaptive policies run it at)."""
        return self.spec.batch_size

    @property
    def min_local_bsz(self) -> int:
        """The smallest batch one replica may take."""
        return self.app.local_bsz_bounds[0]

    @property
    def remaining_progress(self) -> float:
        """Scale-invariant progress still needed to complete."""
        return max(self.app.target_progress - self.progress, 0.0)

    @property
    def done(self) -> bool:
        return self.finish is not None

    def running_at(self, time: float) -> bool:
        """Whether the job is making progress at ``time`` (allocated and not restarting)."""
        return bool(self.nodes) and time >= self.restart_until

    @property
    def hints(self) -> dict[str, Any]:
        """The job's scheduling hints (core's ``adaptdl.hints/1`` document)."""
        return self.goodput.hints()

    def fixed_config(self, placement: Placement) -> tuple[int, int]:
        """(atomic_bsz, accum_steps) for the submitted batch size on ``placement``.

        Core's even split: a job that keeps its batch size takes it as given, and only
        the upper local bound (what fits on a GPU) applies, by accumulating.
        """
        query = batch_size_query(
            len(placement),
            sum(placement),
            self.spec.batch_size,
            local_bsz_bounds=(None, self.app.local_bsz_bounds[1]),
            gradient_accumulation=True,
        )
        return even_split(query)

    def estimated_rate(self, placement: Placement) -> float:
        """True progress per second at the submitted batch size on ``placement`` (oracle)."""
        gpus = sum(placement)
        atomic, accum = self.fixed_config(placement)
        step, _ = self.app.iteration_time(placement, atomic, accum)
        batch = gpus * atomic * (accum + 1)
        return self.app.gain(batch, self.epoch) / step

    # -- simulation ------------------------------------------------------------

    def advance(self, time: float) -> None:
        """Move the job's progress and accounting forward to ``time``."""
        dt = time - self.last_time
        if dt <= 0:
            return
        if self.nodes:
            self.attained_service += dt * len(self.nodes)
            self.run_time += dt
            start = max(self.last_time, self.restart_until)
            if time > start:
                self.progress = min(
                    self.progress + self.rate * (time - start), self.app.target_progress
                )
                if self.iter_time > 0 and math.isfinite(self.iter_time):
                    self.goodput.samples += (time - start) / self.iter_time * self.batch_size
        self.last_time = time

    def set_allocation(self, time: float, nodes: list[int], restart_penalty: float) -> bool:
        """Apply a new allocation at ``time``; return whether it changed.

        A graceful change checkpoints at the batch boundary (no progress lost) and
        costs ``restart_penalty`` seconds before the job steps again.
        """
        if sorted(nodes) == sorted(self.nodes):
            return False
        self.advance(time)
        self.checkpoint_progress = self.progress
        if self.nodes or self.started is not None:
            self.restarts += 1
        self.nodes = sorted(nodes)
        self.last_change = time
        self.version += 1
        if not nodes:
            self.placement = ()
            self.rate = 0.0
            self.restart_until = -math.inf
            self.history.append((time, 0, self.batch_size, self.accum_steps))
            return True
        if self.started is None:
            self.started = time
        self.restart_until = time + restart_penalty
        self.restart_time += restart_penalty
        self.placement = normalize_placement(list(Counter(nodes).values()))
        self.configure(time)
        return True

    def lose_allocation(self, time: float) -> None:
        """A failure: the allocation is gone and progress since the checkpoint is lost."""
        self.advance(time)
        self.progress = self.checkpoint_progress
        self.epoch = self.app.epoch_at(self.progress)
        self._update_grad()
        self.nodes = []
        self.placement = ()
        self.rate = 0.0
        self.restart_until = -math.inf
        self.failures += 1
        self.version += 1
        self.last_change = time
        self.history.append((time, 0, self.batch_size, self.accum_steps))

    def configure(self, time: float) -> None:
        """Choose the batch size for the current allocation and epoch; set the rate."""
        gpus = len(self.nodes)
        if gpus == 0:
            return
        nnodes = len(self.placement)
        if self.adaptive:
            # The job profiles its first steps and decides again once its model learnt
            # from them (as the real loader does within its first batches), each time
            # from its last decision, as the loader asks.
            atomic, accum = self.atomic_bsz, self.accum_steps
            for _ in range(2):
                before = self.goodput.goodput_fn()
                current = (atomic, accum) if atomic else None
                atomic, accum = self.goodput.decide(nnodes, gpus, current)
                self._measure(nnodes, gpus, atomic)
                self._decided_with = self.goodput.goodput_fn()
                if self._decided_with is before:
                    break
            self._capped_at = None if self.goodput.mature else self.goodput.samples
        else:
            atomic, accum = self.fixed_config(self.placement)
            self._measure(nnodes, gpus, atomic)
        self.atomic_bsz, self.accum_steps = atomic, accum
        self.batch_size = gpus * atomic * (accum + 1)
        step, _ = self.app.iteration_time(self.placement, atomic, accum)
        self.iter_time = step
        self.rate = self.app.gain(self.batch_size, self.epoch) / step
        self.version += 1
        if not self.history or self.history[-1][1:] != (gpus, self.batch_size, accum):
            self.history.append((time, gpus, self.batch_size, accum))

    def _measure(self, nnodes: int, gpus: int, atomic: int) -> None:
        # What the job's profiler measures: a compute-only micro-batch (the step less
        # its synchronisation) and optimiser steps (`JobGoodput.record`).
        step, sync = self.app.step_time(self.placement, atomic)
        self.goodput.record(nnodes, gpus, atomic, max(step - sync, 1e-6), step, sync)

    def maybe_reconfigure(self, time: float) -> bool:
        """Decide the batch size again if the job's goodput model changed since it last did,
        or its last decision was capped by the warm-up and it has trained since.

        Returns whether it decided again (the rate, and so the next boundary, may have
        changed). The caller must have advanced the job to ``time``.
        """
        if not self.adaptive or not self.nodes or self.done:
            return False
        # A decision under the warm-up's cap is asked again once the job trained on more
        # samples (every round, as the real loader re-decides every few seconds).
        warming = self._capped_at is not None and self.goodput.samples > self._capped_at
        if self.goodput.goodput_fn() is self._decided_with and not warming:
            return False
        self.configure(time)
        return True

    def next_boundary(self) -> tuple[float, bool] | None:
        """(time, is_completion) of the next epoch boundary at the current rate, if any."""
        if not self.nodes or self.rate <= 0 or self.done:
            return None
        target = float(self.app.epoch_progress[self.epoch])
        start = max(self.last_time, self.restart_until)
        return start + max(target - self.progress, 0.0) / self.rate, (
            self.epoch == self.app.num_epochs - 1
        )

    def cross_boundary(self, time: float) -> bool:
        """Handle an epoch boundary at ``time``; return whether the job completed."""
        self.advance(time)
        target = float(self.app.epoch_progress[self.epoch])
        # The event time is exact up to rounding: snap onto the boundary.
        self.progress = max(self.progress, target)
        self.checkpoint_progress = self.progress
        if self.epoch == self.app.num_epochs - 1:
            self.finish = time
            self.version += 1
            return True
        self.epoch += 1
        self._update_grad()
        self.configure(time)
        return False

    def _update_grad(self) -> None:
        self.goodput.set_grad(self.app.grad_params(self.batch_size, self.epoch))
