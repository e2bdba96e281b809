"""The discrete-event clock: a heap of events at exact times.

Events at the same instant are handled in a fixed order (completions and epoch
boundaries before restarts, failures, arrivals and then the scheduling round, so that
a round sees everything that happened at its instant), then in the order they were
pushed. Nothing here is random: the simulation is deterministic for a given seed
because every random draw comes from the one ``numpy.random.Generator`` it owns.
"""

from __future__ import annotations

import enum
import heapq
import math

import attrs


class EventKind(enum.IntEnum):
    """What happens at an event; the value orders events at the same instant."""

    COMPLETION = 0
    EPOCH = 1
    RESTART_DONE = 2
    REPAIR = 3
    FAILURE = 4
    ARRIVAL = 5
    SCHEDULE = 6


@attrs.frozen(order=True)
class Event:
    """One event: ``job`` names the job it concerns (or a node for failures).

    ``version`` lets the owner of a job ignore events scheduled before the job's rate
    last changed (they are left in the heap rather than removed).
    """

    time: float
    kind: EventKind
    seq: int
    job: str = attrs.field(default="", order=False)
    version: int = attrs.field(default=0, order=False)
    node: int = attrs.field(default=-1, order=False)


class EventQueue:
    """A priority queue of :class:`Event` ordered by (time, kind, insertion order)."""

    def __init__(self) -> None:
        self._heap: list[Event] = []
        self._seq = 0

    def push(
        self, time: float, kind: EventKind, job: str = "", version: int = 0, node: int = -1
    ) -> Event:
        """Schedule an event at ``time`` (a finite number of seconds)."""
        if not math.isfinite(time):
            raise ValueError(f"event time must be finite, got {time!r} for {kind.name}")
        event = Event(time, kind, self._seq, job, version, node)
        self._seq += 1
        heapq.heappush(self._heap, event)
        return event

    def pop(self) -> Event:
        """Remove and return the earliest event."""
        return heapq.heappop(self._heap)

    def peek_time(self) -> float:
        """Time of the earliest event, or infinity when empty."""
        return self._heap[0].time if self._heap else math.inf

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)
