"""The training loss's drift over progress, and what it sheds over a horizon (EXPERIMENTAL).

Part of the loss floor (`adaptdl.core.stats.floor`), an experimental, optional component.

Without a stated target, the floor's share (`adaptdl.core.stats.floor`) needs the loss a
run will shed from here. `DriftHistory` keeps the drift (the training loss less the
floor its batch keeps) at points spaced geometrically in progress, and reads at
progress ``p`` the drift shed since ``p / HORIZON``, which the share takes as the
drift the run sheds again by ``p * HORIZON``: exact for a loss that falls by the same
amount per doubling of progress (log-linear), an overestimate for one flattening
faster (then the credit is the smaller). A drift that rose says nothing of what the
run sheds next (a rate warming up, a loss diverging, a floor that fell with a larger
batch before the loss did); the floor's share reads how far it moved instead, so
that a large rise gets little credit and a flat drift, however noisy, the most.

``HORIZON`` is 2: with nothing known of a run's length, a length scale-free in
progress makes the elapsed progress as likely any fraction of the whole, and the
median of what remains then equals what has passed.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from adaptdl.core.validate import check_float

#: How far the horizon looks ahead, as a factor of the progress made (and back).
HORIZON = 2.0

#: Points kept per factor of 2 in progress: the drift read back is interpolated in
#: log-progress between two of them.
POINTS_PER_DOUBLING = 8

_SPACING = 2.0 ** (1.0 / POINTS_PER_DOUBLING)


def _points(value: Any) -> tuple[tuple[float, float], ...]:
    """``value`` as (progress, drift) pairs, progress > 0 and increasing, or ValueError."""
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise ValueError(f"points must be a list of [progress, drift] pairs, got {value!r}")
    points: list[tuple[float, float]] = []
    for pair in value:
        if isinstance(pair, str | bytes) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise ValueError(f"points must hold [progress, drift] pairs, got {pair!r}")
        p = check_float("progress", pair[0], min=0.0, min_exclusive=True)
        d = check_float("drift", pair[1])
        if points and p <= points[-1][0]:
            raise ValueError(f"points' progress must increase, got {p} after {points[-1][0]}")
        points.append((p, d))
    return tuple(points)


@attrs.define(eq=False)
class DriftHistory:
    """The drift at points spaced ``2 ** (1 / POINTS_PER_DOUBLING)`` apart in progress,
    back to the last one at or below ``progress / HORIZON`` (so at most about
    ``POINTS_PER_DOUBLING * log2(HORIZON) + 2`` of them)."""

    points: tuple[tuple[float, float], ...] = attrs.field(default=(), converter=_points)

    def record(self, progress: float, drift: float) -> None:
        """Keep ``drift`` at ``progress`` (> 0) where it is far enough from the last
        point kept, and forget the points the horizon no longer reaches back to.
        A progress below the last point's (a job restored from an older state)
        forgets the points past it first."""
        progress = check_float("progress", progress, min=0.0, min_exclusive=True)
        drift = check_float("drift", drift)
        if self.points and self.points[-1][0] <= progress < self.points[-1][0] * _SPACING:
            return  # the common step: too close to the last point, nothing to forget
        points = [pt for pt in self.points if pt[0] < progress]
        if not points or progress >= points[-1][0] * _SPACING:
            points.append((progress, drift))
        back = progress / HORIZON
        while len(points) >= 2 and points[1][0] <= back:
            points.pop(0)
        self.points = tuple(points)

    def shed(self, progress: float, drift: float) -> float | None:
        """The drift shed from ``progress / HORIZON`` to ``progress`` (where it is
        ``drift``), negative where it rose; None while the points do not reach back
        that far. The drift back there is interpolated linearly in log-progress."""
        progress = check_float("progress", progress, min=0.0, min_exclusive=True)
        drift = check_float("drift", drift)
        back = progress / HORIZON
        points = [pt for pt in self.points if pt[0] < progress] + [(progress, drift)]
        if back < points[0][0]:
            return None
        for (p0, d0), (p1, d1) in itertools.pairwise(points):
            if p0 <= back <= p1:
                t = math.log(back / p0) / math.log(p1 / p0)
                return d0 + t * (d1 - d0) - drift
        return None  # unreachable: back lies in [points[0], progress]

    def to_json(self) -> list[list[float]]:
        """The points as JSON-ready data."""
        return [[p, d] for p, d in self.points]

    @classmethod
    def from_json(cls, data: Any) -> DriftHistory:
        """Rebuild from `to_json`'s output; ValueError on any other shape."""
        return cls(points=data)
