"""Application models read from measured traces in the Pollux layout.

A trace folder ``DIR/APP/`` holds ``placements.csv`` and ``scalability.csv`` (step and
sync time by placement or spread, and local batch size) and one ``validation-BSZ.csv``
per total batch size (progress and gradient statistics per epoch). See
``shared/pollux/README.md`` for the formats. Every parsing error raises
:class:`TraceError` naming the file and line.
"""

from __future__ import annotations

import csv
import math
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np

from adaptdl.sim.apps import (
    ApplicationModel,
    FloatArray,
    Placement,
    normalize_placement,
    stats_by_batch_size,
)

#: Epochs of scale-invariant progress each application trains for (the published study).
TARGET_EPOCHS: dict[str, int] = {
    "bert": 2,
    "cifar10": 100,
    "ncf": 10,
    "imagenet": 90,
    "deepspeech2": 80,
    "yolov3": 50,
}
#: Per-GPU local batch size limits that override the measured range.
MAX_LOCAL_BSZ: dict[str, int] = {"yolov3": 8}

_Number = TypeVar("_Number", int, float)

_VALIDATION = re.compile(r"^validation-(\d+)\.csv$")


class TraceError(ValueError):
    """A trace or workload file that cannot be used; the message names file and line."""

    def __init__(self, path: Path | str, line: int | None, message: str) -> None:
        where = f"{path}:{line}" if line is not None else f"{path}"
        super().__init__(f"{where}: {message}")
        self.path = str(path)
        self.line = line


def read_table(path: Path, columns: Sequence[str]) -> list[tuple[int, dict[str, str]]]:
    """Read a CSV file with at least ``columns``; return (line number, row) pairs."""
    if not path.is_file():
        raise TraceError(path, None, "file not found")
    with path.open(newline="") as f:
        reader = csv.reader(f)
        try:
            header = next(reader)
        except StopIteration:
            raise TraceError(path, 1, "empty file, expected a header row") from None
        header = [h.strip() for h in header]
        missing = [c for c in columns if c not in header]
        if missing:
            raise TraceError(path, 1, f"missing column(s) {missing}; header has {header}")
        index = {c: header.index(c) for c in columns}
        rows = []
        for lineno, raw in enumerate(reader, start=2):
            if not raw or all(not cell.strip() for cell in raw):
                continue
            if len(raw) < len(header):
                raise TraceError(
                    path, lineno, f"expected {len(header)} fields, got {len(raw)}: {raw}"
                )
            rows.append((lineno, {c: raw[i].strip() for c, i in index.items()}))
    if not rows:
        raise TraceError(path, None, "no data rows")
    return rows


def parse_float(path: Path, line: int, column: str, text: str, *, min: float = 0.0) -> float:
    """Parse a finite number >= ``min`` or raise naming file, line and column."""
    return _parse(float, "number", path, line, column, text, min)


def parse_int(path: Path, line: int, column: str, text: str, *, min: int = 0) -> int:
    """Parse an integer >= ``min`` or raise naming file, line and column."""
    return _parse(int, "integer", path, line, column, text, min)


def _parse(
    kind: Callable[[str], _Number],
    what: str,
    path: Path,
    line: int,
    column: str,
    text: str,
    min: float,
) -> _Number:
    try:
        value = kind(text)
    except ValueError:
        raise TraceError(path, line, f"column {column!r}: bad {what} {text!r}") from None
    if not math.isfinite(value) or value < min:
        expected = f"a finite number >= {min}" if kind is float else f">= {min}"
        raise TraceError(path, line, f"column {column!r}: expected {expected}, got {text!r}")
    return value


class _Curve:
    """Step and sync time against local batch size, linear in between and beyond."""

    __slots__ = ("bsz", "step", "sync")

    def __init__(self, points: dict[int, list[tuple[float, float]]]) -> None:
        keys = sorted(points)
        self.bsz = np.array(keys, dtype=np.float64)
        self.step = np.array([np.mean([p[0] for p in points[k]]) for k in keys])
        self.sync = np.array([np.mean([p[1] for p in points[k]]) for k in keys])

    def at(self, local_bsz: float) -> tuple[float, float]:
        x = float(local_bsz)
        if x > self.bsz[-1]:
            # Beyond the largest measurement: synchronisation stays, compute grows in
            # proportion to the batch (end segments of noisy data can slope down).
            step, sync = float(self.step[-1]), float(self.sync[-1])
            compute = max(step - sync, 0.0)
            return sync + compute * x / float(self.bsz[-1]), sync
        return _lerp(self.bsz, self.step, x), _lerp(self.bsz, self.sync, x)


def _lerp(xs: FloatArray, ys: FloatArray, x: float) -> float:
    """Piecewise-linear interpolation, extrapolated below the first point."""
    if len(xs) == 1 or x >= xs[0]:
        return float(np.interp(x, xs, ys))
    slope = (ys[1] - ys[0]) / (xs[1] - xs[0])
    # Extrapolation never drops below half of the smallest measurement.
    return max(float(ys[0] + slope * (x - xs[0])), 0.5 * float(ys[0]))


class TraceApplication(ApplicationModel):
    """An application model read from a Pollux trace folder."""

    def __init__(self, folder: Path | str, *, num_epochs: int | None = None) -> None:
        folder = Path(folder)
        self.folder = folder
        self.name = folder.name
        if not folder.is_dir():
            raise TraceError(folder, None, "trace folder not found")
        self._placements = self._read_placements(folder / "placements.csv")
        self._spreads = self._read_scalability(folder / "scalability.csv")
        self._add_placement_spreads()
        self._read_validation(folder, num_epochs)
        lo = int(min(c.bsz[0] for c in self._placements.values()))
        hi = int(max(c.bsz[-1] for c in self._placements.values()))
        hi = min(hi, MAX_LOCAL_BSZ.get(self.name, hi))
        self.local_bsz_bounds = (max(1, min(lo, hi)), hi)
        self._cache: dict[Placement, _Curve] = {}

    # -- parsing -------------------------------------------------------------

    @staticmethod
    def _read_placements(path: Path) -> dict[Placement, _Curve]:
        rows = read_table(path, ("placement", "local_bsz", "step_time", "sync_time"))
        points: dict[Placement, dict[int, list[tuple[float, float]]]] = defaultdict(
            lambda: defaultdict(list)
        )
        for line, row in rows:
            text = row["placement"]
            if not text.isdigit() or "0" in text:
                raise TraceError(
                    path, line, f"column 'placement': expected digits 1-9, got {text!r}"
                )
            key = normalize_placement([int(ch) for ch in text])
            bsz = parse_int(path, line, "local_bsz", row["local_bsz"], min=1)
            step = parse_float(path, line, "step_time", row["step_time"])
            sync = parse_float(path, line, "sync_time", row["sync_time"])
            points[key][bsz].append((step, sync))
        return {k: _Curve(v) for k, v in points.items()}

    @staticmethod
    def _read_scalability(path: Path) -> dict[tuple[int, int], _Curve]:
        cols = ("num_nodes", "num_replicas", "local_bsz", "step_time", "sync_time")
        points: dict[tuple[int, int], dict[int, list[tuple[float, float]]]] = defaultdict(
            lambda: defaultdict(list)
        )
        for line, row in read_table(path, cols):
            nodes = parse_int(path, line, "num_nodes", row["num_nodes"], min=1)
            replicas = parse_int(path, line, "num_replicas", row["num_replicas"], min=nodes)
            bsz = parse_int(path, line, "local_bsz", row["local_bsz"], min=1)
            step = parse_float(path, line, "step_time", row["step_time"])
            sync = parse_float(path, line, "sync_time", row["sync_time"])
            points[(nodes, replicas)][bsz].append((step, sync))
        return {k: _Curve(v) for k, v in points.items()}

    def _add_placement_spreads(self) -> None:
        # Spreads the scalability table lacks are filled from the placements table,
        # averaged over the placements with that many nodes and replicas.
        grouped: dict[tuple[int, int], list[_Curve]] = defaultdict(list)
        for key, curve in self._placements.items():
            grouped[(len(key), sum(key))].append(curve)
        for spread, curves in grouped.items():
            if spread in self._spreads:
                continue
            pts: dict[int, list[tuple[float, float]]] = defaultdict(list)
            for c in curves:
                for b, s, y in zip(c.bsz, c.step, c.sync, strict=True):
                    pts[int(b)].append((float(s), float(y)))
            self._spreads[spread] = _Curve(pts)
        self._by_nodes: dict[int, list[int]] = defaultdict(list)
        for nodes, replicas in sorted(self._spreads):
            self._by_nodes[nodes].append(replicas)

    def _read_validation(self, folder: Path, num_epochs: int | None) -> None:
        files = sorted(
            (int(m.group(1)), p)
            for p in folder.iterdir()
            if (m := _VALIDATION.match(p.name)) is not None
        )
        if not files:
            raise TraceError(folder, None, "no validation-<bsz>.csv files")
        if num_epochs is None:
            num_epochs = TARGET_EPOCHS.get(self.name)
        progress: list[FloatArray] = []
        sqr: list[FloatArray] = []
        var: list[FloatArray] = []
        for _bsz, path in files:
            rows = read_table(path, ("progress", "grad_sqr", "grad_var"))
            progress.append(
                np.array([parse_float(path, ln, "progress", r["progress"]) for ln, r in rows])
            )
            sqr.append(
                np.array([parse_float(path, ln, "grad_sqr", r["grad_sqr"]) for ln, r in rows])
            )
            var.append(
                np.array([parse_float(path, ln, "grad_var", r["grad_var"]) for ln, r in rows])
            )
            need = num_epochs if num_epochs is not None else len(rows)
            if len(rows) < need:
                raise TraceError(
                    path, None, f"{len(rows)} epochs measured, {self.name} trains for {need}"
                )
        epochs = num_epochs if num_epochs is not None else min(len(p) for p in progress)
        self.batch_sizes = np.array([b for b, _ in files], dtype=np.float64)
        self.init_batch_size = int(self.batch_sizes[0])
        self.max_batch_size = int(self.batch_sizes[-1])
        self._sqr = np.stack([s[:epochs] for s in sqr])  # (batch sizes, epochs)
        self._var = np.stack([v[:epochs] for v in var])
        self.epoch_progress = np.min(np.stack([p[:epochs] for p in progress]), axis=0)
        # Steps of one epoch at the initial batch size, times that batch size.
        self.dataset_size = round(float(self.epoch_progress[0]) * self.init_batch_size)

    # -- model ---------------------------------------------------------------

    def step_time(self, placement: Sequence[int], local_bsz: float) -> tuple[float, float]:
        key = normalize_placement(placement)
        curve = self._cache.get(key)
        if curve is None:
            curve = self._placements.get(key) or self._spread_curve(len(key), sum(key))
            self._cache[key] = curve
        return curve.at(float(local_bsz))

    def _spread_curve(self, nodes: int, replicas: int) -> _Curve:
        if (nodes, replicas) in self._spreads:
            return self._spreads[(nodes, replicas)]
        known = sorted(self._by_nodes)
        per_node = replicas / nodes
        lo = max((n for n in known if n <= nodes), default=known[0])
        hi = min((n for n in known if n >= nodes), default=known[-1])
        curve_lo = self._at_nodes(lo, per_node * lo)
        if hi == lo:
            return curve_lo
        curve_hi = self._at_nodes(hi, per_node * hi)
        w = (nodes - lo) / (hi - lo)
        return _blend(curve_lo, curve_hi, w)

    def _at_nodes(self, nodes: int, replicas: float) -> _Curve:
        counts = self._by_nodes[nodes]
        lo = max((r for r in counts if r <= replicas), default=counts[0])
        hi = min((r for r in counts if r >= replicas), default=counts[-1])
        a, b = self._spreads[(nodes, lo)], self._spreads[(nodes, hi)]
        if hi == lo:
            return a
        return _blend(a, b, (replicas - lo) / (hi - lo))

    def grad_stats(self, batch_size: float, epoch: int) -> tuple[float, float]:
        return stats_by_batch_size(self.batch_sizes, self._sqr, self._var, batch_size, epoch)


def _blend(a: _Curve, b: _Curve, w: float) -> _Curve:
    grid = np.union1d(a.bsz, b.bsz)
    pts: dict[int, list[tuple[float, float]]] = {}
    for x in grid:
        sa, ya = a.at(float(x))
        sb, yb = b.at(float(x))
        pts[int(x)] = [((1 - w) * sa + w * sb, (1 - w) * ya + w * yb)]
    return _Curve(pts)


def load_traces(
    folder: Path | str, names: Sequence[str] | None = None
) -> dict[str, TraceApplication]:
    """Load every application under ``folder`` (or only ``names``), keyed by name."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TraceError(folder, None, "trace directory not found")
    available = sorted(p.name for p in folder.iterdir() if (p / "placements.csv").is_file())
    wanted = available if names is None else list(dict.fromkeys(names))
    for name in wanted:
        if name not in available:
            raise TraceError(
                folder, None, f"unknown application {name!r}; traces hold {available}"
            )
    return {name: TraceApplication(folder / name) for name in wanted}
