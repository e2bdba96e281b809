"""Application models: how fast a training job steps and how much each step progresses.

An application model answers three questions for the simulator:

* the time of one optimiser step, and what synchronising gradients adds to it over a
  compute-only (accumulation) micro-batch, for a placement (GPUs used on each node)
  and a local batch size;
* the gradient statistics (``sqr``, ``var``) at a total batch size and epoch, from
  which the AdaScale gain of one step and the statistical efficiency follow;
* how much scale-invariant progress each epoch needs (``epoch_progress``, cumulative).

Progress is counted in iterations at the initial batch size: one optimiser step at
total batch size ``M`` adds its gain ``(var + sqr) / (var / s + sqr)``, ``s = M / M0``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import attrs
import numpy as np
import numpy.typing as npt

from adaptdl.core.goodput import GradParams, PerfParams, compute_time, optim_step_time
from adaptdl.core.stats.scaling import adascale_gain
from adaptdl.core.validate import ArgumentTypeError, check_float, check_int

FloatArray = npt.NDArray[np.float64]
Placement = tuple[int, ...]


def normalize_placement(placement: Sequence[int]) -> Placement:
    """Return the placement as a descending tuple of positive GPU counts per node."""
    counts = tuple(sorted((int(c) for c in placement if int(c) > 0), reverse=True))
    if not counts:
        raise ValueError(f"placement must use at least one GPU, got {tuple(placement)!r}")
    return counts


class ApplicationModel:
    """Base of every application model (trace-driven or parametric).

    Subclasses set the attributes below and implement :meth:`step_time` and
    :meth:`grad_stats`.
    """

    name: str
    init_batch_size: int
    max_batch_size: int
    #: Smallest and largest local (per-GPU, per micro-batch) batch size.
    local_bsz_bounds: tuple[int, int]
    #: Cumulative progress required at the end of each epoch; the last entry is the target.
    epoch_progress: FloatArray
    #: Samples in one epoch (used by job replay).
    dataset_size: int

    def step_time(self, placement: Sequence[int], local_bsz: float) -> tuple[float, float]:
        """Return (step time, sync time) in seconds for one optimiser step, no accumulation.

        An accumulation micro-batch costs the step time less the sync time.
        """
        raise NotImplementedError

    def grad_stats(self, batch_size: float, epoch: int) -> tuple[float, float]:
        """Return (grad_sqr, grad_var) at a total batch size during ``epoch``."""
        raise NotImplementedError

    def grad_params(self, batch_size: float, epoch: int) -> GradParams:
        """The gradient statistics of :meth:`grad_stats` as core's model takes them."""
        sqr, var = self.grad_stats(batch_size, epoch)
        return GradParams(max(sqr, 0.0), max(var, 0.0))

    # -- derived helpers ---------------------------------------------------

    @property
    def num_epochs(self) -> int:
        """Number of epochs a job of this application trains for."""
        return len(self.epoch_progress)

    @property
    def target_progress(self) -> float:
        """Scale-invariant progress at which a job completes."""
        return float(self.epoch_progress[-1])

    def epoch_at(self, progress: float) -> int:
        """Return the epoch a job is in at ``progress`` (0-based, capped at the last)."""
        e = int(np.searchsorted(self.epoch_progress, progress, side="right"))
        return min(e, self.num_epochs - 1)

    def iteration_time(
        self, placement: Sequence[int], atomic_bsz: float, accum_steps: int = 0
    ) -> tuple[float, float]:
        """Return (optimiser step time, sync time) with ``accum_steps`` extra micro-batches.

        The accumulation micro-batches compute without synchronising: each costs the
        step time less the sync time.
        """
        step, sync = self.step_time(placement, atomic_bsz)
        return accum_steps * max(step - sync, 1e-9) + step, sync

    def gain(self, batch_size: float, epoch: int) -> float:
        """AdaScale gain of one optimiser step at ``batch_size`` during ``epoch``."""
        sqr, var = self.grad_stats(batch_size, epoch)
        return adascale_gain(sqr, var, batch_size / self.init_batch_size)


def stats_by_batch_size(
    batch_sizes: FloatArray,
    sqr: FloatArray,
    var: FloatArray,
    batch_size: float,
    epoch: int,
) -> tuple[float, float]:
    """(sqr, var) at ``batch_size`` in ``epoch`` of statistics measured per batch size.

    ``sqr`` and ``var`` have one row per entry of ``batch_sizes`` (increasing) and
    one column per epoch (``epoch`` is clamped to them). Between two measured batch
    sizes the statistics are linear in the batch size; outside, the nearest row's.
    """
    e = min(max(int(epoch), 0), sqr.shape[1] - 1)
    i = int(np.searchsorted(batch_sizes, batch_size))
    if i <= 0:
        return float(sqr[0, e]), float(var[0, e])
    if i >= len(batch_sizes):
        return float(sqr[-1, e]), float(var[-1, e])
    w = (batch_size - batch_sizes[i - 1]) / (batch_sizes[i] - batch_sizes[i - 1])
    return (
        float((1 - w) * sqr[i - 1, e] + w * sqr[i, e]),
        float((1 - w) * var[i - 1, e] + w * var[i, e]),
    )


def model_step_time(
    perf_params: PerfParams, placement: Sequence[int], local_bsz: float
) -> tuple[float, float]:
    """Core's optimiser micro-batch time on ``placement``, and its excess over a
    compute-only one (what synchronisation adds), for ``perf_params``.

    One replica never synchronises, so its optimiser micro-batch is the compute-only
    one; with the excess as the sync time, `ApplicationModel.iteration_time` is core's
    ``k * T_c + T_o``.
    """
    counts = normalize_placement(placement)
    nodes, replicas = len(counts), sum(counts)
    b = float(local_bsz)
    compute = float(compute_time(perf_params, b))
    if replicas == 1:
        return compute, 0.0
    step = float(optim_step_time(perf_params, nodes, replicas, b))
    return step, max(step - compute, 0.0)


def _positive_int(name: str) -> Callable[[object, object, int], None]:
    def check(instance: object, attribute: object, value: int) -> None:
        check_int(name, value, min=1)

    return check


#: Throughput model of a parametric application unless it names its own.
DEFAULT_PERF_PARAMS = PerfParams(
    alpha_c=0.02, beta_c=0.001, alpha_n=0.05, beta_n=0.01, alpha_r=0.01, beta_r=0.002, gamma=1.5
)


def _perf_params(base: PerfParams, overrides: Mapping[str, float]) -> PerfParams:
    unknown = sorted(set(overrides) - set(PerfParams.FIELDS))
    if unknown:
        raise ArgumentTypeError(
            f"unexpected argument(s) {unknown}; the throughput model's are {PerfParams.FIELDS}"
        )
    return attrs.evolve(base, **overrides) if overrides else base


@attrs.frozen(eq=False, init=False)
class ParametricApplication(ApplicationModel):
    """An application defined by a few numbers, needing no measured data.

    Step times are core's throughput model (:mod:`adaptdl.core.goodput`) with
    ``perf_params``; single fields of it may be given as keywords instead
    (``alpha_c=0.05``), over :data:`DEFAULT_PERF_PARAMS`. The gradient noise scale
    grows geometrically from ``noise_start`` to ``noise_end`` (in samples) over
    training, as it does in real training.
    """

    name: str
    init_batch_size: int = attrs.field(validator=_positive_int("init_batch_size"))
    max_batch_size: int = attrs.field(validator=_positive_int("max_batch_size"))
    local_bsz_bounds: tuple[int, int]
    dataset_size: int = attrs.field(validator=_positive_int("dataset_size"))
    epochs: int = attrs.field(validator=_positive_int("epochs"))
    perf_params: PerfParams
    noise_start: float
    noise_end: float
    epoch_progress: FloatArray = attrs.field(init=False)

    def __init__(
        self,
        name: str,
        init_batch_size: int,
        max_batch_size: int,
        local_bsz_bounds: tuple[int, int],
        dataset_size: int,
        epochs: int,
        *,
        perf_params: PerfParams = DEFAULT_PERF_PARAMS,
        noise_start: float = 100.0,
        noise_end: float = 4000.0,
        **perf: float,
    ) -> None:
        if not isinstance(perf_params, PerfParams):
            raise ArgumentTypeError(f"perf_params must be a PerfParams, got {perf_params!r}")
        self.__attrs_init__(
            name,
            init_batch_size,
            max_batch_size,
            local_bsz_bounds,
            dataset_size,
            epochs,
            _perf_params(perf_params, perf),
            noise_start,
            noise_end,
        )

    def __attrs_post_init__(self) -> None:
        lo, hi = self.local_bsz_bounds
        check_int("local_bsz_bounds[0]", lo, min=1)
        check_int("local_bsz_bounds[1]", hi, min=lo)
        if self.max_batch_size < self.init_batch_size:
            raise ValueError(
                f"max_batch_size must be >= init_batch_size ({self.init_batch_size}), "
                f"got {self.max_batch_size}"
            )
        check_float("noise_start", self.noise_start, min=0.0, min_exclusive=True)
        check_float("noise_end", self.noise_end, min=0.0, min_exclusive=True)
        per_epoch = self.dataset_size / self.init_batch_size
        progress = per_epoch * np.arange(1, self.epochs + 1, dtype=np.float64)
        object.__setattr__(self, "epoch_progress", progress)

    def step_time(self, placement: Sequence[int], local_bsz: float) -> tuple[float, float]:
        """Core's optimiser micro-batch time, and its excess over a compute-only one
        (`model_step_time`)."""
        return model_step_time(self.perf_params, placement, local_bsz)

    def grad_stats(self, batch_size: float, epoch: int) -> tuple[float, float]:
        frac = min(max(epoch, 0), self.epochs - 1) / max(self.epochs - 1, 1)
        noise = self.noise_start * math.exp(frac * math.log(self.noise_end / self.noise_start))
        # B_noise = M0 * var / sqr with sqr fixed at 1.
        return 1.0, noise / self.init_batch_size


# The built-in applications, loosely shaped after the six measured ones (image
# classification, language model fine-tuning, recommendation, speech), sized so that
# a synthetic workload of a few dozen jobs finishes in a few simulated hours. Columns:
# name, init and max batch size, local batch bounds, dataset size, epochs, gradient
# noise scale at the start and at the end (samples).
_BUILTIN_SHAPES = (
    ("resnet-small", 128, 4096, (16, 512), 50_000, 30, 60.0, 3000.0),
    ("transformer", 32, 512, (4, 16), 40_000, 3, 40.0, 800.0),
    ("recommender", 256, 32768, (64, 32768), 2_000_000, 5, 5000.0, 50000.0),
    ("speech", 20, 640, (4, 64), 30_000, 20, 30.0, 600.0),
)
# Their throughput models, positional in PerfParams order: alpha_c, beta_c, alpha_n,
# beta_n, alpha_r, beta_r, gamma.
_BUILTIN_PERF = {
    "resnet-small": PerfParams(0.015, 0.0004, 0.04, 0.006, 0.004, 0.001, 1.5),
    "transformer": PerfParams(0.05, 0.02, 0.3, 0.02, 0.02, 0.004, 1.5),
    "recommender": PerfParams(0.004, 0.0000015, 0.015, 0.003, 0.001, 0.0005, 1.5),
    "speech": PerfParams(0.1, 0.02, 0.2, 0.02, 0.01, 0.005, 1.5),
}


def builtin_applications() -> dict[str, ParametricApplication]:
    """Return the built-in parametric applications, keyed by name."""
    apps = {}
    for name, init, top, bounds, size, epochs, noise_start, noise_end in _BUILTIN_SHAPES:
        apps[name] = ParametricApplication(
            name,
            init,
            top,
            bounds,
            size,
            epochs,
            perf_params=_BUILTIN_PERF[name],
            noise_start=noise_start,
            noise_end=noise_end,
        )
    return apps
