"""What ends or interrupts a step: the agreed boundary value, when to checkpoint, the exit.

`Job.step_boundary` returns a `Boundary` every replica agreed; an `AgreementCadence`
says at which boundaries the replicas exchange their flags; a `CheckpointPolicy`
says when a periodic checkpoint is due; a stop ends the process with `Preempted`,
whose exit status tells a scheduler why (143 after SIGTERM, 130 after SIGINT).
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from adaptdl.core.config import JobConfig
from adaptdl.core.validate import check_float, check_int

__all__ = [
    "EXIT_CODE_INTERRUPTED",
    "EXIT_CODE_PREEMPTED",
    "AgreementCadence",
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
        (`Job.step_boundary` reduces them, with its proposed cadence, as integers by
        their ``maximum``)."""
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


@attrs.frozen
class AgreementCadence:
    """How often the replicas agree on their boundary flags: every ``k``-th step boundary.

    An agreement is one small reduction; on a fast step its fixed cost is a visible
    share of the step (a 2-replica gloo job on CPU: about 1 ms of CPU in all, 0.3 ms
    of it on the training thread, 1.5% of a 60 ms step). Between agreements a
    boundary costs a clock read. `every` picks ``k`` so that agreeing costs at most
    ``share`` of the step time (``cost`` seconds per agreement), never more than
    ``max_every`` boundaries apart and never more than ``max_latency`` seconds of
    steps apart: a stop then waits for at most two agreements (the reduction started
    at one is read at the next). Rank 0 proposes ``k`` from its own step times and
    the replicas adopt the agreed one, so every replica agrees at the same boundaries
    (a proposal is adopted one agreement later: steps that turn slow wait at most two
    spaced-out intervals before every boundary agrees again).
    ``max_every=1`` agrees at every boundary.
    """

    cost: float = attrs.field(default=1e-3)
    share: float = attrs.field(default=0.0025)
    max_latency: float = attrs.field(default=0.5)
    max_every: int = attrs.field(default=16)

    @cost.validator
    def _check_cost(self, attribute: attrs.Attribute[float], value: Any) -> None:
        check_float("cost", value, min=0.0)

    @share.validator
    def _check_share(self, attribute: attrs.Attribute[float], value: Any) -> None:
        check_float("share", value, min=0.0, max=1.0, min_exclusive=True)

    @max_latency.validator
    def _check_latency(self, attribute: attrs.Attribute[float], value: Any) -> None:
        check_float("max_latency", value, min=0.0)

    @max_every.validator
    def _check_every(self, attribute: attrs.Attribute[int], value: Any) -> None:
        check_int("max_every", value, min=1)

    def every(self, step_time: float) -> int:
        """Boundaries from one agreement to the next for steps of ``step_time`` seconds
        (1 when the step time is unknown, 0 or less)."""
        if not step_time > 0.0 or not math.isfinite(step_time):
            return 1
        wanted = math.ceil(self.cost / (self.share * step_time))
        cap = min(self.max_every, math.floor(self.max_latency / step_time))
        return max(1, min(wanted, cap))
