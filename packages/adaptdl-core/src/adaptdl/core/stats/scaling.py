"""Learning-rate scaling rules for a batch size ``scale`` times the initial one, as math.

Every rule maps ``(gain, scale, progress)`` to a factor that multiplies the base
learning rate (the one tuned for the initial batch size):

* ``gain``: the AdaScale gain at ``scale`` (:func:`adascale_gain`,
  ``GradientNoiseScale.gain``), in ``[1, scale]`` for ``scale >= 1``;
* ``scale``: total batch size / initial batch size, > 0;
* ``progress``: scale-invariant training progress so far, in initial-batch-size
  steps (``MetricsState.progress``: each optimiser step adds its gain).

Rules that do not need an input ignore it; all take the same three so that the
caller need not know which rule it holds.
"""

from __future__ import annotations

import math
from typing import ClassVar, Protocol, runtime_checkable

import attrs

from adaptdl.core.goodput.model import FLOATS, gain_ratio
from adaptdl.core.validate import check_float, check_int


def adascale_gain(sqr: float, var: float, scale: float) -> float:
    """Return the AdaScale gain ratio ``(var + sqr) / (var / scale + sqr)``
    (`adaptdl.core.goodput.model.gain_ratio`, the goodput model's, of which the
    statistical efficiency is ``gain / scale``), checked and kept within its bounds.

    ``sqr`` is |G|^2, the squared norm of the true gradient, and ``var`` the
    variance (trace of the covariance) of a gradient at the *initial* batch size,
    both >= 0 — the convention of ``goodput.GradParams``. The gain is how many
    initial-batch steps one step at ``scale`` times that batch is worth: between 1
    (no noise, ``var = 0``) and ``scale`` (all noise, ``sqr = 0``). For ``scale <
    1`` it lies in ``[scale, 1]``: a smaller batch is worth less than a step. It is
    1 when both statistics are zero (nothing known), and non-decreasing in
    ``scale``.
    """
    sqr = check_float("sqr", sqr, min=0.0)
    var = check_float("var", var, min=0.0)
    scale = check_float("scale", scale, min=0.0, min_exclusive=True)
    try:
        return float(gain_ratio(FLOATS, sqr, var, scale))
    except ZeroDivisionError:  # var / scale + sqr is 0: nothing known
        return 1.0


def _check_inputs(gain: float, scale: float, progress: float) -> tuple[float, float, float]:
    return (
        check_float("gain", gain, min=0.0, min_exclusive=True),
        check_float("scale", scale, min=0.0, min_exclusive=True),
        check_float("progress", progress, min=0.0),
    )


@runtime_checkable
class ScalingRule(Protocol):
    """What every rule offers: a name and the learning-rate factor."""

    name: ClassVar[str]

    def lr_factor(self, gain: float, scale: float, progress: float) -> float:
        """Return the multiplier of the base learning rate."""
        ...


@attrs.frozen
class _FactorOf:
    """A rule whose factor is one input (``of``: "gain" or "scale"), or its square root.

    Subclasses say which in their class line:
    ``class AdaScale(_FactorOf, name="adascale", of="gain")``.
    """

    name: ClassVar[str]
    _of: ClassVar[int]  # index into (gain, scale, progress)
    _root: ClassVar[bool]

    def __init_subclass__(cls, *, name: str, of: str, root: bool = False) -> None:
        super().__init_subclass__()
        cls.name = name
        cls._of = ("gain", "scale").index(of)
        cls._root = root

    def lr_factor(self, gain: float, scale: float, progress: float) -> float:
        """Return the multiplier of the base learning rate (see the class)."""
        value = _check_inputs(gain, scale, progress)[self._of]
        return math.sqrt(value) if self._root else value


class AdaScale(_FactorOf, name="adascale", of="gain"):
    """AdaScale (Johnson et al., 2020): the factor is the gain itself.

    For plain SGD: a step at ``scale`` worth ``gain`` initial steps takes a step
    ``gain`` times as long.
    """


class AdamScale(_FactorOf, name="adamscale", of="gain", root=True):
    """AdaScale for adaptive optimisers (Adam, AdamW, RMSprop): the factor is ``sqrt(gain)``.

    Adam normalises the update by the gradient's second moment, which shrinks by
    the same noise reduction the gain measures; the square root of the gain is the
    rule AdaptDL uses (its ``AdamScale`` raises the AdaScale gain to the power 0.5).
    The gain comes from the raw gradient's noise by default, or from the
    preconditioned gradient's (the original's choice; see ``adaptdl.core.stats.gns``,
    "Preconditioning", for why that one depends on the batch size in use).
    """


class LinearScale(_FactorOf, name="linear", of="scale"):
    """The linear scaling rule (Goyal et al., 2017): the factor is ``scale``."""


class SqrtScale(_FactorOf, name="sqrt", of="scale", root=True):
    """The square-root scaling rule (Krizhevsky, 2014): the factor is ``sqrt(scale)``."""


def _factor(value: object) -> float:
    return check_float("factor", value, min=0.0)


@attrs.frozen
class GivenFactor:
    """A factor computed outside core, applied as given: a user's own rule.

    The original AdaptDL's extension point is a rule class whose ``scale_lr(scale)``
    returns the factor; that code stays the user's, and the adapter hands core the
    value it returned for the step's scale. ``factor``: a finite real number >= 0.
    """

    factor: float = attrs.field(converter=_factor)

    name: ClassVar[str] = "given"

    def lr_factor(self, gain: float, scale: float, progress: float) -> float:
        """Return ``factor`` (the inputs are checked, not used)."""
        _check_inputs(gain, scale, progress)
        return self.factor


def _non_negative_float(value: object) -> float:
    return check_float("base_warmup_epochs", value, min=0.0)


def _data_size(value: object) -> int:
    return check_int("data_size", value, min=1)


def _init_batch_size(value: object) -> int:
    return check_int("init_batch_size", value, min=1)


@attrs.frozen
class LEGWScale:
    """Linear-epoch gradual warmup (You et al., 2019), measured in scale-invariant progress.

    At ``scale`` the learning rate rises linearly from 0 to ``sqrt(scale)`` times the
    base one over ``base_warmup_epochs * scale`` epochs (the warmup length grows
    linearly with the batch size), then stays there:

        warmup = base_warmup_epochs * scale * data_size / init_batch_size
        factor = sqrt(scale) * min(1, progress / warmup)

    ``warmup`` is in initial-batch steps, the unit of ``progress``. At a fixed scale
    whose gain equals the scale (perfect scaling) the warmup then lasts
    ``base_warmup_epochs * data_size / init_batch_size`` optimiser steps, as in the
    paper; with a smaller gain it lasts longer, as the progress accrues more slowly.
    ``base_warmup_epochs = 0`` means no warmup.
    """

    base_warmup_epochs: float = attrs.field(converter=_non_negative_float)
    data_size: int = attrs.field(converter=_data_size)
    init_batch_size: int = attrs.field(converter=_init_batch_size)

    name: ClassVar[str] = "legw"

    def warmup_progress(self, scale: float) -> float:
        """Return the warmup length at ``scale``, in initial-batch steps."""
        scale = check_float("scale", scale, min=0.0, min_exclusive=True)
        return self.base_warmup_epochs * scale * self.data_size / self.init_batch_size

    def lr_factor(self, gain: float, scale: float, progress: float) -> float:
        """Return ``sqrt(scale) * min(1, progress / warmup_progress(scale))``."""
        _, scale, progress = _check_inputs(gain, scale, progress)
        warmup = self.warmup_progress(scale)
        ramp = 1.0 if progress >= warmup else progress / warmup
        return math.sqrt(scale) * ramp
