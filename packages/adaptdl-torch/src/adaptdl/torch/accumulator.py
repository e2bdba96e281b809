"""``Accumulator``: replay-safe metric sums across replicas and restarts, on the default job.

The semantics are core's `adaptdl.core.stats.accumulator.Accumulator`: add contributions
anywhere (``acc["loss"] += loss.item()``, ``acc += {"loss": ..., "n": ...}``), read
the sums of all replicas inside ``with acc.synchronized():`` (outside, it reads as
an empty mapping). After a restart, the synchronised totals the program saw before
are replayed, and contributions re-made while the program replays code that ran
before the checkpoint are dropped, so a metric is never counted twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adaptdl.core.job import Job
from adaptdl.core.stats import accumulator as core
from adaptdl.torch._context import current_job

__all__ = ["Accumulator"]


def _position(job: Job) -> core.ReplayPosition:
    return core.ReplayPosition(
        epoch=job.epoch.current_epoch,
        in_loop=job.current_loader is not None,
        replaying=job.replaying,
    )


class Accumulator(core.Accumulator):
    """A dict of metric sums over all replicas, checkpointed with the job.

    Takes the initial totals like ``dict(*args, **kwargs)``. Accumulators are named
    by the epoch they are made in and their order within it (the seed's rule), so
    every replica must make them in the same order, and one made inside an epoch
    (a per-epoch validation accumulator) starts afresh in every epoch, after a
    restart too; it leaves the checkpoints once its epoch has finished.

    Raises RuntimeError when made inside a dataloader loop: loop iterations before
    a checkpoint never run again, so its name could not be replayed.
    """

    def __init__(self, *args: Mapping[str, Any], **kwargs: Any) -> None:
        job = current_job()
        if job.current_loader is not None:
            raise RuntimeError(
                "an Accumulator cannot be made inside a dataloader loop: make it before the "
                "loop (inside the epoch loop for per-epoch totals)"
            )
        epoch = job.epoch.current_epoch
        # Outside epoch loops the names are those of earlier versions (their checkpoints).
        prefix = "adaptdl-accumulator" if epoch is None else f"adaptdl-accumulator-epoch{epoch}"
        super().__init__(
            job.collective,
            name=job.unique_name(prefix),
            initial=dict(*args, **kwargs),
            position=lambda: _position(job),
        )
        # One the checkpoint lacks was made after it: it starts empty, as it did then.
        job.register(self, epoch=epoch, allow_missing=True)
