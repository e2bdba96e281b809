"""The noise floor an SGD batch keeps, and the decision's credit for it (opt-in, EXPERIMENTAL).

**Experimental.** The credit won on the problem it was developed on (the shapes CNN)
and is not yet shown on a problem it was not tuned on (issue 36's held-out problems,
``experiments/outcome/RESULTS.md``): until it is, it stays an optional component a
program opts into by reporting its training loss, configured by `FloorConfig`
(``FloorConfig(enabled=False)`` turns it off whatever the program reports), and its
behaviour may change.

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
exact optimiser, caps and hysteresis take it unchanged.

**Without a stated target** (None, the default) the loss left is what the run sheds
over a horizon: the drift's moving average, recorded over progress
(`adaptdl.core.stats.drift`), shed since half the progress made, is taken as shed again by
twice it: the target is the drift less that, so ``X = shed + F0`` at the point
estimate (where the drift rose, ``|change| + F0``); until the record reaches back
that far, the least credit the loss allows (target 0: ``F0 / (loss - F0 E + F0)``).

Measured (``experiments/outcome/RESULTS.md`` item 4, eleventh follow-up): on the
shapes CNN the floor predicts 0.68-1.01 of the training-loss gap between fixed
sizes 256 and 16, with no fitted constant; deciding on the share brought the
adaptive run from 0.79-0.89 of fixed 256's speed to the target to about level.
With no target, over the horizon (thirteenth follow-up): 1.00-1.11 of fixed 256's
speed by round of 6 seeds (all but one round on earlier forms of the horizon),
faster than core's rule on 22 of 30 runs.

`LossFloor` keeps the training loss's moving average (a job-level state in the
checkpoint, schema ``adaptdl.floor/2``), the drift's, its record over progress and,
from the last loss folded, what the share is computed from (all checkpointed, so a
restarted job's first decision is
credited as its last was): the decision reads it at the statistics it weighs, so
the confidence bound's lower noise also has a lower floor and a smaller share. The
credit holds only while finite losses keep coming: it lapses `LAPSE_STEPS`
optimiser steps after the last one folded, and while the estimate resolves no
gradient.
SGD-type optimisers under AdaScale only: under Adam the noise's weight in the
update is the preconditioner, not a number (the torch adapter refuses the rest).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs

from adaptdl.core.goodput import GradParams
from adaptdl.core.stats.drift import DriftHistory
from adaptdl.core.stats.gns import GradientNoiseScale
from adaptdl.core.stats.scaling import AdaScale, ScalingRule, adascale_gain
from adaptdl.core.validate import check_float, check_int, check_keys, check_state

FLOOR_SCHEMA = "adaptdl.floor/2"
#: The schema before the drift was kept (read, as a state with no drift recorded).
FLOOR_SCHEMA_V1 = "adaptdl.floor/1"

#: Optimiser steps without a finite loss folded after which the credit lapses: at
#: the default memory (0.99 a step) the loss's average has then forgotten most of
#: what it held.
LAPSE_STEPS = 100

_JSON_KEYS_V1 = (
    "schema",
    "memory",
    "min_steps",
    "cap",
    "steps",
    "loss_sum",
    "loss_weight",
    "idle",
    "basis",
)
_JSON_KEYS = (*_JSON_KEYS_V1, "drift_sum", "drift_weight", "drift")
_BASIS_KEYS = ("average", "floor_per_var", "scale", "target_loss")


def _fraction(name: str, value: Any) -> float:
    """``value`` as a float in [0, 1), or ValueError naming ``name``."""
    return check_float(name, value, min=0.0, max=1.0, max_exclusive=True)


def sgd_rate(lr: float, momentum: float = 0.0, dampening: float = 0.0) -> float:
    """The rate at which torch's SGD moves along a steady gradient: ``lr * (1 -
    dampening) / (1 - momentum)``, the rate its floor scales with (torch applies
    ``dampening`` only with momentum, so without momentum it is ``lr``).

    ValueError names an argument out of range (``lr >= 0``, ``momentum`` in [0, 1),
    ``dampening`` in [0, 1]).
    """
    lr = check_float("lr", lr, min=0.0)
    dampening = check_float("dampening", dampening, min=0.0, max=1.0)
    momentum = _fraction("momentum", momentum)
    if momentum == 0.0:
        return lr
    return lr * (1.0 - dampening) / (1.0 - momentum)


def check_rule(kind: type[ScalingRule] | None, described: str) -> None:
    """ValueError unless the floor is credited under a rule of class ``kind``
    (``described`` names the rule in the message; None: one core does not know):
    `AdaScale` only, since only there is a batch's floor the initial batch's times
    its efficiency."""
    if kind is None or not issubclass(kind, AdaScale):
        raise ValueError(
            "report_loss needs the AdaScale scaling rule (the floor at a batch is the "
            f"initial batch's times its efficiency only under AdaScale), got {described}"
        )


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
    that is left (or more), ``cap``. 0 where ``floor0`` is 0 or less, and where any
    input is not finite (nothing to credit).
    """
    cap = _fraction("cap", cap)
    left = loss - floor0 * efficiency - target_loss + floor0
    if not math.isfinite(left) or not math.isfinite(floor0) or floor0 <= 0.0:
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
    share = _fraction("share", share)
    if share == 0.0 or params.sqr <= 0.0 or params.var <= 0.0:
        return params
    return GradParams(sqr=params.sqr, var=(params.var + share * params.sqr) / (1.0 - share))


# attrs converters (named, for mypy's attrs plugin), each naming its field.
def _enabled(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"enabled must be True or False, got {value!r}")
    return value


def _memory(value: Any) -> float:
    return _fraction("memory", value)


def _min_steps(value: Any) -> int:
    return check_int("min_steps", value, min=1)


def _cap(value: Any) -> float:
    return _fraction("cap", value)


def _steps(value: Any) -> int:
    return check_int("steps", value, min=0)


def _loss_sum(value: Any) -> float:
    return check_float("loss_sum", value)


def _loss_weight(value: Any) -> float:
    return check_float("loss_weight", value, min=0.0, max=1.0)


def _drift_sum(value: Any) -> float:
    return check_float("drift_sum", value)


def _drift_weight(value: Any) -> float:
    return check_float("drift_weight", value, min=0.0, max=1.0)


@attrs.frozen
class _Basis:
    """What the last loss folded sets the share from."""

    average: float  # the loss's average
    #: The initial batch's floor per unit of `GradParams.var` (an initial-batch
    #: gradient's variance): the rates' share of the floor, whatever the noise.
    floor_per_var: float
    scale: float  # the step's total batch over the initial one, at least 1
    target_loss: float

    def to_json(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in _BASIS_KEYS}

    @classmethod
    def from_json(cls, data: Any) -> _Basis:
        data = check_keys("LossFloor basis", data, _BASIS_KEYS)
        values = {k: check_float(k, data[k]) for k in _BASIS_KEYS}
        check_float("floor_per_var", values["floor_per_var"], min=0.0)
        check_float("scale", values["scale"], min=1.0)
        return cls(**values)


DEFAULT_MEMORY = 0.99
"""The loss's moving average's memory per optimiser step, by default."""
DEFAULT_MIN_STEPS = 100
"""Losses folded before any credit, by default."""
DEFAULT_CAP = 0.9
"""The share's largest value, by default."""


@attrs.frozen
class FloorConfig:
    """The loss floor's configuration (EXPERIMENTAL: see the module docstring).

    ``enabled`` False: a reported loss is accepted and folds nothing, so the decision
    is core's rule and the job holds no floor. ``memory`` (per optimiser step, in
    [0, 1)), ``min_steps`` (>= 1) and ``cap`` (in [0, 1)) are `LossFloor`'s.
    ValueError naming the field for a value outside those ranges.
    """

    enabled: bool = attrs.field(default=True, converter=_enabled)
    memory: float = attrs.field(default=DEFAULT_MEMORY, converter=_memory)
    min_steps: int = attrs.field(default=DEFAULT_MIN_STEPS, converter=_min_steps)
    cap: float = attrs.field(default=DEFAULT_CAP, converter=_cap)

    def make(self) -> LossFloor:
        """A new floor with this configuration (whether or not ``enabled``)."""
        return LossFloor(memory=self.memory, min_steps=self.min_steps, cap=self.cap)


@attrs.define(eq=False)
class LossFloor:
    """The training loss's moving average, and the floor's share of the loss left
    (EXPERIMENTAL: see the module docstring; made from a `FloorConfig`).

    ``memory`` (per step), ``min_steps`` (losses folded before any credit) and
    ``cap`` (the share's largest value) are configuration; the rest is state, all
    of it checkpointed.
    """

    memory: float = attrs.field(default=DEFAULT_MEMORY, converter=_memory)
    min_steps: int = attrs.field(default=DEFAULT_MIN_STEPS, converter=_min_steps)
    cap: float = attrs.field(default=DEFAULT_CAP, converter=_cap)
    steps: int = attrs.field(default=0, converter=_steps)
    loss_sum: float = attrs.field(default=0.0, converter=_loss_sum)
    loss_weight: float = attrs.field(default=0.0, converter=_loss_weight)
    #: Optimiser steps since the last finite loss was folded.
    idle: int = attrs.field(default=0, converter=_steps)
    _basis: _Basis | None = attrs.field(default=None, alias="basis")
    #: The drift's moving average (the loss less the floor its step's batch keeps,
    #: folded where both are known, at ``memory``): it lags as the loss's does, so a
    #: floor that moves (a larger batch, a lower rate) does not read as drift shed.
    drift_sum: float = attrs.field(default=0.0, converter=_drift_sum)
    drift_weight: float = attrs.field(default=0.0, converter=_drift_weight)
    drift: DriftHistory = attrs.field(factory=DriftHistory)

    SCHEMA: ClassVar[str] = FLOOR_SCHEMA

    @property
    def average(self) -> float | None:
        """The training loss's bias-corrected moving average (None before a finite one)."""
        return self.loss_sum / self.loss_weight if self.loss_weight > 0.0 else None

    @property
    def active(self) -> bool:
        """Whether the decision credits the floor now: a share is set and a finite loss
        was folded within the last `LAPSE_STEPS` optimiser steps."""
        return self._basis is not None and self.idle <= LAPSE_STEPS

    def idle_step(self) -> None:
        """Count one optimiser step (folded or not) toward the credit's lapse."""
        self.idle += 1

    def observe(
        self,
        loss: float,
        rates: Sequence[float],
        gns: GradientNoiseScale | None,
        batch_size: float,
        target_loss: float | None = None,
        progress: float = 0.0,
    ) -> None:
        """Fold one step's training ``loss`` (one not finite is skipped, yet counted)
        and, once ``min_steps`` are in, set what the share is computed from (nothing,
        while the estimate resolves no gradient).

        ``rates`` are the step's `sgd_rate` per parameter group at the base rate (the
        initial batch's), ``gns`` the job's estimator (its groups match ``rates``),
        ``batch_size`` the step's total batch, ``target_loss`` the training loss
        aimed at (None: none stated, the horizon's) and ``progress`` the job's
        progress before the step (in initial-batch steps; 0: none recorded).
        """
        if target_loss is not None:
            target_loss = check_float("target_loss", target_loss)
        batch_size = check_float("batch_size", batch_size, min=0.0, min_exclusive=True)
        progress = check_float("progress", progress, min=0.0)
        self.steps += 1
        folded = (
            isinstance(loss, numbers.Real) and not isinstance(loss, bool) and math.isfinite(loss)
        )
        if folded:
            # Each optimiser step folds the drift or ages its average (value kept): the
            # steps since the last fold without a loss are aged here, one whose
            # estimate resolves no gradient below. A long stretch of either leaves it
            # too light to record or read until it refills; a flicker does not
            # restart it.
            self._age_drift(max(self.idle - 1, 0))
            self.loss_sum, self.loss_weight = self._fold(self.loss_sum, self.loss_weight, loss)
            self.idle = 0
        average = self.average
        if gns is None or average is None:
            return
        if not gns.resolved:
            self._basis = None  # a gradient lost in the noise: no floor to tell apart
            if folded:  # nor a drift (a step without a loss is aged at the next fold)
                self._age_drift(1)
            return
        if len(rates) != gns.num_groups:
            raise ValueError(
                f"rates must have one value per parameter group ({gns.num_groups}), "
                f"got {len(rates)}"
            )
        m0 = float(gns.init_batch_size)
        # The groups' floors summed: the floor of the rate-weighted noise.
        weighted = math.fsum(r * v for r, v in zip(rates, gns.group_var, strict=True))
        var = gns.var / m0  # `GradParams.var`
        floor_per_var = floor_level(1.0, weighted, m0) / var if var > 0.0 else 0.0
        scale = max(batch_size / m0, 1.0)
        if folded:
            kept = floor_per_var * var * adascale_gain(max(gns.sqr, 0.0), var, scale) / scale
            self.drift_sum, self.drift_weight = self._fold(
                self.drift_sum, self.drift_weight, float(loss) - kept
            )
            # Recorded whatever the target (so that dropping it works), once the
            # average holds its memory's worth of losses: before, it is about the mean
            # since the start, and a loss falling reads as shed late, a plateau's as
            # none (the share then at its cap).
            if progress > 0.0 and self._drift_held():
                self.drift.record(progress, self.drift_sum / self.drift_weight)
        if self.steps < self.min_steps:
            return
        if target_loss is None:
            target_loss = self._horizon_target(progress)
        self._basis = _Basis(
            average=average, floor_per_var=floor_per_var, scale=scale, target_loss=target_loss
        )

    def _drift_held(self) -> bool:
        """Whether the drift's average holds ``min_steps`` losses' worth of weight
        (folded since it last started)."""
        return self.drift_weight >= 1.0 - self.memory**self.min_steps - 1e-12

    def _fold(self, total: float, weight: float, value: float) -> tuple[float, float]:
        """A moving average's (sum, weight) at ``memory`` with ``value`` folded in."""
        return (
            self.memory * total + (1.0 - self.memory) * float(value),
            self.memory * weight + (1.0 - self.memory),
        )

    def _age_drift(self, steps: int) -> None:
        """Age the drift's average ``steps`` steps without a value (its value kept)."""
        if steps:
            factor = self.memory**steps
            self.drift_sum *= factor
            self.drift_weight *= factor

    def _horizon_target(self, progress: float) -> float:
        """The loss the run reaches over the horizon (`adaptdl.core.stats.drift`): the
        drift's average less what it shed since ``progress / HORIZON`` (where it rose,
        less the rise: a large one gets little credit, a flat drift the most). 0 (the
        least credit) while the average holds too few losses, before the record
        reaches back that far, and without progress."""
        if not self._drift_held() or progress <= 0.0:
            return 0.0
        drift = self.drift_sum / self.drift_weight
        shed = self.drift.shed(progress, drift)
        return 0.0 if shed is None else drift - abs(shed)

    def share_at(self, params: GradParams | None) -> float:
        """The floor's share at the statistics ``params`` (`GradParams`, variance at the
        initial batch): their tr(Sigma) sets the floor, their efficiency at the last
        step's batch the part of it already shed. 0 while not `active`."""
        basis = self._basis
        if not self.active or basis is None or params is None:
            return 0.0
        if params.sqr <= 0.0 or params.var <= 0.0:
            return 0.0  # no noise keeps no floor; a lost gradient is credited in full
        efficiency = adascale_gain(params.sqr, params.var, basis.scale) / basis.scale
        floor0 = self.floor0_at(params)
        return floor_share(floor0, basis.average, efficiency, basis.target_loss, self.cap)

    def credit(self, params: GradParams | None) -> GradParams | None:
        """``params`` at the noise scale that credits the floor's share at them."""
        if params is None:
            return None
        return shared_params(params, self.share_at(params))

    def floor0_at(self, params: GradParams) -> float:
        """The initial batch's floor at the base rates of the last loss folded and the
        noise of ``params`` (NaN before a share is set)."""
        basis = self._basis
        return math.nan if basis is None else basis.floor_per_var * params.var

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
            "idle": self.idle,
            "basis": self._basis.to_json() if self._basis is not None else None,
            "drift_sum": self.drift_sum,
            "drift_weight": self.drift_weight,
            "drift": self.drift.to_json(),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LossFloor:
        """Rebuild from `to_json`'s output; raise ValueError on any other shape."""
        if isinstance(data, Mapping) and data.get("schema") == FLOOR_SCHEMA_V1:
            # Written before the drift was kept: none recorded, the horizon starts now.
            data = check_state("LossFloor state", data, FLOOR_SCHEMA_V1, _JSON_KEYS_V1)
            data = {**data, "drift_sum": 0.0, "drift_weight": 0.0, "drift": []}
        else:
            data = check_state("LossFloor state", data, cls.SCHEMA, _JSON_KEYS)
        basis = data["basis"]
        values = {k: data[k] for k in _JSON_KEYS if k not in ("schema", "basis", "drift")}
        return cls(
            **values,
            basis=_Basis.from_json(basis) if basis is not None else None,
            drift=DriftHistory.from_json(data["drift"]),
        )
