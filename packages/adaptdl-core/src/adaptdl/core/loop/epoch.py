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
