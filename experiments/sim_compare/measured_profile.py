"""What a real run of `experiments.harness.trainer` measured, read back as a simulator profile.

A run leaves one result JSON (``launch`` starts every run without a checkpoint path,
so no checkpoint survives it). From it:

* the throughput model: the ``PerfParams`` the job's profiler had fitted at the
  adaptive run's last batch-size decision (the result's ``decisions`` list, each
  entry a dict whose ``"perf"`` is ``PerfParams.to_dict()``; the last one is
  taken); or, for a result without them (a fixed run, a trainer that does not
  record them), the same core fit (`fit_perf_params`) of the step times the run
  recorded per optimiser step (``steps``, evaluation excluded);
* the gradient-noise statistics over progress: the estimator's |G|^2 and
  variance every few steps (the result's ``noise`` rows; its variance is one
  sample's, the model's is at the initial batch size: divided by it); or, without
  them, the ratio variance / |G|^2 that each step's recorded AdaScale gain implies
  at its scale (`ratio_from_gain`; steps at the initial batch size, whose gain is 1
  at any noise, say nothing).

Either fallback emits a `ProfileFallbackWarning` naming the run and what was used
instead.

Column layouts (the trainer's): ``steps`` rows are (progress, total batch, local
batch, accumulation steps, gain, lr factor, loss, goodput, training seconds);
``noise`` rows (progress, samples, sqr, var, estimate samples); ``evals`` rows
(progress, samples, training seconds, val. loss, val. metric, training CPU seconds).
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections import defaultdict
from typing import Any

import attrs
import numpy as np

from adaptdl.core.goodput import PerfParams, fit_perf_params
from adaptdl.sim.apps import FloatArray

STEP_PROGRESS, STEP_BATCH, STEP_LOCAL, STEP_ACCUM, STEP_GAIN, STEP_SECONDS = 0, 1, 2, 3, 4, 8
EVAL_SECONDS, EVAL_CPU = 2, 5


class ProfileFallbackWarning(UserWarning):
    """A result lacks a measurement the profile prefers; a substitute was used."""


def _label(result: dict[str, Any]) -> str:
    return repr(result.get("label", "<unlabelled run>"))


@attrs.frozen
class NoiseCurve:
    """Gradient-noise statistics at points of progress, and where they came from."""

    progress: FloatArray
    sqr: FloatArray
    var: FloatArray
    source: str  # "estimator" (recorded) or "gains" (implied by the recorded gains)


def ratio_from_gain(gain: float, scale: float) -> float:
    """The ratio variance / |G|^2 at which AdaScale's gain at ``scale`` is ``gain``.

    Inverts ``gain = (r + 1) / (r / scale + 1)``: ``r = (gain - 1) / (1 - gain /
    scale)``; inf for a gain at the scale (|G|^2 estimated 0), 0 for a gain of 1.
    Needs ``scale > 1``.
    """
    if not scale > 1.0:
        raise ValueError(f"scale must be > 1 for the gain to carry information, got {scale!r}")
    if gain >= scale:
        return math.inf
    return max(gain - 1.0, 0.0) / (1.0 - gain / scale)


def noise_curve(result: dict[str, Any]) -> NoiseCurve | None:
    """The run's gradient-noise statistics over progress (None if it has none)."""
    b0 = result["config"]["init_batch_size"]
    rows = [r for r in result.get("noise", []) if all(math.isfinite(x) for x in r[:4])]
    if rows:
        data = np.asarray(rows, dtype=np.float64)
        # The estimator's var is one sample's gradient variance; the model's, the
        # variance at the initial batch size (`GradientNoiseScale.grad_params`).
        return _increasing(data[:, 0], data[:, 2], data[:, 3] / b0, "estimator")
    warnings.warn(
        f"run {_label(result)} has no 'noise' rows: its gradient statistics are the "
        "ratio variance / |G|^2 implied by its recorded AdaScale gains (|G|^2 taken as 1)",
        ProfileFallbackWarning,
        stacklevel=2,
    )
    points = []
    for step in result["steps"]:
        scale = step[STEP_BATCH] / b0
        if scale > 1.0:
            r = ratio_from_gain(step[STEP_GAIN], scale)
            # |G|^2 estimated 0: all noise (sqr 0); otherwise |G|^2 taken as 1.
            points.append((step[STEP_PROGRESS], *((0.0, 1.0) if math.isinf(r) else (1.0, r))))
    if not points:
        return None
    data = np.asarray(points, dtype=np.float64)
    return _increasing(data[:, 0], data[:, 1], data[:, 2], "gains")


def resample(curve: NoiseCurve, grid: FloatArray) -> tuple[FloatArray, FloatArray]:
    """(sqr, var) of ``curve`` at the points of ``grid``: linear in between, the end
    values beyond."""
    return np.interp(grid, curve.progress, curve.sqr), np.interp(grid, curve.progress, curve.var)


def _increasing(progress: FloatArray, sqr: FloatArray, var: FloatArray, source: str) -> NoiseCurve:
    # Of points at the same progress (a skipped step adds none), the last one stands.
    keep = np.append(np.diff(progress) > 0, True)
    return NoiseCurve(progress[keep], sqr[keep], var[keep], source)


def step_times(result: dict[str, Any]) -> dict[tuple[int, int], list[float]]:
    """Seconds of each optimiser step by (local batch, accumulation steps), eval excluded.

    A step's time is the difference of the training seconds recorded at it and at
    the step before, so the first step of the run (which includes the start) is left
    out.
    """
    times: dict[tuple[int, int], list[float]] = defaultdict(list)
    steps = result["steps"]
    for prev, step in itertools.pairwise(steps):
        key = (int(step[STEP_LOCAL]), int(step[STEP_ACCUM]))
        times[key].append(step[STEP_SECONDS] - prev[STEP_SECONDS])
    return dict(times)


def cpu_step_times(result: dict[str, Any]) -> dict[tuple[int, int], list[float]]:
    """`step_times` in this process's CPU seconds instead of wall seconds.

    Each step's wall time is scaled by the CPU seconds per wall second of the
    stretch between the two evaluations around it (the run records CPU time only
    there), which takes out most of what other load on the machine adds.
    """
    evals = np.asarray(result["evals"], dtype=np.float64).reshape(-1, 6)
    wall = np.concatenate([[0.0], evals[:, EVAL_SECONDS]])
    cpu = np.concatenate([[0.0], evals[:, EVAL_CPU]])
    overall = cpu[-1] / wall[-1] if wall[-1] > 0 else 1.0
    share = np.where(np.diff(wall) > 0, np.diff(cpu) / np.maximum(np.diff(wall), 1e-12), overall)
    times: dict[tuple[int, int], list[float]] = defaultdict(list)
    for prev, step in itertools.pairwise(result["steps"]):
        j = min(int(np.searchsorted(wall, step[STEP_SECONDS], side="left")), len(share)) - 1
        key = (int(step[STEP_LOCAL]), int(step[STEP_ACCUM]))
        times[key].append((step[STEP_SECONDS] - prev[STEP_SECONDS]) * float(share[max(j, 0)]))
    return dict(times)


def fit_step_times(
    times: dict[tuple[int, int], list[float]], replicas: int, nodes: int = 1
) -> PerfParams:
    """Core's throughput fit to mean step times by (local batch, accumulation steps).

    Where one local batch size ran with several accumulation counts, a line through
    its mean step times against the count separates the compute-only micro-batch
    (the slope) from the one that synchronises (the intercept); otherwise a step's
    micro-batches are taken as equal (the synchronisation share is not identified).
    """
    by_local: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for (local, accum), values in sorted(times.items()):
        if values:
            by_local[local].append((accum, float(np.mean(values))))
    if not by_local:
        raise ValueError("times must hold at least one measured step, got none")
    bsz, accum_time, optim_time = [], [], []
    for local, rows in sorted(by_local.items()):
        counts = np.array([a for a, _ in rows], dtype=np.float64)
        means = np.array([t for _, t in rows])
        if len(rows) > 1:
            slope, intercept = np.polyfit(counts, means, 1)
            compute, optim = float(slope), float(intercept)
        if len(rows) == 1 or compute <= 0 or optim <= 0:
            compute = optim = float(np.mean(means / (counts + 1)))
        bsz.append(local)
        accum_time.append(compute)
        optim_time.append(optim)
    k = len(bsz)
    return fit_perf_params([nodes] * k, [replicas] * k, bsz, accum_time, optim_time)


def profiler_params(result: dict[str, Any]) -> PerfParams | None:
    """The throughput model the job's profiler fitted at its last decision, if recorded."""
    fitted = [d["perf"] for d in result.get("decisions", []) if "perf" in d]
    if fitted:
        return PerfParams.from_dict(fitted[-1])
    warnings.warn(
        f"run {_label(result)} has no 'decisions' with a 'perf' fit: the caller's "
        "fallback (a refit of its recorded step times) is used instead",
        ProfileFallbackWarning,
        stacklevel=2,
    )
    return None


def reached_at(
    result: dict[str, Any], *, accuracy: float | None = None, loss: float | None = None
) -> dict[str, float] | None:
    """Where the run first met a target, read off its evaluations (None if never).

    ``accuracy``: validation metric at least this; ``loss``: validation loss at most
    this; neither: the run's own ``reached`` record. A target stricter than the run's
    own is only seen up to where the run stopped.
    """
    if accuracy is None and loss is None:
        reached: dict[str, float] | None = result.get("reached")
        return reached
    for progress, samples, seconds, val_loss, val_metric, cpu in result["evals"]:
        if (accuracy is not None and val_metric >= accuracy) or (
            loss is not None and val_loss <= loss
        ):
            return {
                "progress": progress,
                "samples": samples,
                "seconds": seconds,
                "cpu_seconds": cpu,
            }
    return None
