"""Driving a live scheduler in a test: tick it until a condition holds, read its events."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from adaptdl.sched.scheduler import Scheduler


def run_until(
    sched: Scheduler, done: Callable[[], bool], timeout: float, poll: float = 0.2
) -> None:
    """Tick ``sched`` every ``poll`` seconds until ``done()``; fail after ``timeout``."""
    end = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < end, f"not done in {timeout} s: {sched.rows()}"
        sched.tick()
        time.sleep(poll)


def events(sched: Scheduler) -> list[dict]:
    """The scheduler's event log, one object per line."""
    return [json.loads(line) for line in sched.events_path.read_text().splitlines()]


def ray_backend() -> Any:
    """The Ray backend, on the cluster ``ray.init`` joined (imported only where Ray is)."""
    from adaptdl.sched.rayengine import RayBackend

    return RayBackend(launch_timeout=60.0)
