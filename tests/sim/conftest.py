"""Shared fixtures of the simulator tests: the measured Pollux data, where present."""

from __future__ import annotations

import os

# Single-threaded BLAS: the core's model fit is much slower with contending threads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from pathlib import Path

import pytest

POLLUX = Path(__file__).resolve().parents[2] / ".." / "shared" / "pollux"


@pytest.fixture(scope="session")
def pollux_dir() -> Path:
    """The Pollux traces and workloads folder; skips the test where it is absent."""
    if not (POLLUX / "traces").is_dir():
        pytest.skip(f"measured Pollux data not found at {POLLUX}")
    return POLLUX.resolve()


@pytest.fixture(scope="session")
def trace_apps(pollux_dir: Path) -> dict:
    from adaptdl.sim.traces import load_traces

    return load_traces(pollux_dir / "traces")
