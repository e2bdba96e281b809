"""Shared test configuration: hypothesis profiles."""

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

# CI: deterministic examples, no per-example deadline (shared 2-core machines).
settings.register_profile(
    "ci", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


# Every variable the library reads, and those torchrun sets for its workers.
LAUNCH_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "ADAPTDL_REPLICA_RANK",
    "ADAPTDL_NUM_REPLICAS",
    "ADAPTDL_NUM_NODES",
    "ADAPTDL_NUM_RESTARTS",
    "ADAPTDL_CHECKPOINT_PATH",
    "ADAPTDL_CHECKPOINT_INTERVAL",
    "ADAPTDL_CHECKPOINT_STEPS",
    "ADAPTDL_SHARE_PATH",
    "ADAPTDL_JOB_ID",
    "ADAPTDL_COLLECTIVE_TIMEOUT",
)


@pytest.fixture
def fresh_torch_job(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A fresh default torch job in an environment without launcher variables."""
    from adaptdl.torch import _context  # torch only for the tests that ask

    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    _context._reset()
    yield
    _context._reset()
