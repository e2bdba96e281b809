"""The gradient-noise estimators a job may use, by name: the declared factory.

A job's `MetricsState` makes its estimator through a registry of named constructors
(`ESTIMATORS` unless the job is given another), chosen by
`MetricsConfig.estimator`, so that a variant (another smoothing, an experiment's
prototype) is declared where the job is built, never put in place by replacing the
job's estimator afterwards. A constructor takes the initial batch size and the number
of parameter groups and returns a `GradientNoiseScale` (or a subclass) of that shape.

A restored job keeps the estimator its checkpoint holds (its JSON carries its own
parameters, e.g. its smoothing), as the default estimator always has.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from adaptdl.core.stats.gns import GradientNoiseScale

__all__ = ["DEFAULT_ESTIMATOR", "ESTIMATORS", "EstimatorFactory", "estimator_factory"]

EstimatorFactory = Callable[[int, int], GradientNoiseScale]
"""``(init_batch_size, num_groups) -> estimator``: a registry entry."""

DEFAULT_ESTIMATOR = "gradient-noise-scale"
"""Core's estimator (`GradientNoiseScale` at its default smoothing): the default name."""


def _gradient_noise_scale(init_batch_size: int, num_groups: int) -> GradientNoiseScale:
    return GradientNoiseScale(init_batch_size=init_batch_size, num_groups=num_groups)


ESTIMATORS: Mapping[str, EstimatorFactory] = MappingProxyType(
    {DEFAULT_ESTIMATOR: _gradient_noise_scale}
)
"""The registry a job uses unless it is given another (read-only)."""


def estimator_factory(
    name: str, registry: Mapping[str, EstimatorFactory] = ESTIMATORS
) -> EstimatorFactory:
    """The constructor registered as ``name`` in ``registry``.

    ValueError naming the value and the registered names when there is none.
    """
    factory = registry.get(name) if isinstance(name, str) else None
    if factory is None:
        allowed = ", ".join(repr(k) for k in sorted(registry))
        raise ValueError(
            f"estimator must be one of the registered estimators ({allowed}), got {name!r}"
        )
    return factory
