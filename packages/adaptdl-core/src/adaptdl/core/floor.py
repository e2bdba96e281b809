"""The noise floor an SGD batch keeps, and the decision's credit for it (opt-in).

Pollux's goodput credits a batch with its progress per second: its throughput times
its statistical efficiency ``E(M)``, the progress a sample makes at total batch ``M``
relative to one at the initial batch ``M0``. It leaves out what a larger batch does
for the loss besides: SGD with momentum ``beta`` at the applied rate ``lr`` keeps an
excess loss of

    F(M) = lr / (1 - beta) * tr(Sigma) / (4 M)                       (`floor_level`)

over the loss it would reach without noise, once the directions the noise excites
have settled (on a quadratic, for ``lr h`` well below ``2 (1 + beta)`` in each
direction; it does not depend on the curvatures). Under AdaScale the rate at ``M``
is the gain ``r`` times the base rate, so ``F(M) = F0 E(M)`` with ``F0 = F(M0)`` at
the base rate: a larger batch keeps a lower floor.

**The share** (`floor_share`). Of the loss left to shed to a target, at the initial
batch's noise, ``X = drift - target + F0`` with ``drift = loss - F0 E(M_now)``, the
share ``f = F0 / X`` is floor, and it sheds as ``F0 E(M)`` at batch ``M``: at once,
by taking a larger batch. With the drift shed linearly in progress the time to the
target goes as ``(1 - f + f E) / (throughput E)``, and ``E / (1 - f + f E)`` is
exactly Pollux's efficiency at the noise scale ``B' = (B + f M0) / (1 - f)``. So the
decision credits the floor by reading that noise scale (`shared_params`), and core's
exact optimiser, caps and hysteresis take it unchanged. Without a target (0, the
default) the share is the least the loss now allows, ``F0 / (loss - F0 E + F0)``.

Measured (``experiments/outcome/RESULTS.md`` item 4, eleventh follow-up): on the
shapes CNN the floor predicts 0.68-1.01 of the training-loss gap between fixed
sizes 256 and 16, with no fitted constant; deciding on the share brought the
adaptive run from 0.79-0.89 of fixed 256's speed to the target to about level.

`LossFloor` keeps the training loss's moving average (a job-level state in the
checkpoint, schema ``adaptdl.floor/1``) and the share it last set. SGD-type
optimisers under AdaScale only: under Adam the noise's weight in the update is the
preconditioner, not a number (the torch adapter refuses the rest).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs

from adaptdl.core._validate import check_float, check_int, check_state
from adaptdl.core.gns import GradientNoiseScale
from adaptdl.core.goodput import GradParams

FLOOR_SCHEMA = "adaptdl.floor/1"

_JSON_KEYS = ("schema", "memory", "min_steps", "cap", "steps", "loss_sum", "loss_weight", "share")


def sgd_rate(lr: float, momentum: float = 0.0, dampening: float = 0.0) -> float:
    """The rate at which SGD with ``momentum`` and ``dampening`` moves along a steady
    gradient, ``lr * (1 - dampening) / (1 - momentum)``: the rate its floor scales with.

    ValueError names an argument out of range (``lr >= 0``, ``momentum`` in [0, 1),
    ``dampening`` in [0, 1]).
    """
    lr = check_float("lr", lr, min=0.0)
    dampening = check_float("dampening", dampening, min=0.0, max=1.0)
    momentum = check_float("momentum", momentum, min=0.0)
    if momentum >= 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
    return lr * (1.0 - dampening) / (1.0 - momentum)


def floor_level(rate: float, var: float, batch: float) -> float:
    """SGD's quadratic floor ``rate * tr(Sigma) / (4 batch)``: ``rate`` from `sgd_rate`,
    ``var`` the per-sample tr(Sigma), ``batch`` the total batch size (> 0)."""
    rate = check_float("rate", rate, min=0.0)
    var = check_float("var", var, min=0.0)
    batch = check_float("batch", batch, min=0.0, min_exclusive=True)
    return rate * var / (4.0 * batch)


def floor_share(
    floor0: float, loss: float, efficiency: float, target_loss: float = 0.0, cap: float = 0.9
) -> float:
    """The share ``f`` of the loss left to shed to ``target_loss`` that is the initial
    batch's floor ``floor0``, in [0, ``cap``].

    ``loss`` is the training loss now, at a batch of statistical ``efficiency`` (whose
    floor is ``floor0 * efficiency``). Left at the initial batch: the drift ``loss -
    floor0 * efficiency`` less the target, plus ``floor0``. Where the floor is all
    that is left, ``cap``; 0 without a floor or a finite loss.
    """
    if not 0.0 <= cap < 1.0:
        raise ValueError(f"cap must be in [0, 1), got {cap!r}")
    left = loss - floor0 * efficiency - target_loss + floor0
    if not (math.isfinite(left) and math.isfinite(floor0)) or floor0 <= 0.0:
        return 0.0
    if left <= floor0:
        return cap
    return min(floor0 / left, cap)


def shared_params(params: GradParams, share: float) -> GradParams:
    """``params`` at the noise scale ``B' = (B + f M0) / (1 - f)`` of floor share ``f``.

    In `GradParams`' terms (variance at the initial batch) ``var' = (var + f sqr) /
    (1 - f)``. Statistics without noise or without signal are returned as they are:
    no noise keeps no floor, and a lost gradient is already credited in full.
    """
    if not 0.0 <= share < 1.0:
        raise ValueError(f"share must be in [0, 1), got {share!r}")
    if share == 0.0 or params.sqr <= 0.0 or params.var <= 0.0:
        return params
    return GradParams(sqr=params.sqr, var=(params.var + share * params.sqr) / (1.0 - share))


@attrs.define(eq=False)
class LossFloor:
    """The training loss's moving average and the floor share it sets.

    ``memory`` (per step), ``min_steps`` (steps folded before a share is set) and
    ``cap`` (the share's largest value) are configuration; the rest is state.
    """

    memory: float = attrs.field(default=0.99)
    min_steps: int = attrs.field(default=100)
    cap: float = attrs.field(default=0.9)
    steps: int = attrs.field(default=0)
    loss_sum: float = attrs.field(default=0.0)
    loss_weight: float = attrs.field(default=0.0)
    share: float = attrs.field(default=0.0)
    #: The initial batch's floor at the last `observe` (not saved: the next one sets it).
    floor0: float = attrs.field(default=math.nan, eq=False)

    SCHEMA: ClassVar[str] = FLOOR_SCHEMA

    def __attrs_post_init__(self) -> None:
        self.memory = check_float("memory", self.memory, min=0.0)
        if self.memory >= 1.0:
            raise ValueError(f"memory must be in [0, 1), got {self.memory!r}")
        self.min_steps = check_int("min_steps", self.min_steps, min=1)
        self.cap = check_float("cap", self.cap, min=0.0)
        if self.cap >= 1.0:
            raise ValueError(f"cap must be in [0, 1), got {self.cap!r}")
        self.steps = check_int("steps", self.steps, min=0)
        self.loss_sum = check_float("loss_sum", self.loss_sum)
        self.loss_weight = check_float("loss_weight", self.loss_weight, min=0.0, max=1.0)
        self.share = check_float("share", self.share, min=0.0, max=self.cap)

    @property
    def average(self) -> float | None:
        """The training loss's bias-corrected moving average (None before a finite one)."""
        return self.loss_sum / self.loss_weight if self.loss_weight > 0.0 else None

    def observe(
        self,
        loss: float,
        rates: Sequence[float],
        gns: GradientNoiseScale | None,
        batch_size: float,
        target_loss: float = 0.0,
    ) -> float:
        """Fold one step's training ``loss`` (one not finite is skipped) and return the
        share, set once ``min_steps`` steps are in and the estimate resolves a gradient.

        ``rates`` are the step's `sgd_rate` per parameter group at the base rate (the
        initial batch's), ``gns`` the job's estimator (its groups match ``rates``),
        ``batch_size`` the step's total batch and ``target_loss`` the training loss
        aimed at (0: none stated).
        """
        target_loss = check_float("target_loss", target_loss)
        self.steps += 1
        if isinstance(loss, numbers.Real) and math.isfinite(loss):
            self.loss_sum = self.memory * self.loss_sum + (1.0 - self.memory) * float(loss)
            self.loss_weight = self.memory * self.loss_weight + (1.0 - self.memory)
        average = self.average
        if gns is None or self.steps < self.min_steps or average is None or not gns.resolved:
            return self.share
        if len(rates) != gns.num_groups:
            raise ValueError(
                f"rates must have one value per parameter group ({gns.num_groups}), "
                f"got {len(rates)}"
            )
        m0 = float(gns.init_batch_size)
        self.floor0 = math.fsum(
            floor_level(rate, var, m0) for rate, var in zip(rates, gns.group_var, strict=True)
        )
        scale = max(float(batch_size) / m0, 1.0)
        self.share = floor_share(
            self.floor0, average, gns.gain(scale) / scale, target_loss, self.cap
        )
        return self.share

    def to_json(self) -> dict[str, Any]:
        """The state as JSON-ready data."""
        return {
            "schema": self.SCHEMA,
            "memory": self.memory,
            "min_steps": self.min_steps,
            "cap": self.cap,
            "steps": self.steps,
            "loss_sum": self.loss_sum,
            "loss_weight": self.loss_weight,
            "share": self.share,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LossFloor:
        """Rebuild from `to_json`'s output; raise ValueError on any other shape."""
        data = check_state("LossFloor state", data, cls.SCHEMA, _JSON_KEYS)
        return cls(**{k: data[k] for k in _JSON_KEYS if k != "schema"})
