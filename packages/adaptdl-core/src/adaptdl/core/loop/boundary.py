"""What ends or interrupts a step: the agreed boundary value, when to checkpoint, the exit.

`Job.step_boundary` returns a `Boundary` every replica agreed; a `CheckpointPolicy`
says when a periodic checkpoint is due; a stop ends the process with `Preempted`,
whose exit status tells a scheduler why (143 after SIGTERM, 130 after SIGINT).
"""

from __future__ import annotations

from typing import Any

import attrs

from adaptdl.core.config import JobConfig
from adaptdl.core.validate import check_float, check_int

__all__ = [
    "EXIT_CODE_INTERRUPTED",
    "EXIT_CODE_PREEMPTED",
    "Boundary",
    "CheckpointPolicy",
    "Preempted",
]

EXIT_CODE_PREEMPTED = 143  # 128 + SIGTERM, what a scheduler expects of a stopped job
EXIT_CODE_INTERRUPTED = 130  # 128 + SIGINT, what a shell expects after Ctrl-C


class Preempted(SystemExit):
    """Raised after the job checkpointed because a stop was requested.

    Its exit status is ``code``: 143 (SIGTERM) unless the stop asked for another,
    such as 130 after SIGINT.
    """

    def __init__(self, code: int = EXIT_CODE_PREEMPTED) -> None:
        super().__init__(code)


@attrs.frozen
class CheckpointPolicy:
    """When to checkpoint besides a requested stop: every so many seconds or steps.

    Both None turns periodic checkpoints off. The default, every 10 minutes,
    bounds what a SIGKILL loses to 10 minutes of work at the cost of one state
    write per 10 minutes.
    """

    every_seconds: float | None = attrs.field(default=600.0)
    every_steps: int | None = attrs.field(default=None)

    @every_seconds.validator
    def _check_seconds(self, attribute: attrs.Attribute[float | None], value: Any) -> None:
        if value is not None:
            check_float("every_seconds", value, min=0.0, min_exclusive=True)

    @every_steps.validator
    def _check_steps(self, attribute: attrs.Attribute[int | None], value: Any) -> None:
        if value is not None:
            check_int("every_steps", value, min=1)

    @classmethod
    def from_config(cls, config: JobConfig) -> CheckpointPolicy:
        """The policy a job configuration asks for (``ADAPTDL_CHECKPOINT_INTERVAL`` and
        ``ADAPTDL_CHECKPOINT_STEPS``, read and checked by `JobConfig.from_env`)."""
        return cls(
            every_seconds=config.checkpoint_every_seconds,
            every_steps=config.checkpoint_every_steps,
        )

    def due(self, steps: int, seconds: float) -> bool:
        """Whether ``steps`` optimiser steps or ``seconds`` since the last checkpoint are due."""
        if self.every_steps is not None and steps >= self.every_steps:
            return True
        return self.every_seconds is not None and seconds >= self.every_seconds


@attrs.frozen
class Boundary:
    """What every replica agreed at one step boundary (see `Job.step_boundary`).

    ``stop``: checkpoint and exit; ``checkpoint``: write a periodic checkpoint and
    go on; ``redecide``: the training loop decides its batch size again. A value
    that `Job.step_boundary` returns never has ``stop``: it raised `Preempted`.
    """

    stop: bool = False
    checkpoint: bool = False
    redecide: bool = False

    @classmethod
    def from_wire(cls, flags: Any) -> Boundary:
        """The boundary of ``[stop, checkpoint, redecide]`` as a collective carries them
        (`Job.step_boundary` reduces the list with ``logical_or``)."""
        stop, checkpoint, redecide = flags
        return cls.of(bool(stop), bool(checkpoint), bool(redecide))

    @classmethod
    def of(cls, stop: bool, checkpoint: bool, redecide: bool) -> Boundary:
        """The boundary with these flags: one of eight values built once (a boundary
        follows every optimiser step, so none is built per step)."""
        if cls is Boundary:
            return _BOUNDARIES[stop, checkpoint, redecide]
        return cls(stop, checkpoint, redecide)


_BOUNDARIES = {
    (stop, checkpoint, redecide): Boundary(stop, checkpoint, redecide)
    for stop in (False, True)
    for checkpoint in (False, True)
    for redecide in (False, True)
}
