"""The job's progress as a program and TensorBoard read it, continuing across restarts.

`global_step` counts the training loop's optimiser steps since the job first
started: it is saved in every checkpoint, so a curve plotted against it goes on
where the previous run stopped instead of starting again at 0. `JobScalars`
writes the job-wide figures (replicas, restarts, samples per second, goodput,
the global step) to a TensorBoard ``SummaryWriter``.
"""

from __future__ import annotations

from typing import Any

from adaptdl.core.job import Job
from adaptdl.torch._context import current_job

__all__ = ["JobScalars", "global_step"]


def global_step() -> int:
    """Optimiser steps of the training loop so far, counting those before restarts."""
    return current_job().global_step


class JobScalars:
    """Writes the job's replicas, restarts, throughput, goodput and global step.

    Samples per second are measured between two calls of `write` (the first call:
    since this process's job started), over all replicas and all loops.
    """

    def __init__(self, job: Job) -> None:
        self.job = job
        self._since = (job.started_at, job.samples_consumed)

    def write(self, writer: Any, global_step: int | None = None, tag_prefix: str = "") -> int:
        """Add the scalars at ``global_step`` (None: the job's `global_step`); return that step."""
        job = self.job
        step = job.global_step if global_step is None else global_step
        prefix = f"{tag_prefix}/" if tag_prefix and not tag_prefix.endswith("/") else tag_prefix
        now, samples = job.clock(), job.samples_consumed
        then, before = self._since
        self._since = (now, samples)
        writer.add_scalar(f"{prefix}Job/replicas", job.topology.num_replicas, step)
        writer.add_scalar(f"{prefix}Job/restarts", job.topology.num_restarts, step)
        writer.add_scalar(f"{prefix}Job/global_step", job.global_step, step)
        if now > then:
            rate = (samples - before) / (now - then)
            writer.add_scalar(f"{prefix}Job/samples_per_second", rate, step)
        goodput = job.goodput()
        if goodput is not None:
            writer.add_scalar(f"{prefix}Performance/goodput", goodput, step)
        return step
