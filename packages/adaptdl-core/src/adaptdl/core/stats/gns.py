"""Gradient noise scale: running estimates of |G|^2 and tr(Sigma) from squared norms.

Notation. ``G`` is the true (full-data) gradient, ``Sigma`` the covariance of the
gradient of a *single sample*, ``g_b`` the mean gradient of ``b`` independent
samples. Then ``E|g_b|^2 = |G|^2 + tr(Sigma) / b``. A step that averages ``S``
micro-batches of ``b`` samples each (``S = replicas * (accum_steps + 1)``) sees
``S`` small gradients ``g_1 .. g_S`` (batch ``b``) and their mean ``g`` (batch
``B = S * b``). With ``m_s = (1/S) sum_i |g_i|^2`` and ``m_B = |g|^2``, the
unbiased estimators (McCandlish et al., 2018) are::

    |G|^2     ~ (B * m_B - b * m_s) / (B - b) = (S * m_B - m_s) / (S - 1)
    tr(Sigma) ~ (m_s - m_B) / (1/b - 1/B)     = (m_s - m_B) * b * S / (S - 1)

A step with a single micro-batch (one replica, no accumulation) has ``S = 1`` and
no information on its own. :meth:`GradientNoiseScale.update_differenced` then
pairs it with the previous step's gradient: with ``g_p`` (batch ``b_p``) and
``g_c`` (batch ``b_c``) independent draws, ``E[g_p . g_c] = |G|^2`` and
``E|g_p - g_c|^2 = tr(Sigma) * (1/b_p + 1/b_c)``, both read off the three squared
norms ``|g_p|^2``, ``|g_c|^2`` and ``|(g_p + g_c)/2|^2``. (For ``b_p == b_c`` this
is exactly the two-micro-batch estimator above.) It is biased by how far the
parameters moved between the two steps, which inflates tr(Sigma); when an unbiased
(multi-micro-batch) estimate arrives after differenced ones, the averages restart
so that the biased history does not linger.

Each estimate is folded into an exponential moving average with bias correction,
``theta = smoothing ** scale`` where ``scale = B / init_batch_size``: a step with
``scale`` times the initial batch carries as much data as ``scale`` initial steps,
so it moves the average as much as ``scale`` of them would. The default smoothing
0.999 (AdaptDL's) averages over roughly the last thousand initial-batch steps'
worth of data: long enough for the per-step estimates, which are very noisy at
small batches, to settle, short enough to follow the drift of |G|^2 over training.
A step measured when only a share ``s`` of the steps is (`adaptdl.core.stats.statsbudget`)
stands for ``1 / s`` steps: its scale is divided by ``s``, so that the memory in
samples stays the same; the average then rests on fewer steps, and the spread below
counts them.

Preconditioning. For an optimiser that applies a diagonal preconditioner (Adam:
``P = sqrt(v_hat) + eps``) the caller may pass squared norms of the
*preconditioned* gradient ``g / P`` (see :func:`squared_norm`), computed with one
and the same ``P`` for every quantity of one update (all micro-batches and the
mean; in the differenced case the previous and the current gradient). The
estimates are then |G / P|^2 and tr(D Sigma D) with ``D = diag(1 / P)``. The torch
adapter does so only under ``AdamScale(preconditioned=True)`` (the original
AdaptDL's choice); by default it passes the raw gradient's. ``P`` is measured at
the batch size in use: while ``v_hat`` is mostly noise, ``1 / P_i^2`` is about
``b / Sigma_ii``, so the preconditioned noise scale is about
``d / sum_i (G_i^2 / Sigma_ii)`` (one over the mean signal-to-noise ratio of the
coordinates), and it rises towards ``mean_i (Sigma_ii / G_i^2)`` as the batch grows
and ``v_hat`` fills with signal: by Jensen's inequality the small batch reads less,
by as much as the coordinates' ratios differ. A decision made at the initial batch
then underrates every larger one (a Dyck transformer read 4-5 samples at 16 where
the same training reads 27-81 at 64). The raw gradient's estimates, |G|^2 and
tr(Sigma), do not depend on the batch they are measured at.

The estimates are kept per parameter group; the model's values are the sums over
groups.

Spread. Next to the averages, the estimator keeps the same moving average of half
the squared *relative successive differences* of each step's whole-model estimates,
``(x_k - x_{k-1}) / l``, ``l`` the mean of the two steps' levels ``max(|G|^2, 0) +
tr(Sigma) / init_batch_size`` (the expected squared norm of an initial-batch
gradient, which sets the scale of both estimates' noise), with its own normaliser
and the sum of its squared weights (``moment_weight``, ``moment_weight_sq``).
Differences (von Neumann's estimator of a variance) because a drift of the truth
cancels in them; relative because the noise of a squared-norm estimate grows with
its level, which under Adam falls by orders of magnitude in the first hundreds of
steps: measured on a Dyck transformer, absolute differences left that transient
dominating the spread for the whole run. With weights ``a_k`` on the differences
since the last restart, the effective number of steps is ``n = (sum a_k)^2 / sum
a_k^2``, and the standard error of an average is ``L sqrt(r^2 / n)``, ``r^2`` that
average and ``L`` the level of the current estimates (inf while ``n <= 1``). `sqr_error`,
`var_error` and `grad_params_bound` read it; a batch-size decision grows only as far
as the bound supports (`adaptdl.core.decide.batchsize.GoodputDecision`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs
import numpy as np
import numpy.typing as npt

from adaptdl.core.goodput import GradParams
from adaptdl.core.stats.gnsnorms import group_values, squared_norm, step_estimates
from adaptdl.core.stats.scaling import adascale_gain
from adaptdl.core.validate import (
    ArgumentTypeError,
    check_float,
    check_int,
    check_state,
)

# `squared_norm` and `step_estimates` live in `gnsnorms`; users import them from here.
__all__ = [
    "GNS_SCHEMA",
    "GNS_SCHEMA_WITHOUT_SPREAD",
    "GradientNoiseScale",
    "squared_norm",
    "step_estimates",
]

#: Schema tag of :meth:`GradientNoiseScale.to_json`.
GNS_SCHEMA = "adaptdl.gns/3"

#: The schema before the spread was kept; its states load with no spread known.
GNS_SCHEMA_WITHOUT_SPREAD = "adaptdl.gns/2"

_SPREAD_KEYS = (
    "sqr_diff_biased",
    "var_diff_biased",
    "last_step",
    "moment_weight",
    "moment_weight_sq",
)

_JSON_KEYS_V2 = (
    "schema",
    "init_batch_size",
    "num_groups",
    "smoothing",
    "sqr_biased",
    "var_biased",
    "weight",
    "differenced",
    "num_updates",
)

_JSON_KEYS = (*_JSON_KEYS_V2, *_SPREAD_KEYS)


def _init_batch_size(value: Any) -> int:
    return check_int("init_batch_size", value, min=1)


def _num_groups(value: Any) -> int:
    return check_int("num_groups", value, min=1)


def _smoothing(value: Any) -> float:
    return check_float(
        "smoothing", value, min=0.0, max=1.0, min_exclusive=True, max_exclusive=True
    )


def _float_tuple(name: str, value: Any) -> tuple[float, ...]:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (Sequence, np.ndarray)):
        raise ArgumentTypeError(f"{name} must be a sequence of numbers, got {value!r}")
    return tuple(check_float(f"{name}[{i}]", v) for i, v in enumerate(value))


def _share(value: Any) -> float:
    return check_float("share", value, min=0.0, max=1.0, min_exclusive=True)


def _last_step(value: Any) -> tuple[float, float] | None:
    if value is None:
        return None
    pair = _float_tuple("last_step", value)
    if len(pair) != 2:
        raise ValueError(f"last_step must be None or two numbers, got {value!r}")
    return pair[0], pair[1]


def _sqr_sums(value: Any) -> tuple[float, ...]:
    return _float_tuple("sqr_biased", value)


def _var_sums(value: Any) -> tuple[float, ...]:
    return _float_tuple("var_biased", value)


@attrs.define(eq=True)
class GradientNoiseScale:
    """Running estimates of the gradient's squared norm and noise, per parameter group.

    Fields ``init_batch_size`` (the batch size the learning rate was tuned for, in
    samples), ``num_groups`` (parameter groups) and ``smoothing`` (in (0, 1)) are
    configuration; the others are state and are best left at their defaults.

    Per optimiser step the caller does exactly one of:

    * :meth:`update` when the step averaged two or more micro-batches;
    * :meth:`update_differenced` when it had one micro-batch and the previous step's
      gradient (also one micro-batch) is at hand;
    * nothing (first single-micro-batch step, or a skipped step).

    ``adaptdl.core.stats.step`` applies these rules for an adapter. The state is plain
    data: :meth:`to_json` / :meth:`from_json`.
    """

    init_batch_size: int = attrs.field(converter=_init_batch_size)
    num_groups: int = attrs.field(default=1, converter=_num_groups)
    smoothing: float = attrs.field(default=0.999, converter=_smoothing)
    # Moving sums per group, not yet divided by their common normaliser ``weight``.
    sqr_biased: tuple[float, ...] = attrs.field(default=(), converter=_sqr_sums)
    var_biased: tuple[float, ...] = attrs.field(default=(), converter=_var_sums)
    weight: float = attrs.field(default=0.0)
    # Whether the averages hold estimates of the (biased) differenced kind.
    differenced: bool = attrs.field(default=False)
    num_updates: int = attrs.field(default=0)
    # The spread (module docstring): moving sums of half the squared relative successive
    # differences of the whole-model per-step estimates, the last step's (|G|^2,
    # tr(Sigma)) estimates, and the normaliser and sum of squared weights of the sums.
    sqr_diff_biased: float = attrs.field(default=0.0)
    var_diff_biased: float = attrs.field(default=0.0)
    last_step: tuple[float, float] | None = attrs.field(default=None, converter=_last_step)
    moment_weight: float = attrs.field(default=0.0)
    moment_weight_sq: float = attrs.field(default=0.0)

    SCHEMA: ClassVar[str] = GNS_SCHEMA

    def __attrs_post_init__(self) -> None:
        n = self.num_groups
        for name in ("sqr_biased", "var_biased"):
            value = getattr(self, name)
            if value == ():
                setattr(self, name, (0.0,) * n)
            elif len(value) != n:
                raise ValueError(f"{name} must have {n} values (num_groups), got {len(value)}")
        self.weight = check_float("weight", self.weight, min=0.0, max=1.0)
        if self.weight == 0.0 and any(v != 0.0 for v in self.sqr_biased + self.var_biased):
            raise ValueError("weight must be > 0 when the moving sums are not zero")
        if not isinstance(self.differenced, (bool, np.bool_)):
            raise ArgumentTypeError(f"differenced must be a bool, got {self.differenced!r}")
        self.differenced = bool(self.differenced)
        self.num_updates = check_int("num_updates", self.num_updates, min=0)
        for name in ("sqr_diff_biased", "var_diff_biased"):
            setattr(self, name, check_float(name, getattr(self, name), min=0.0))
        self.moment_weight = check_float("moment_weight", self.moment_weight, min=0.0, max=1.0)
        self.moment_weight_sq = check_float(
            "moment_weight_sq", self.moment_weight_sq, min=0.0, max=self.moment_weight
        )

    # -- estimates ---------------------------------------------------------

    @property
    def has_estimate(self) -> bool:
        """Whether at least one update has been folded in since the last restart."""
        return self.weight > 0.0

    @property
    def group_sqr(self) -> tuple[float, ...]:
        """Per group, the estimate of |G_g|^2, clamped at 0 (all 0 before any update)."""
        return tuple(max(v, 0.0) for v in self._normalised(self.sqr_biased))

    @property
    def group_var(self) -> tuple[float, ...]:
        """Per group, the estimate of tr(Sigma_g) per sample, clamped at 0."""
        return tuple(max(v, 0.0) for v in self._normalised(self.var_biased))

    @property
    def sqr(self) -> float:
        """The estimate of |G|^2 for the whole model: sum over groups, clamped at 0."""
        return max(self._raw_sqr, 0.0)

    @property
    def var(self) -> float:
        """The estimate of tr(Sigma), the noise of a *single-sample* gradient, clamped at 0."""
        return max(self._raw_var, 0.0)

    @property
    def _raw_sqr(self) -> float:
        """The whole model's |G|^2 estimate before the clamp (may be below 0)."""
        return math.fsum(self._normalised(self.sqr_biased))

    @property
    def _raw_var(self) -> float:
        """The whole model's tr(Sigma) estimate before the clamp."""
        return math.fsum(self._normalised(self.var_biased))

    @property
    def noise_scale(self) -> float | None:
        """The simple noise scale ``var / sqr``, in samples.

        None without an estimate or when both are 0; inf when only ``sqr`` is 0.
        """
        if not self.has_estimate:
            return None
        sqr, var = self.sqr, self.var
        if sqr == 0.0:
            return math.inf if var > 0.0 else None
        return var / sqr

    @property
    def samples(self) -> float:
        """Samples folded into the estimates since the last restart (inf once saturated).

        Read off the bias-correction normaliser: each step of ``B`` samples multiplies
        ``1 - weight`` by ``smoothing ** (B / init_batch_size)``, so ``1 - weight =
        smoothing ** (samples / init_batch_size)``. It is what a batch-size decision
        measures the estimate's warm-up in.
        """
        if self.weight >= 1.0:
            return math.inf
        return max(self.init_batch_size * math.log1p(-self.weight) / math.log(self.smoothing), 0.0)

    @property
    def effective_updates(self) -> float:
        """The effective number of steps in the averages' spread (0: none recorded).

        ``(sum a_k)^2 / sum a_k^2`` over the weights ``a_k`` of the steps folded in
        since the last restart (or since a state without spread was loaded).
        """
        if self.moment_weight_sq == 0.0:
            return 0.0
        return self.moment_weight**2 / self.moment_weight_sq

    @property
    def sqr_error(self) -> float:
        """The standard error of `sqr` (inf before the spread holds two differences)."""
        return self._error(self.sqr_diff_biased)

    @property
    def var_error(self) -> float:
        """The standard error of `var` (inf before the spread holds two differences)."""
        return self._error(self.var_diff_biased)

    def grad_params_bound(self, z: float) -> GradParams | None:
        """The statistics at the noise scale's lower confidence bound, or None before any update.

        |G|^2 at its estimate plus ``z`` standard errors, tr(Sigma) at its estimate
        minus ``z`` (at least 0): the least noise, so the least benefit from a larger
        batch, that the data support at ``z``. Without a spread (fewer than three steps)
        tr(Sigma) is 0: no larger batch is supported. An estimate of |G|^2 below 0 is
        off by at least its distance from 0 (|G|^2 >= 0), whatever the spread says, so
        the bound adds that distance to the ``z`` errors: |G|^2 at ``|estimate| + z *
        error``. A confidently negative estimate (measured under Adam, whose
        preconditioner changes between the steps averaged) then supports little
        growth; one within its noise of 0 (a plateau) as much as its spread allows.
        The noise scale of the bound never grows with ``z`` and is continuous in the
        estimate. ``z = 0`` gives `grad_params`.
        """
        z = check_float("z", z, min=0.0)
        if not self.has_estimate:
            return None
        if z == 0.0:
            return self.grad_params()
        sqr_err, var_err = self.sqr_error, self.var_error
        if not (math.isfinite(sqr_err) and math.isfinite(var_err)):
            return GradParams(sqr=max(self.sqr, 1e-300), var=0.0)
        sqr = max(abs(self._raw_sqr) + z * sqr_err, 1e-300)
        var = max(self._raw_var - z * var_err, 0.0)
        return GradParams(sqr=sqr, var=var / self.init_batch_size)

    @property
    def resolved(self) -> bool:
        """Whether the estimate resolves the gradient: |G|^2 estimated above 0.

        At or below 0 the estimate reads the gradient as lost in the noise: a plateau
        (an untrained network's first steps), or an estimate that is off (under Adam,
        whose preconditioner changes between the steps averaged). The gain is then the
        scale whatever the batch, so nothing but a cap limits a decision's growth.
        """
        return self.has_estimate and self._raw_sqr > 0.0

    def grad_params(self) -> GradParams | None:
        """The statistics in the form the goodput model takes, or None before any update.

        ``GradParams.var`` is the variance of a gradient at the *initial* batch size,
        ``var / init_batch_size``.
        """
        if not self.has_estimate:
            return None
        return GradParams(sqr=self.sqr, var=self.var / self.init_batch_size)

    def gain(self, scale: float) -> float:
        """AdaScale gain at ``scale`` = total batch size / init batch size (1 before any update).

        ``(v + s) / (v / scale + s)`` with ``s = sqr`` and ``v = var / init_batch_size``:
        in ``[1, scale]`` for ``scale >= 1``.
        """
        scale = check_float("scale", scale, min=0.0, min_exclusive=True)
        if not self.has_estimate:
            return 1.0
        return adascale_gain(self.sqr, self.var / self.init_batch_size, scale)

    def group_gains(self, scale: float) -> tuple[float, ...]:
        """The gain of each parameter group on its own (all 1 before any update)."""
        scale = check_float("scale", scale, min=0.0, min_exclusive=True)
        if not self.has_estimate:
            return (1.0,) * self.num_groups
        m0 = self.init_batch_size
        return tuple(
            adascale_gain(s, v / m0, scale)
            for s, v in zip(self.group_sqr, self.group_var, strict=True)
        )

    # -- updates -----------------------------------------------------------

    def update(
        self,
        local_sqr: npt.ArrayLike,
        total_sqr: npt.ArrayLike,
        count: int,
        batch_size: int,
        *,
        share: float = 1.0,
    ) -> None:
        """Fold in one optimiser step that averaged ``count >= 2`` micro-batches.

        Per parameter group (a float when ``num_groups == 1``):

        * ``local_sqr``: the sum, over all ``count`` micro-batches of the step (every
          replica, every accumulation micro-batch), of the squared norm of that
          micro-batch's gradient, each gradient being the mean over its samples;
        * ``total_sqr``: the squared norm of the step's averaged gradient (the mean of
          the ``count`` micro-batch gradients, as after all-reduce and accumulation);
        * ``count``: the number of micro-batches, ``replicas * (accum_steps + 1)``;
        * ``batch_size``: the atomic batch size, samples per micro-batch.

        The step's scale is ``count * batch_size / init_batch_size``. ``share``: the
        share of steps measured (`adaptdl.core.stats.statsbudget`); the step stands for
        ``1 / share`` steps, its scale divided by ``share``.
        """
        share = _share(share)
        count = check_int("count", count, min=1)
        if count == 1:
            raise ValueError(
                "count must be >= 2 for update(), got 1: a single micro-batch carries no "
                "noise estimate on its own; use update_differenced() with the previous step"
            )
        b = check_int("batch_size", batch_size, min=1)
        local = group_values("local_sqr", local_sqr, self.num_groups)
        total = group_values("total_sqr", total_sqr, self.num_groups)
        pairs = [step_estimates(lo, t, count, b) for lo, t in zip(local, total, strict=True)]
        sqr = tuple(sq for sq, _ in pairs)
        var = tuple(v for _, v in pairs)
        if self.differenced:
            self._restart()
        self.differenced = False
        self._fold(sqr, var, count * b / self.init_batch_size / share)

    def update_differenced(
        self,
        prev_sqr: npt.ArrayLike,
        cur_sqr: npt.ArrayLike,
        mixed_sqr: npt.ArrayLike,
        batch_size: int,
        prev_batch_size: int | None = None,
        *,
        share: float = 1.0,
    ) -> None:
        """Fold in one single-micro-batch step, paired with the previous one.

        Per parameter group (a float when ``num_groups == 1``), with ``g_p`` the
        previous optimiser step's gradient and ``g_c`` this step's, both from a single
        micro-batch and both preconditioned with this step's preconditioner (if any):

        * ``prev_sqr = |g_p|^2``, ``cur_sqr = |g_c|^2``, ``mixed_sqr = |(g_p + g_c) / 2|^2``;
        * ``batch_size``: samples in this step's micro-batch; ``prev_batch_size``: in the
          previous one (default: the same).

        The step's scale is ``batch_size / init_batch_size``: each step is folded in
        once although its gradient takes part in two pairs; divided by ``share`` (as in
        :meth:`update`).
        """
        share = _share(share)
        b_c = check_int("batch_size", batch_size, min=1)
        b_p = b_c
        if prev_batch_size is not None:
            b_p = check_int("prev_batch_size", prev_batch_size, min=1)
        prev = group_values("prev_sqr", prev_sqr, self.num_groups)
        cur = group_values("cur_sqr", cur_sqr, self.num_groups)
        mixed = group_values("mixed_sqr", mixed_sqr, self.num_groups)
        # g_p . g_c and |g_p - g_c|^2 from the three squared norms.
        dot = tuple(2.0 * m - 0.5 * (p + c) for p, c, m in zip(prev, cur, mixed, strict=True))
        weight = 1.0 / b_p + 1.0 / b_c
        var = tuple(
            (2.0 * (p + c) - 4.0 * m) / weight for p, c, m in zip(prev, cur, mixed, strict=True)
        )
        self.differenced = True
        self._fold(dot, var, b_c / self.init_batch_size / share)

    def reset(self) -> None:
        """Forget the estimates."""
        self._restart()
        self.differenced = False

    # -- persistence -------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """Return the whole state as JSON-ready data (exact: floats round-trip through JSON)."""
        return {
            "schema": self.SCHEMA,
            "init_batch_size": self.init_batch_size,
            "num_groups": self.num_groups,
            "smoothing": self.smoothing,
            "sqr_biased": list(self.sqr_biased),
            "var_biased": list(self.var_biased),
            "weight": self.weight,
            "differenced": self.differenced,
            "num_updates": self.num_updates,
            "sqr_diff_biased": self.sqr_diff_biased,
            "var_diff_biased": self.var_diff_biased,
            "last_step": list(self.last_step) if self.last_step is not None else None,
            "moment_weight": self.moment_weight,
            "moment_weight_sq": self.moment_weight_sq,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GradientNoiseScale:
        """Rebuild from :meth:`to_json`'s output; raise ValueError on any other shape.

        A state of the schema before the spread was kept (``adaptdl.gns/2``) loads
        with no spread: the errors are inf until three more steps are folded in.
        """
        if isinstance(data, Mapping) and data.get("schema") == GNS_SCHEMA_WITHOUT_SPREAD:
            data = check_state(
                "GradientNoiseScale state", data, GNS_SCHEMA_WITHOUT_SPREAD, _JSON_KEYS_V2
            )
            return cls(**{k: data[k] for k in _JSON_KEYS_V2 if k != "schema"})
        data = check_state("GradientNoiseScale state", data, cls.SCHEMA, _JSON_KEYS)
        return cls(**{k: data[k] for k in _JSON_KEYS if k != "schema"})

    # -- internals ---------------------------------------------------------

    def _normalised(self, biased: tuple[float, ...]) -> tuple[float, ...]:
        if self.weight == 0.0:
            return (0.0,) * self.num_groups
        return tuple(v / self.weight for v in biased)

    def _restart(self) -> None:
        self.sqr_biased = (0.0,) * self.num_groups
        self.var_biased = (0.0,) * self.num_groups
        self.weight = 0.0
        self.sqr_diff_biased = self.var_diff_biased = 0.0
        self.last_step = None
        self.moment_weight = self.moment_weight_sq = 0.0

    def _error(self, diff_biased: float) -> float:
        n = self.effective_updates
        if n <= 1.0 + 1e-9 or self.moment_weight == 0.0:
            return math.inf
        return self._level(self._raw_sqr, self._raw_var) * math.sqrt(
            diff_biased / self.moment_weight / n
        )

    def _level(self, sqr: float, var: float) -> float:
        """The scale of the estimates' noise: ``max(sqr, 0) + var / init_batch_size``."""
        return max(sqr, 0.0) + max(var, 0.0) / self.init_batch_size

    def _fold(self, sqr: tuple[float, ...], var: tuple[float, ...], scale: float) -> None:
        # Runs at every optimiser step: plain floats, and the fields set past attrs'
        # on_setattr hooks (their converters re-check what is computed here from
        # checked values).
        theta = self.smoothing**scale
        rest = 1.0 - theta
        new_sqr = tuple(theta * a + rest * b for a, b in zip(self.sqr_biased, sqr, strict=True))
        new_var = tuple(theta * a + rest * b for a, b in zip(self.var_biased, var, strict=True))
        step = (math.fsum(sqr), math.fsum(var))
        # Finite inputs can still overflow (squared norms near the float range): refuse
        # them before any field changes, as the fields' converters would.
        if not all(math.isfinite(v) for v in (*new_sqr, *new_var, *step)):
            raise ValueError(
                f"the step's estimates overflow: |G|^2 {sqr!r}, tr(Sigma) {var!r}; "
                "squared norms must stay well inside the float range"
            )
        put = object.__setattr__
        put(self, "sqr_biased", new_sqr)
        put(self, "var_biased", new_var)
        # Rounding could lift the normaliser a hair above its limit 1.
        put(self, "weight", min(theta * self.weight + rest, 1.0))
        last = self.last_step
        level = 0.0
        if last is not None:
            level = 0.5 * (self._level(*step) + self._level(*last))
        if level > 0.0 and last is not None:
            half_sqr = 0.5 * ((step[0] - last[0]) / level) ** 2
            half_var = 0.5 * ((step[1] - last[1]) / level) ** 2
            put(self, "sqr_diff_biased", theta * self.sqr_diff_biased + rest * half_sqr)
            put(self, "var_diff_biased", theta * self.var_diff_biased + rest * half_var)
            moment = min(theta * self.moment_weight + rest, 1.0)
            put(self, "moment_weight", moment)
            put(self, "moment_weight_sq", min(theta**2 * self.moment_weight_sq + rest**2, moment))
        put(self, "last_step", step)
        put(self, "num_updates", self.num_updates + 1)
