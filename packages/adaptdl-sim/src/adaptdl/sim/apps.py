"""Application models: how fast a training job steps and how much each step progresses.

An application model answers three questions for the simulator:

* the time of one optimiser step (and the part spent synchronising gradients) for a
  placement (GPUs used on each node) and a local batch size;
* the gradient statistics (``sqr``, ``var``) at a total batch size and epoch, from
  which the AdaScale gain of one step and the statistical efficiency follow;
* how much scale-invariant progress each epoch needs (``epoch_progress``, cumulative).

Progress is counted in iterations at the initial batch size: one optimiser step at
total batch size ``M`` adds its gain ``(var + sqr) / (var / s + sqr)``, ``s = M / M0``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import numpy.typing as npt

from adaptdl.core._validate import check_float, check_int
from adaptdl.core.scaling import adascale_gain

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
        """Return (step time, sync time) in seconds for one optimiser step, no accumulation."""
        raise NotImplementedError

    def grad_stats(self, batch_size: float, epoch: int) -> tuple[float, float]:
        """Return (grad_sqr, grad_var) at a total batch size during ``epoch``."""
        raise NotImplementedError

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


def _positive_int(name: str) -> Callable[[object, object, int], None]:
    def check(instance: object, attribute: object, value: int) -> None:
        check_int(name, value, min=1)

    return check


@attrs.frozen(eq=False)
class ParametricApplication(ApplicationModel):
    """An application defined by a few numbers, needing no measured data.

    Step time follows the core's throughput model: compute ``alpha_c + beta_c * b``,
    synchronisation ``alpha_r + beta_r * (R - 2)^+`` within a node and
    ``alpha_n + beta_n * (R - 2)^+`` across nodes, overlapped with exponent ``gamma``.
    The gradient noise scale grows geometrically from ``noise_start`` to ``noise_end``
    (in samples) over training, as it does in real training.
    """

    name: str
    init_batch_size: int = attrs.field(validator=_positive_int("init_batch_size"))
    max_batch_size: int = attrs.field(validator=_positive_int("max_batch_size"))
    local_bsz_bounds: tuple[int, int]
    dataset_size: int = attrs.field(validator=_positive_int("dataset_size"))
    epochs: int = attrs.field(validator=_positive_int("epochs"))
    alpha_c: float = 0.02
    beta_c: float = 0.001
    alpha_r: float = 0.01
    beta_r: float = 0.002
    alpha_n: float = 0.05
    beta_n: float = 0.01
    gamma: float = 1.5
    noise_start: float = 100.0
    noise_end: float = 4000.0
    epoch_progress: FloatArray = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        lo, hi = self.local_bsz_bounds
        check_int("local_bsz_bounds[0]", lo, min=1)
        check_int("local_bsz_bounds[1]", hi, min=lo)
        if self.max_batch_size < self.init_batch_size:
            raise ValueError(
                f"max_batch_size must be >= init_batch_size ({self.init_batch_size}), "
                f"got {self.max_batch_size}"
            )
        for name in ("alpha_c", "beta_c", "alpha_r", "beta_r", "alpha_n", "beta_n"):
            check_float(name, getattr(self, name), min=0.0)
        check_float("gamma", self.gamma, min=1.0, max=10.0)
        check_float("noise_start", self.noise_start, min=0.0, min_exclusive=True)
        check_float("noise_end", self.noise_end, min=0.0, min_exclusive=True)
        per_epoch = self.dataset_size / self.init_batch_size
        progress = per_epoch * np.arange(1, self.epochs + 1, dtype=np.float64)
        object.__setattr__(self, "epoch_progress", progress)

    def step_time(self, placement: Sequence[int], local_bsz: float) -> tuple[float, float]:
        counts = normalize_placement(placement)
        nodes, replicas = len(counts), sum(counts)
        compute = self.alpha_c + self.beta_c * float(local_bsz)
        if replicas == 1:
            return compute, 0.0
        extra = max(replicas - 2, 0)
        if nodes > 1:
            sync = self.alpha_n + self.beta_n * extra
        else:
            sync = self.alpha_r + self.beta_r * extra
        g = self.gamma
        total = (compute**g + sync**g) ** (1.0 / g)
        return total, sync

    def grad_stats(self, batch_size: float, epoch: int) -> tuple[float, float]:
        frac = min(max(epoch, 0), self.epochs - 1) / max(self.epochs - 1, 1)
        noise = self.noise_start * math.exp(frac * math.log(self.noise_end / self.noise_start))
        # B_noise = M0 * var / sqr with sqr fixed at 1.
        return 1.0, noise / self.init_batch_size


def builtin_applications() -> dict[str, ParametricApplication]:
    """Return the built-in parametric applications, keyed by name.

    Loosely shaped after the six measured applications (image classification, language
    model fine-tuning, recommendation, speech, detection), sized so that a synthetic
    workload of a few dozen jobs finishes in a few simulated hours.
    """
    apps = [
        ParametricApplication(
            name="resnet-small",
            init_batch_size=128,
            max_batch_size=4096,
            local_bsz_bounds=(16, 512),
            dataset_size=50_000,
            epochs=30,
            alpha_c=0.015,
            beta_c=0.0004,
            alpha_r=0.004,
            beta_r=0.001,
            alpha_n=0.04,
            beta_n=0.006,
            noise_start=60.0,
            noise_end=3000.0,
        ),
        ParametricApplication(
            name="transformer",
            init_batch_size=32,
            max_batch_size=512,
            local_bsz_bounds=(4, 16),
            dataset_size=40_000,
            epochs=3,
            alpha_c=0.05,
            beta_c=0.02,
            alpha_r=0.02,
            beta_r=0.004,
            alpha_n=0.3,
            beta_n=0.02,
            noise_start=40.0,
            noise_end=800.0,
        ),
        ParametricApplication(
            name="recommender",
            init_batch_size=256,
            max_batch_size=32768,
            local_bsz_bounds=(64, 32768),
            dataset_size=2_000_000,
            epochs=5,
            alpha_c=0.004,
            beta_c=0.0000015,
            alpha_r=0.001,
            beta_r=0.0005,
            alpha_n=0.015,
            beta_n=0.003,
            noise_start=5000.0,
            noise_end=50000.0,
        ),
        ParametricApplication(
            name="speech",
            init_batch_size=20,
            max_batch_size=640,
            local_bsz_bounds=(4, 64),
            dataset_size=30_000,
            epochs=20,
            alpha_c=0.1,
            beta_c=0.02,
            alpha_r=0.01,
            beta_r=0.005,
            alpha_n=0.2,
            beta_n=0.02,
            noise_start=30.0,
            noise_end=600.0,
        ),
    ]
    return {app.name: app for app in apps}
