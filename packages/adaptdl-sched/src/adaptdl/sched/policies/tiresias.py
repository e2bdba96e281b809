"""Tiresias (Gu et al., NSDI 2019): two-dimensional least attained service.

A job's attained service is GPUs x seconds it has held. Jobs sit in discretised
priority queues by attained service (``thresholds`` in GPU-seconds: queue 0 below the
first, queue 1 below the second, ...); each round admits jobs queue by queue, FIFO by
submission inside a queue, each with the GPUs it asked for, skipping jobs that do not
fit (so smaller ones behind them run). A job that has waited longer than
``starve_factor`` times its run time is promoted to queue 0, so demoted long jobs do
not starve. Batch size and GPU count are as submitted.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from adaptdl.core.validate import check_float
from adaptdl.sched.policies.base import Allocation, pack
from adaptdl.sched.policies.fifo import wanted
from adaptdl.sched.view import ClusterState, JobView


@attrs.define
class TiresiasPolicy:
    """Discretised 2D-LAS with starvation promotion."""

    thresholds: Sequence[float] = (3600.0 * 16,)
    starve_factor: float = 8.0
    name: str = "tiresias"
    adaptive: bool = False
    _waiting_since: dict[str, float] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        last = 0.0
        for i, t in enumerate(self.thresholds):
            check_float(f"thresholds[{i}]", t, min=last, min_exclusive=True)
            last = float(t)
        check_float("starve_factor", self.starve_factor, min=0.0, min_exclusive=True)

    def queue(self, job: JobView, time: float) -> int:
        """Index of the job's priority queue (0 is the highest)."""
        waited = time - self._waiting_since.get(job.name, time)
        if not job.nodes and job.run_time > 0 and waited > self.starve_factor * job.run_time:
            return 0
        return sum(job.attained_service >= t for t in self.thresholds)

    def allocate(self, state: ClusterState) -> Allocation:
        for job in state.jobs:
            if job.nodes:
                self._waiting_since.pop(job.name, None)
            else:
                self._waiting_since.setdefault(job.name, state.time)
        order = sorted(state.jobs, key=lambda j: (self.queue(j, state.time), j.submit, j.name))
        counts: dict[str, int] = {}
        free = state.total_gpus
        for job in order:
            want = wanted(job, state)
            if 0 < want <= free:
                counts[job.name] = want
                free -= want
        return pack(state, counts)
