"""The gradient-noise estimators the experiments declare, through core's factory.

A study that measures core's estimator at another smoothing (`gns_accuracy`) names it
in the job's `MetricsConfig` and hands the job a registry holding it
(`adaptdl.core.stats.estimators`), instead of replacing the job's estimator.
"""

from __future__ import annotations

from adaptdl.core.stats.estimators import ESTIMATORS, EstimatorFactory
from adaptdl.core.stats.gns import GradientNoiseScale
from adaptdl.core.stats.metrics import MetricsConfig

#: The registry name of core's estimator at a smoothing the config gives.
SMOOTHED = "smoothed"


def smoothed(smoothing: float) -> tuple[MetricsConfig, dict[str, EstimatorFactory]]:
    """The metrics config and registry whose estimator is core's at ``smoothing``."""

    def make(init_batch_size: int, num_groups: int) -> GradientNoiseScale:
        return GradientNoiseScale(
            init_batch_size=init_batch_size, num_groups=num_groups, smoothing=smoothing
        )

    return MetricsConfig(estimator=SMOOTHED), {**ESTIMATORS, SMOOTHED: make}
