"""The job's own counters that survive restarts, and the replays the journal reveals."""

from __future__ import annotations

import logging
from typing import Any

from adaptdl.core.persist.checkpoint import JsonState
from adaptdl.core.persist.journal import Mark
from adaptdl.core.validate import check_bool, check_int

__all__ = ["JobState"]

LOG = logging.getLogger("adaptdl.core.job")


class JobState(JsonState):
    """Job-wide counters that survive restarts."""

    def __init__(self, name: str = "adaptdl-job") -> None:
        self.name = name
        self.samples_consumed = 0  # by all replicas in all loops, at step boundaries
        self.replayed_samples = 0  # consumed again after crashes (see journal.py)
        # Whether the checkpoint was taken inside a dataloader loop: then a restart
        # replays the program up to that loop's resumption (see `Job.replaying`).
        self.in_loop = True
        self.steps = 0  # optimiser steps of the training loop, across restarts

    def to_json(self) -> dict[str, Any]:
        return {
            "samples_consumed": self.samples_consumed,
            "replayed_samples": self.replayed_samples,
            "in_loop": self.in_loop,
            "steps": self.steps,
        }

    def load_json(self, data: dict[str, Any]) -> None:
        self.samples_consumed = check_int("samples_consumed", data["samples_consumed"], min=0)
        self.replayed_samples = check_int("replayed_samples", data["replayed_samples"], min=0)
        # Absent from checkpoints written before it was recorded, all taken in loops.
        self.in_loop = check_bool("in_loop", data.get("in_loop", True))
        # Absent from checkpoints written before it was recorded.
        self.steps = check_int("steps", data.get("steps", 0), min=0)

    def count_replay(self, mark: Mark, *, fresh: bool, resumed: str | None) -> None:
        """Add the samples the journal's ``mark`` shows were taken after the restored
        checkpoint (``resumed``; ``fresh``: none) by a run that then died."""
        if fresh and mark.checkpoint > 0:
            # Its run had checkpoints and none is left (removed to start afresh): the
            # journal describes another history; counting it would invent replays.
            LOG.info("fresh start: ignoring a journal left by a run whose checkpoints are gone")
            return
        # The journal's replays include those counted by runs that died before
        # writing a checkpoint; the checkpoint's never exceed them.
        counted = max(self.replayed_samples, mark.replayed)
        replayed = max(0, mark.samples - self.samples_consumed)
        self.replayed_samples = counted + replayed
        if replayed:
            LOG.warning(
                "resuming from checkpoint %s: the %d samples taken after it, before the "
                "previous run died, are consumed again (%d replayed in all)",
                resumed,
                replayed,
                self.replayed_samples,
            )
