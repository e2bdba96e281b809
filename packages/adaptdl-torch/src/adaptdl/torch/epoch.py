"""The seed's epoch loop: ``for epoch in remaining_epochs_until(N):`` replays after restarts.

After a restart the program runs from the top again; finished epochs are skipped
and the interrupted one runs again, its loaders resuming where they stopped. The
state machine is core's `EpochState`, driven by the job.
"""

from __future__ import annotations

from collections.abc import Iterator

from adaptdl.torch._context import current_job

__all__ = ["current_epoch", "finished_epochs", "remaining_epochs_until"]


def remaining_epochs_until(epoch: int) -> Iterator[int]:
    """Yield the epochs from the first unfinished one up to ``epoch`` (exclusive).

    Once the last epoch finished, a final checkpoint is written (see
    `adaptdl.core.job.Job.remaining_epochs_until`): a relaunch of the finished job
    yields no epoch and goes on with what the program does after the loop.
    Raises ValueError for a negative or non-integer ``epoch`` and RuntimeError when
    called inside another epoch loop.
    """
    return current_job().remaining_epochs_until(epoch)


def current_epoch() -> int | None:
    """The epoch being run, or None outside ``remaining_epochs_until``."""
    return current_job().epoch.current_epoch


def finished_epochs() -> int:
    """How many epochs have finished, counting those before restarts."""
    return current_job().epoch.finished_epochs
