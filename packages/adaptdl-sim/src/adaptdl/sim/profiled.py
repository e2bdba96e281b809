"""An application model from one real run's measured profile, and a job driven to a progress.

A real job leaves behind two measurements the simulator needs: the throughput model
its profiler fitted (:class:`~adaptdl.core.goodput.PerfParams`) and its
gradient-noise estimates (``sqr``, ``var``) along the scale-invariant progress.
:class:`ProfiledApplication` is the application model made of exactly these: step
times from core's model with the fitted parameters, and the gradient statistics of
the nearest measured point of progress (each point is one of the model's epochs).

:func:`simulate_to_progress` runs one job of such a model (or of any application
model, a trace's included) through the real core (a
``Job`` with its loader, profiler, gradient-noise estimator and batch-size decision,
every optimiser step through core's step contract, as `adaptdl.sim.replay` does) in
simulated time, until its progress reaches one or more targets: with the job's own adaptive
decision, or at a fixed (local batch size, accumulation steps).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

import attrs
import numpy as np
import numpy.typing as npt

from adaptdl.core.decide.batchsize import FixedSplit
from adaptdl.core.goodput import PerfParams
from adaptdl.core.job import Job
from adaptdl.core.loop.boundary import CheckpointPolicy
from adaptdl.core.loop.loader import LoaderHelper
from adaptdl.core.stats.scaling import ScalingRule
from adaptdl.core.stats.step import StepStatistics
from adaptdl.core.topology import Topology
from adaptdl.core.validate import ArgumentTypeError, check_float, check_int
from adaptdl.sim.apps import ApplicationModel, FloatArray, model_step_time, stats_by_batch_size
from adaptdl.sim.replay import (
    EVERY_BOUNDARY,
    MicroBatches,
    ReplaySteps,
    SimClock,
    SimCollective,
    even_placement,
)


def _floats(name: str, values: Sequence[float] | FloatArray) -> FloatArray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1 or not len(array):
        raise ValueError(f"{name} must be a non-empty sequence of numbers, got {values!r}")
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        raise ValueError(f"{name} must hold finite numbers >= 0, got {values!r}")
    return array


class ProfiledApplication(ApplicationModel):
    """The application of one measured run: its fitted throughput, its noise over progress.

    ``progress`` (increasing), ``sqr`` and ``var`` are the gradient-noise estimates
    (|G|^2 and the variance at the initial batch size) at points of the run's
    scale-invariant progress. Point ``i`` is the model's epoch ``i``: it holds from
    the midpoint with the point before to the midpoint with the point after, and the
    last epoch ends at ``target_progress``. Without ``batch_sizes`` the statistics do
    not depend on the batch size (the assumption of the goodput model); with them
    (increasing totals), ``sqr`` and ``var`` have one row per batch size (each
    measured at its batch size) and a batch size in between takes their linear
    interpolation in the batch size, the nearest row outside: the rule of the trace
    model (:func:`~adaptdl.sim.apps.stats_by_batch_size`). Step times are
    :func:`~adaptdl.sim.apps.model_step_time` of ``perf_params``.
    """

    def __init__(
        self,
        name: str,
        perf_params: PerfParams,
        progress: Sequence[float] | FloatArray,
        sqr: Sequence[float] | FloatArray,
        var: Sequence[float] | FloatArray,
        *,
        init_batch_size: int,
        max_batch_size: int,
        local_bsz_bounds: tuple[int, int],
        dataset_size: int,
        target_progress: float,
        batch_sizes: Sequence[int] | None = None,
    ) -> None:
        if not isinstance(perf_params, PerfParams):
            raise ArgumentTypeError(f"perf_params must be a PerfParams, got {perf_params!r}")
        self.name = name
        self.perf_params = perf_params
        self.init_batch_size = check_int("init_batch_size", init_batch_size, min=1)
        self.max_batch_size = check_int("max_batch_size", max_batch_size, min=init_batch_size)
        lo, hi = local_bsz_bounds
        self.local_bsz_bounds = (check_int("local_bsz_bounds[0]", lo, min=1), hi)
        check_int("local_bsz_bounds[1]", hi, min=lo)
        self.dataset_size = check_int("dataset_size", dataset_size, min=1)
        target = check_float("target_progress", target_progress, min=0.0, min_exclusive=True)
        points = _floats("progress", progress)
        if np.any(np.diff(points) <= 0):
            raise ValueError(f"progress must be strictly increasing, got {progress!r}")
        rows = 1 if batch_sizes is None else len(batch_sizes)
        flat_sqr, flat_var = _floats("sqr", np.ravel(sqr)), _floats("var", np.ravel(var))
        if not (flat_sqr.size == flat_var.size == rows * len(points)):
            raise ValueError(
                f"sqr and var must have the same length as progress ({len(points)}) per "
                f"batch size ({rows}), got {np.shape(sqr)} and {np.shape(var)}"
            )
        # One row per batch size, one column per point of progress.
        self._sqr: npt.NDArray[np.float64] = flat_sqr.reshape(rows, len(points))
        self._var: npt.NDArray[np.float64] = flat_var.reshape(rows, len(points))
        sizes = _floats("batch_sizes", [1.0] if batch_sizes is None else batch_sizes)
        if np.any(sizes < 1) or np.any(np.diff(sizes) <= 0):
            raise ValueError(f"batch_sizes must be increasing and >= 1, got {batch_sizes!r}")
        self._sizes = sizes
        # A point's epoch starts at the midpoint with the point before it: the points
        # whose epoch would start at or past the target are never reached.
        edges = (points[:-1] + points[1:]) / 2.0
        self.epoch_progress = np.append(edges[edges < target], target)

    def step_time(self, placement: Sequence[int], local_bsz: float) -> tuple[float, float]:
        """Core's optimiser micro-batch time and its sync excess (`model_step_time`)."""
        return model_step_time(self.perf_params, placement, local_bsz)

    def grad_stats(self, batch_size: float, epoch: int) -> tuple[float, float]:
        """(sqr, var) of the measured point ``epoch`` at ``batch_size``."""
        return stats_by_batch_size(self._sizes, self._sqr, self._var, batch_size, epoch)

    def grad_stats_at(self, progress: float, batch_size: float = 0.0) -> tuple[float, float]:
        """(sqr, var) at a point of progress (and batch size): its epoch's."""
        return self.grad_stats(batch_size, self.epoch_at(progress))


@attrs.frozen
class ProgressRun:
    """A simulated run to one or more progress targets (increasing).

    ``seconds_at`` and ``steps_at``: simulated seconds and optimiser steps when the
    progress first reached each target; ``progress``: the progress at the end (the
    last target's step); ``trajectory``: (seconds, progress, total batch size, local
    batch size, accumulation steps) at the start and at every change of
    configuration, up to the last target.
    """

    seconds_at: tuple[float, ...]
    steps_at: tuple[int, ...]
    progress: float
    trajectory: tuple[tuple[float, float, int, int, int], ...]

    @property
    def seconds(self) -> float:
        """Simulated seconds to the last target."""
        return self.seconds_at[-1]

    @property
    def steps(self) -> int:
        """Optimiser steps to the last target."""
        return self.steps_at[-1]

    def trajectory_until(self, progress: float) -> tuple[tuple[float, float, int, int, int], ...]:
        """The trajectory a run to ``progress`` alone has: its changes before it."""
        return tuple(t for t in self.trajectory if t[1] < progress)


def _targets(target_progress: float | Sequence[float]) -> list[float]:
    if isinstance(target_progress, Sequence):
        names = [f"target_progress[{i}]" for i in range(len(target_progress))]
        values = list(target_progress)
    else:
        names, values = ["target_progress"], [target_progress]
    if not values:
        raise ValueError("target_progress must hold at least one target, got none")
    targets = [
        check_float(name, v, min=0.0, min_exclusive=True)
        for name, v in zip(names, values, strict=True)
    ]
    if any(b < a for a, b in itertools.pairwise(targets)):
        raise ValueError(f"target_progress must be sorted (increasing), got {target_progress!r}")
    return targets


def simulate_to_progress(
    app: ApplicationModel,
    target_progress: float | Sequence[float],
    *,
    replicas: int,
    nodes: int = 1,
    split: tuple[int, int] | None = None,
    rule: ScalingRule | None = None,
) -> ProgressRun:
    """Run one job of ``app`` (any application model: a measured profile's, a
    trace's) on ``replicas`` (over ``nodes``) until its progress reaches
    ``target_progress`` (one target, or several in increasing order, each
    timed on the one run); return the simulated time it took.

    ``split`` None: the job's own adaptive decision (core's default, up to the
    application's maximum batch size within its local bounds, with accumulation);
    otherwise the fixed (local batch size, accumulation steps), set as the job's
    decision the way a real run fixes it. ``rule`` is the scaling rule (default
    AdaScale); it sets only learning-rate factors, not progress. No checkpoints.
    """
    targets = _targets(target_progress)
    check_int("replicas", replicas, min=1)
    placement = even_placement(replicas, nodes)
    b0, n = app.init_batch_size, app.dataset_size
    clock = SimClock()
    topology = Topology(rank=0, num_replicas=replicas, num_nodes=nodes, num_restarts=0)
    policy = CheckpointPolicy(every_seconds=None)
    job = Job(
        topology,
        collective=SimCollective(replicas),
        clock=clock,
        checkpoint_policy=policy,
        agreement_cadence=EVERY_BOUNDARY,
    )
    loader = LoaderHelper(job, batch_size=b0, name="profiled")
    if split is None:
        loader.autoscale_batch_size(
            app.max_batch_size, app.local_bsz_bounds, gradient_accumulation=True
        )
    else:
        fixed = FixedSplit(split[0], split[1])
        job.batch_size_decision = fixed
        # Adaptive mode with a fixed decision: the loop ends on progress, as a real run's.
        total = fixed.local_bsz * (fixed.accum_steps + 1) * replicas
        loader.autoscale_batch_size(max(total, b0), gradient_accumulation=True)
    steps = ReplaySteps(StepStatistics(job.metrics, job.collective), b0, rule)
    micro = MicroBatches(app, job, loader, clock, steps, placement)

    def batches(epoch: int, index: int, local_bsz: int) -> Iterator[int]:
        # Only how many micro-batches the rest of the pass holds matters here.
        pass_end = (index // n + 1) * n
        return iter(range(math.ceil((pass_end - index) / (replicas * local_bsz))))

    trajectory: list[tuple[float, float, int, int, int]] = []
    seconds_at: list[float] = []
    steps_at: list[int] = []
    count = 0
    epochs = math.ceil(targets[-1] * b0 / n) + 1
    for _ in job.epoch.remaining_epochs_until(epochs):
        for _batch in loader.iterate(n, batches):
            local, accum = loader.current_local_bsz, loader.accumulation_steps
            if not trajectory or trajectory[-1][3:] != (local, accum):
                config = (loader.current_batch_size, local, accum)
                trajectory.append((clock.now, job.metrics.progress, *config))
            if not micro.advance(app.epoch_at(job.metrics.progress)):
                continue
            count += 1
            while (
                len(seconds_at) < len(targets) and job.metrics.progress >= targets[len(seconds_at)]
            ):
                seconds_at.append(clock.now)
                steps_at.append(count)
            if len(seconds_at) == len(targets):
                break
        if len(seconds_at) == len(targets):
            break
    # Targets never reached (the run ended first) take the end.
    missing = len(targets) - len(seconds_at)
    return ProgressRun(
        (*seconds_at, *[clock.now] * missing),
        (*steps_at, *[count] * missing),
        job.metrics.progress,
        tuple(trajectory),
    )
