"""Shared test configuration: hypothesis profiles, the repository root on sys.path."""

import gc
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from adaptdl.core.config import ENV_VARS

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.append(ROOT)  # for tests.fakes; last, so that nothing installed is shadowed

# CI: deterministic examples, no per-example deadline (shared 2-core machines).
settings.register_profile(
    "ci", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture
def fresh_torch_job(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A fresh default torch job in an environment without launcher variables."""
    import torch.distributed as dist  # torch only for the tests that ask

    from adaptdl.torch import _context

    for name in ENV_VARS:  # every variable the library reads, torchrun's among them
        monkeypatch.delenv(name, raising=False)
    _context._reset()
    yield
    had_group = dist.is_initialized()
    _context._reset()
    if had_group:
        # A destroyed group in a reference cycle keeps its threads until collected:
        # collected here, no later test runs (or forks) beside a test's leftovers.
        gc.collect()
