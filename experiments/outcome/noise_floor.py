"""The noise floor's per-step credit, a prototype that failed (#18, eleventh follow-up).

The tenth follow-up (`noise_match`) found that shapes' large fixed batches reach the
target at less scale-invariant progress because a step at gain ``r`` on ``S`` times
the initial batch carries ``r / S`` of the initial batch's gradient noise per unit of
progress, and ``r / S`` is Pollux's efficiency ``E(M) = (B + M0) / (B + M)``. The
goodput model credits a batch with its progress per second only. This module holds
the per-step credit and the refusals of what the floor does not cover;
`floor_credit` holds the tables and the command line's refusals.

**The floor** (`adaptdl.core.stats.floor.floor_level`, in core since the twelfth
follow-up, with the floor share's decision: `adaptdl.core.stats.floor`, opted into by
reporting the training loss, ``AdaptiveDataParallel.report_loss``). SGD with
momentum ``beta`` at the applied rate ``lr`` on a quadratic keeps an excess loss of
``lr / (1 - beta) * tr(Sigma) / (4 M)``.

**A per-step credit** (`FloorMeter`, `credited_scale`, `FloorCreditScale`; it
failed, RESULTS.md). To second order a step ``dx`` changes the loss by ``G_t . dx +
dx' H dx / 2``: a first-order gain ``F = -G_t . dx`` less a curvature cost. The
meter reads the cost's share ``lambda`` of the gain from what a data-parallel job
sees: ``A_t = g_{t+1} . dx_t`` is unbiased for ``G_t . dx_t + dx_t' H dx_t`` (a
fresh batch at ``x_{t+1}``), and ``S_t = g_t . dx_t + w_t tr(Sigma) / M`` for ``G_t .
dx_t``, where ``w_t`` is the current gradient's weight in the update (the applied
rate, for SGD with or without momentum: the momentum buffer is independent of the
step's noise); ``lambda = (A - S) / (-2 S)``, a ratio of averages. Booked wholly to
the noise, whose cost per unit of progress scales as ``E``, the objective is
``throughput E (1 - kappa E)`` with ``kappa E(M_now) = lambda``; the decision gets
the noise scale ``B'`` whose Pollux optimum has the same slope at the current batch,
``B' + M = (B + M) (1 - lambda) / (1 - 2 lambda)`` (unbounded at ``lambda >= 1/2``).

**A floor share**: moved to core (`adaptdl.core.stats.floor`); ``time_to_target
--floor-target-loss`` runs it through ``report_loss``.

The per-step credit changes the noise scale the batch-size decision reads (`grad_params`,
`grad_params_bound`); the AdaScale gain, and with it the rate and the progress,
keeps core's. SGD-type optimisers only (`check_config`): under Adam the noise's
weight in the update is the preconditioner, not a number.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs

from adaptdl.core.goodput import GradParams
from adaptdl.core.goodput.model import FLOATS, efficiency
from adaptdl.core.stats.gns import GradientNoiseScale

#: ``lambda`` at or above this: the credited noise scale is taken as unbounded.
_UNBOUNDED = 0.5 - 1e-9
#: The noise scale given for "unbounded" (a finite number, for GradParams).
_HUGE = 1e12


def efficiency_at(scale: float, init_batch: float, batch: float) -> float:
    """Core's statistical efficiency of ``batch`` at the noise scale ``scale``."""
    return float(efficiency(FLOATS, 1.0, scale / init_batch, init_batch, batch))


def credited_scale(scale: float, batch: float, share: float) -> float:
    """The noise scale ``B'`` of the per-step credit at the curvature's share ``lambda =
    share`` measured at ``batch``: ``(B + M) (1 - lambda) / (1 - 2 lambda) - M``.

    ``B`` itself at ``lambda <= 0``; unbounded (`_HUGE`) at ``lambda >= 1/2``.
    """
    if not (scale >= 0.0 and batch > 0.0):
        raise ValueError(f"need scale >= 0 and batch > 0, got scale={scale!r}, batch={batch!r}")
    if not (math.isfinite(share) and share > 0.0) or not math.isfinite(scale):
        return scale
    if share >= _UNBOUNDED:
        return _HUGE
    return (scale + batch) * (1.0 - share) / (1.0 - 2.0 * share) - batch


@attrs.define(eq=False)
class _DecisionScale(GradientNoiseScale):
    """Core's estimator whose answers to the batch-size decision use `decision_scale`."""

    def decision_scale(self, scale: float) -> float:
        """The noise scale the decision reads for core's ``scale`` (``scale`` itself here)."""
        return scale

    def _answer(self, params: GradParams | None) -> GradParams | None:
        # No noise (a lower bound clipped at 0): no floor either, nothing to credit.
        if params is None or params.sqr <= 0.0 or params.var <= 0.0:
            return params
        m0 = float(self.init_batch_size)
        scale = self.decision_scale(params.var * m0 / params.sqr)
        return GradParams(sqr=params.sqr, var=scale * params.sqr / m0)

    def grad_params(self) -> GradParams | None:
        """Core's statistics at the decision's noise scale."""
        return self._answer(super().grad_params())

    def grad_params_bound(self, z: float) -> GradParams | None:
        """Core's lower confidence bound at the decision's noise scale."""
        return self._answer(super().grad_params_bound(z))


def _flat(tensors: Sequence[Any]) -> Any:
    """One float64 vector of ``tensors`` (torch's own flattening)."""
    from torch.nn.utils import parameters_to_vector

    return parameters_to_vector(tensors).double()


@attrs.define(eq=False)
class FloorMeter:
    """The curvature's share ``lambda`` of the first-order gain, measured along a run.

    The training loop calls `before_step` with the parameters (their ``.grad`` the
    step's averaged gradient), then `after_step` once the optimiser has moved them.
    Sums are exponential averages with memory ``beta`` per step; `share` is None until
    ``min_steps`` pairs are in. Each call copies the parameters (float64): about an
    optimiser step's cost, which the runs' CPU times include.
    """

    beta: float = 0.99
    min_steps: int = 50
    batch: float = 0.0
    pairs: int = 0
    _gain_sum: float = 0.0  # -S, the first-order gain
    _cost_sum: float = 0.0  # (A - S) / 2, the curvature cost
    _grad: Any = None
    _params: Any = None
    _step: Any = None
    _first_order: float = math.nan

    def __attrs_post_init__(self) -> None:
        if not 0.0 <= self.beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {self.beta!r}")

    def before_step(self, params: Sequence[Any]) -> None:
        """Read the step's gradient and parameters; pair the previous step's update."""
        grad = _flat([p.grad for p in params if p.grad is not None])
        if self._step is not None and math.isfinite(self._first_order):
            after = float(grad @ self._step)
            self._fold(-self._first_order, 0.5 * (after - self._first_order))
        self._grad = grad
        self._params = _flat([p.detach() for p in params if p.grad is not None])

    def after_step(self, params: Sequence[Any], weight: float, var: float, batch: float) -> None:
        """The update just applied; ``weight`` is the current gradient's in it (the
        learning rate applied), ``var`` the job's tr(Sigma), ``batch`` the total size."""
        now = _flat([p.detach() for p in params if p.grad is not None])
        self._step = now - self._params
        self._first_order = float(self._grad @ self._step) + weight * var / batch
        self.batch = float(batch)
        self._grad = self._params = None

    def _fold(self, gain: float, cost: float) -> None:
        if not (math.isfinite(gain) and math.isfinite(cost)):
            return
        self._gain_sum = self.beta * self._gain_sum + (1.0 - self.beta) * gain
        self._cost_sum = self.beta * self._cost_sum + (1.0 - self.beta) * cost
        self.pairs += 1

    @property
    def share(self) -> float | None:
        """``lambda``: the curvature cost over the first-order gain (None while immature)."""
        if self.pairs < self.min_steps or self._gain_sum <= 0.0:
            return None
        return self._cost_sum / self._gain_sum


@attrs.define(eq=False)
class FloorCreditScale(_DecisionScale):
    """The per-step credit: the decision reads `credited_scale` at the meter's share."""

    meter: FloorMeter | None = attrs.field(default=None)

    def decision_scale(self, scale: float) -> float:
        """`credited_scale` at the meter's share and batch (``scale`` while immature)."""
        meter = self.meter
        if meter is None or meter.share is None or meter.batch <= 0.0:
            return scale
        return credited_scale(scale, meter.batch, meter.share)


def check_config(cfg: dict[str, Any]) -> None:
    """Refuse what the floor does not cover: an optimiser other than SGD (e.g. Adam)."""
    if cfg.get("optimizer", "sgd") != "sgd":
        raise ValueError(
            f"the noise floor needs an SGD-type optimiser, got optimizer={cfg.get('optimizer')!r}"
        )
