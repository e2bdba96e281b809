"""The epoch counter and AdaptDL's replay semantics for epoch loops.

After a restart the training program runs again from the top. Epochs that had
finished before the restart are skipped; the epoch that was interrupted runs
again, and the loaders inside it resume where they stopped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from adaptdl.core.persist.checkpoint import JsonState
from adaptdl.core.validate import check_int


class EpochState(JsonState):
    """How many epochs finished, and which one is running (None between loops)."""

    def __init__(self, name: str = "adaptdl-epoch") -> None:
        self.name = name
        self.finished_epochs = 0
        self.current_epoch: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"finished_epochs": self.finished_epochs}

    def load_json(self, data: dict[str, Any]) -> None:
        self.finished_epochs = check_int("finished_epochs", data["finished_epochs"], min=0)

    def settle_framework_count(self, framework_epoch: int, *, restored: bool) -> None:
        """Decide whose count of finished epochs wins when a framework's trainer
        (Lightning) also counts them, as it starts its epoch loop at
        ``framework_epoch`` (the epochs it counts as finished).

        Where the job restored a checkpoint of its own (``restored``), its count wins:
        that checkpoint holds the framework's state too, so the framework can only
        count as many, or more where it finished an epoch's evaluation after the
        job's loop had ended (the job's loop then catches up, `advances_to`); fewer is
        a RuntimeError (the two disagree). Otherwise (a fresh job, or one the
        framework resumed from its own checkpoint) the framework's count wins.
        Outside any epoch loop only (RuntimeError), ``framework_epoch >= 0``.
        """
        check_int("framework_epoch", framework_epoch, min=0)
        if self.current_epoch is not None:
            raise RuntimeError(
                f"the epoch count is settled before the epoch loop, not inside the loop of "
                f"epoch {self.current_epoch}"
            )
        if not restored:
            self.finished_epochs = framework_epoch
        elif self.finished_epochs > framework_epoch:
            raise _disagree(framework_epoch, self.finished_epochs)

    def advances_to(self, framework_epoch: int) -> bool:
        """Whether the epoch loop must move on (take its next epoch) for the epoch it
        runs to be the framework's ``framework_epoch``; False once it is.

        A framework may finish an epoch without iterating the job's loader (it resumed
        in that epoch's evaluation, after the loop had ended): the job's loop then
        catches up through it. RuntimeError where the loop's next epoch is past
        ``framework_epoch`` (the two disagree).
        """
        check_int("framework_epoch", framework_epoch, min=0)
        current = self.current_epoch
        if current == framework_epoch:
            return False
        upcoming = self.finished_epochs if current is None else current + 1
        if upcoming > framework_epoch:
            raise _disagree(framework_epoch, upcoming)
        return True

    def remaining_epochs_until(self, epoch: int) -> Iterator[int]:
        """Yield the epochs from the first unfinished one up to ``epoch`` (exclusive).

        Raises RuntimeError when called inside another epoch loop, and ValueError
        for a negative or non-integer ``epoch``.
        """
        check_int("epoch", epoch, min=0)
        if self.current_epoch is not None:
            raise RuntimeError(
                f"remaining_epochs_until({epoch}) called inside the loop of epoch "
                f"{self.current_epoch}: epoch loops cannot be nested"
            )
        return self._loop(epoch)

    def _loop(self, epoch: int) -> Iterator[int]:
        try:
            for current in range(self.finished_epochs, epoch):
                self.current_epoch = current
                yield current
                self.finished_epochs = current + 1
        finally:
            self.current_epoch = None


def _disagree(framework_epoch: int, upcoming: int) -> RuntimeError:
    return RuntimeError(
        f"the framework's trainer (Lightning) runs epoch {framework_epoch} but the AdaptDL "
        f"job's next epoch is {upcoming}: the trainer's state and the AdaptDL checkpoint "
        "disagree (was the checkpoint directory shared with another job?)"
    )
