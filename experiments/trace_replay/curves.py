"""The validation curves of a Pollux trace: per fixed batch size, the metric and the
optimiser steps at the end of every epoch of progress; the study's two targets.

`../shared/pollux/README.md` gives the format (``validation-BSZ.csv``: ``progress``,
``iteration``, ``metric``, ...) and each metric's direction. The targets are the
protocol's (`experiments/trace_replay/README.md`): the *common* target, the worst
metric any measured batch size reaches at the last published epoch, and the *initial*
target, the one the initial batch size reaches there.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import attrs
import numpy as np
import numpy.typing as npt

from adaptdl.sim.traces import TARGET_EPOCHS, TraceError, parse_float, parse_int, read_table

#: Applications whose metric is better when lower (error or loss figures); the others'
#: is better when higher.
LOWER_IS_BETTER = frozenset({"deepspeech2", "yolov3"})
#: The targets the protocol declares.
TARGETS = ("common", "initial")

_VALIDATION = re.compile(r"^validation-(\d+)\.csv$")


@attrs.frozen(eq=False)
class Curves:
    """One application's measured curves, over its published epochs.

    ``batch_sizes`` (increasing; the first is the initial size); ``metric`` and
    ``iterations`` have one row per batch size and one column per epoch: the
    validation metric and the cumulative optimiser steps at the end of that epoch.
    """

    name: str
    batch_sizes: tuple[int, ...]
    metric: npt.NDArray[np.float64]
    iterations: npt.NDArray[np.int64]
    lower_is_better: bool

    @property
    def epochs(self) -> int:
        """Published epochs of progress."""
        return int(self.metric.shape[1])

    def meets(self, value: float, target: float) -> bool:
        """Whether a metric ``value`` meets ``target`` in the metric's direction."""
        return value <= target if self.lower_is_better else value >= target

    def target(self, kind: str) -> float:
        """The protocol's target ``kind`` ("common" or "initial")."""
        final = self.metric[:, -1]
        if kind == "common":
            return float(final.max() if self.lower_is_better else final.min())
        if kind == "initial":
            return float(final[0])
        raise ValueError(f"target kind must be one of {TARGETS}, got {kind!r}")

    def first_epoch(self, metrics: npt.ArrayLike, target: float) -> int | None:
        """The first epoch (0-based) whose metric in ``metrics`` meets ``target``."""
        for epoch, value in enumerate(np.asarray(metrics, dtype=np.float64)):
            if self.meets(float(value), target):
                return epoch
        return None

    def metric_at(self, batch_size: float, epoch: int) -> float:
        """The metric at the end of ``epoch`` of a run at total ``batch_size``: the
        measured one, linear in log2(batch size) between the two measured sizes around
        it, the nearest measured size's outside them."""
        if not 0 <= epoch < self.epochs:
            raise ValueError(f"epoch must be in [0, {self.epochs}), got {epoch}")
        if not (math.isfinite(batch_size) and batch_size >= 1):
            raise ValueError(f"batch_size must be a finite number >= 1, got {batch_size!r}")
        sizes = np.log2(np.asarray(self.batch_sizes, dtype=np.float64))
        return float(np.interp(math.log2(batch_size), sizes, self.metric[:, epoch]))


def read_curves(folder: Path | str, *, epochs: int | None = None) -> Curves:
    """The curves of the application in trace ``folder`` over ``epochs`` (default: its
    published count), each file's errors raised as `TraceError` naming file and line."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TraceError(folder, None, "trace folder not found")
    name = folder.name
    files = sorted(
        (int(m.group(1)), p) for p in folder.iterdir() if (m := _VALIDATION.match(p.name))
    )
    if not files:
        raise TraceError(folder, None, "no validation-<bsz>.csv files")
    count = epochs if epochs is not None else TARGET_EPOCHS.get(name)
    metric: list[list[float]] = []
    iterations: list[list[int]] = []
    for _bsz, path in files:
        rows = read_table(path, ("iteration", "metric"))
        need = count if count is not None else len(rows)
        if len(rows) < need:
            raise TraceError(path, None, f"{len(rows)} epochs measured, {name} needs {need}")
        metric.append(
            [parse_float(path, ln, "metric", r["metric"], min=-math.inf) for ln, r in rows[:need]]
        )
        iterations.append(
            [parse_int(path, ln, "iteration", r["iteration"]) for ln, r in rows[:need]]
        )
    width = min(len(m) for m in metric)
    return Curves(
        name,
        tuple(b for b, _ in files),
        np.array([m[:width] for m in metric], dtype=np.float64),
        np.array([i[:width] for i in iterations], dtype=np.int64),
        name in LOWER_IS_BETTER,
    )
