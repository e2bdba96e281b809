"""Shared test configuration: hypothesis profiles."""

import os

from hypothesis import HealthCheck, settings

# CI: deterministic examples, no per-example deadline (shared 2-core machines).
settings.register_profile(
    "ci", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
