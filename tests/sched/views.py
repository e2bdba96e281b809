"""A plain ``JobView`` for the scheduler's tests, and hints documents made by core."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from adaptdl.core.decide.hints import hints
from adaptdl.core.goodput import GradParams
from adaptdl.core.stats.profiler import Profiler
from adaptdl.core.stats.timings import FIT_AFTER


def profiled_hints(
    replicas: tuple[int, ...] = (1, 2),
    *,
    compute: float = 0.002,
    sync: float = 0.02,
    init_batch_size: int = 64,
    max_batch_size: int = 4096,
    grad: GradParams | None = None,
) -> dict[str, Any]:
    """Core's hints of a job profiled on one node at each count of ``replicas``: a step
    costs ``compute`` seconds per sample of its local batch, plus ``sync`` when it
    synchronises with other replicas."""
    profiler = Profiler()
    for k in replicas:
        for atomic in (32, 64):
            sync_time = sync if k > 1 else 0.0
            step = 0.01 + compute * atomic + sync_time
            profiler.record(1, k, atomic, accum_step=True, step_time=step - sync_time)
            for _ in range(FIT_AFTER):
                profiler.record(
                    1, k, atomic, accum_step=False, step_time=step, sync_time=sync_time
                )
    grad = GradParams(1.0, 4.0) if grad is None else grad
    return hints(profiler, grad, init_batch_size, max_batch_size, (16, 256), True)


#: Hints of a job that has not profiled anything yet.
FRESH_HINTS = hints(Profiler(), None, 64, 4096, (16, 256), True)


@attrs.define
class View:
    """A job as the live scheduler would fill ``adaptdl.sched.view.JobView``."""

    name: str
    submit: float = 0.0
    nodes: list[int] = attrs.field(factory=list)
    min_replicas: int = 1
    max_replicas: int = 64
    requested_replicas: int = 1
    restart_cost: float = 30.0
    started: float | None = None
    attained_service: float = 0.0
    run_time: float = 0.0
    remaining_progress: float | None = None
    hints: Mapping[str, Any] = FRESH_HINTS
