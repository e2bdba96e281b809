"""``Accumulator``: replay-safe metric sums across replicas and restarts, on the default job.

The semantics are core's `adaptdl.core.accumulator.Accumulator`: add contributions
anywhere (``acc["loss"] += loss.item()``), read the sums of all replicas inside
``with acc.synchronized():``. After a restart, the synchronised totals the program
saw before are replayed, so a metric is never counted twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adaptdl.core import accumulator as core
from adaptdl.core.job import Job
from adaptdl.torch._context import current_job

__all__ = ["Accumulator"]


def _position(job: Job) -> core.ReplayPosition:
    return core.ReplayPosition(
        epoch=job.epoch.current_epoch, in_loop=job.current_loader is not None
    )


class Accumulator(core.Accumulator):
    """A dict of metric sums over all replicas, checkpointed with the job.

    Takes the initial totals like ``dict(*args, **kwargs)``. Every replica must
    create its accumulators in the same order (their checkpoint names follow it).
    """

    def __init__(self, *args: Mapping[str, Any], **kwargs: Any) -> None:
        job = current_job()
        super().__init__(
            job.collective,
            name=job.unique_name("adaptdl-accumulator"),
            initial=dict(*args, **kwargs),
            position=lambda: _position(job),
        )
        job.register(self)
