"""The seed's epoch loop: ``for epoch in remaining_epochs_until(N):`` replays after restarts.

After a restart the program runs from the top again; finished epochs are skipped
and the interrupted one runs again, its loaders resuming where they stopped. The
state machine is core's `EpochState`.
"""

from __future__ import annotations

from collections.abc import Iterator

from adaptdl.core.job import Job
from adaptdl.torch._context import current_job

__all__ = ["current_epoch", "finished_epochs", "remaining_epochs_until"]


def remaining_epochs_until(epoch: int) -> Iterator[int]:
    """Yield the epochs from the first unfinished one up to ``epoch`` (exclusive).

    Raises ValueError for a negative or non-integer ``epoch`` and RuntimeError when
    called inside another epoch loop.
    """
    job = current_job()
    return _drained(job, job.epoch.remaining_epochs_until(epoch))


def _drained(job: Job, epochs: Iterator[int]) -> Iterator[int]:
    yield from epochs
    # A normal end on every replica: nothing of the collective may stay in flight.
    job.drain()


def current_epoch() -> int | None:
    """The epoch being run, or None outside ``remaining_epochs_until``."""
    return current_job().epoch.current_epoch


def finished_epochs() -> int:
    """How many epochs have finished, counting those before restarts."""
    return current_job().epoch.finished_epochs
