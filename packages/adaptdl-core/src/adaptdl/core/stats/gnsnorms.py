"""The squared norms the gradient noise scale is measured from, and one step's estimates.

`squared_norm` is the reference definition of the squared norms that
`adaptdl.core.stats.gns.GradientNoiseScale` takes, `group_values` checks them (one value
per parameter group) as its updates receive them, and `step_estimates` turns one
step's squared norms into its unbiased estimates of |G|^2 and tr(Sigma) (the
estimators and the notation are in the `adaptdl.core.stats.gns` docstring).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from adaptdl.core.validate import ArgumentTypeError, as_real_array

__all__ = ["group_values", "squared_norm", "step_estimates"]

# What the squared norms must be, in error messages.
_REALS = "an array of real numbers"


def squared_norm(grad: npt.ArrayLike, precond: npt.ArrayLike | None = None) -> float:
    """Return ``sum((grad / precond) ** 2)`` in float64 (``precond`` None: ``sum(grad ** 2)``).

    The reference definition of the squared norms
    :class:`~adaptdl.core.stats.gns.GradientNoiseScale` takes; ``precond`` broadcasts against
    ``grad`` and must be positive.
    """
    g = as_real_array("grad", grad, expected=_REALS)
    if precond is not None:
        p = as_real_array("precond", precond, expected=_REALS)
        bad = ~(np.isfinite(p) & (p > 0))
        if bad.any():
            raise ValueError(
                f"precond must be finite and > 0, got {np.asarray(p)[bad].flat[0].item()!r}"
            )
        g = g / p
    value = float(np.sum(np.square(g)))
    if not math.isfinite(value):
        raise ValueError(f"grad must be finite, got a squared norm of {value!r}")
    return value


def step_estimates(
    local_sqr: float, total_sqr: float, count: int, batch_size: int
) -> tuple[float, float]:
    """One step's unbiased estimates (|G|^2, tr(Sigma)) from its squared norms.

    ``local_sqr`` sums the squared norms of the step's ``count >= 2`` micro-batch
    gradients (``batch_size`` samples each), ``total_sqr`` is the squared norm of
    their mean: the estimators of the `adaptdl.core.stats.gns` docstring, what
    :meth:`GradientNoiseScale.update` folds in per parameter group.
    """
    if count < 2:
        raise ValueError(f"count must be >= 2 micro-batches, got {count!r}")
    sqr = (count * total_sqr - local_sqr / count) / (count - 1)
    var = (local_sqr / count - total_sqr) * (batch_size * count / (count - 1))
    return sqr, var


def group_values(name: str, value: Any, num_groups: int) -> tuple[float, ...]:
    """Return one finite, non-negative float per group, or raise naming ``name``."""
    # The common case, checked without numpy (it runs at every optimiser step): a tuple
    # of floats, as `adaptdl.core.stats.step.StepMeasurement` holds them.
    if (
        type(value) is tuple
        and len(value) == num_groups
        and all(type(v) is float and 0.0 <= v < math.inf for v in value)
    ):
        return value
    if isinstance(value, (str, bytes)):
        raise ArgumentTypeError(f"{name} must be a number or a sequence of numbers, got {value!r}")
    array = as_real_array(name, value, expected=_REALS)
    if array.ndim == 0:
        if num_groups != 1:
            raise ValueError(
                f"{name} must have one value per parameter group ({num_groups}), got a scalar"
            )
        array = array.reshape(1)
    if array.shape != (num_groups,):
        raise ValueError(
            f"{name} must have shape ({num_groups},), one value per parameter group, "
            f"got shape {array.shape}"
        )
    bad = ~np.isfinite(array) | (array < 0)
    if bad.any():
        raise ValueError(
            f"{name} must be finite and >= 0, got {array[bad][0].item()!r} "
            f"(group {int(np.flatnonzero(bad)[0])})"
        )
    return tuple(float(v) for v in array)
