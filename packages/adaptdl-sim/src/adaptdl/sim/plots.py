"""PNG plots of simulation results (needs the ``plots`` extra: matplotlib)."""

from __future__ import annotations

import importlib
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from adaptdl.core.validate import check_int
from adaptdl.sim.metrics import JobResult, SimResult
from adaptdl.sim.replay import ReplayReport

PLOTS_EXTRA = "pip install 'adaptdl-sim[plots]'"
#: Jobs drawn in the per-job figures: more panels than this are too small to read.
TOP_JOBS = 8


def check_plot_folder(folder: Path | str) -> Path:
    """Check that plots can be written into ``folder`` (created if missing); return it.

    Meant to run before a long simulation. Raises ValueError naming the cause:
    matplotlib missing (with the extra to install), or the folder not creatable or
    not writable.
    """
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        raise ValueError(f"matplotlib is not installed; {PLOTS_EXTRA}") from None
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{str(folder)!r} exists and is not a directory")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # Creating and removing a file is the one check that works for every cause
        # (permissions, read-only mounts, ACLs), where os.access does not.
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".adaptdl-sim-", suffix=".probe"):
            pass
    except OSError as exc:
        cause = exc.strerror or str(exc)
        raise ValueError(f"cannot write into directory {str(folder)!r}: {cause}") from None
    return folder


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(f"--plot needs matplotlib: {PLOTS_EXTRA}") from exc
    return plt


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def top_jobs(result: SimResult, count: int = TOP_JOBS) -> list[JobResult]:
    """The ``count`` longest jobs by completion time, longest first.

    An unfinished job counts as running until the end of the simulation, so it
    ranks among the longest; ties go to the earlier submission, then the name.
    """
    check_int("count", count, min=1)

    def length(job: JobResult) -> float:
        return (job.finish if job.finish is not None else result.end_time) - job.submit

    ranked = sorted(result.jobs, key=lambda j: (-length(j), j.submit, j.name))
    return ranked[:count]


def plot_cluster(
    results: Sequence[SimResult], folder: Path | str, prefix: str = "", top: int = TOP_JOBS
) -> list[Path]:
    """Write the JCT CDF per policy, and per policy the GPUs and the batch size over time
    of its ``top`` longest jobs, one small panel per job."""
    plt = _pyplot()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        jct = np.sort(r.jcts) / 3600.0
        if len(jct):
            ax.step(jct, np.arange(1, len(jct) + 1) / len(jct), where="post", label=r.policy)
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (hours)")
    ax.set_ylabel("fraction of jobs")
    ax.set_title(f"JCT distribution of {max((len(r.jobs) for r in results), default=0)} jobs")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    written.append(_save(plt, fig, folder / f"{prefix}jct_cdf.png"))
    for r in results:
        for column, label, name in ((1, "GPUs", "gpus"), (2, "total batch size", "batch_size")):
            path = folder / f"{prefix}{r.policy}_{name}.png"
            written.append(_save(plt, _job_panels(plt, r, top, column, label), path))
    return written


def _job_panels(plt: Any, result: SimResult, top: int, column: int, label: str) -> Any:
    """Small multiples: one panel per job, all on the same time axis."""
    jobs = top_jobs(result, top)
    cols = 2 if len(jobs) > 1 else 1
    rows = max(1, -(-len(jobs) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(9, 1.6 * rows + 1.2), sharex=True, squeeze=False)
    end = result.end_time / 3600.0
    values = [h[column] for j in jobs for h in j.history]
    for ax, job in zip(axes.flat, jobs, strict=False):
        t = [h[0] / 3600.0 for h in job.history]
        v = [h[column] for h in job.history]
        stop = job.finish / 3600.0 if job.finish is not None else end
        if t:
            t.append(stop)
            v.append(v[-1])
            # Dots mark each change, so that a run of minutes in hours still shows.
            ax.step(t, v, where="post", color="tab:blue", linewidth=1.2)
            ax.plot(t, v, ".", color="tab:blue", markersize=4)
        # Shaded: from submission to finish (or the end), waiting time included.
        ax.axvspan(job.submit / 3600.0, stop, color="tab:gray", alpha=0.08, linewidth=0)
        if column == 2:
            ax.set_yscale("log")
        if values:  # one scale for all panels, so that they compare at a glance
            positive = [x for x in values if x > 0]
            if column == 2 and positive:
                ax.set_ylim(0.8 * min(positive), 1.6 * max(positive))
            elif column != 2:
                ax.set_ylim(0, 1.1 * max(values) or 1)
        jct = "unfinished" if job.jct is None else f"JCT {job.jct / 3600.0:.2f} h"
        ax.set_title(f"{job.name} ({job.application}, {jct})", fontsize=9, loc="left")
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(jobs) :]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("time (hours)")
    for ax in axes[:, 0]:
        ax.set_ylabel(label, fontsize=9)
    fig.suptitle(
        f"{result.policy}: {label} over time of the {len(jobs)} longest of "
        f"{len(result.jobs)} jobs (by JCT); shaded: submitted to finished",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def plot_replay(report: ReplayReport, folder: Path | str) -> list[Path]:
    """Write batch size, accumulation and goodput over time of a replay."""
    plt = _pyplot()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rows = np.array(report.timeline, dtype=np.float64)
    fig, axes = plt.subplots(3, 1, figsize=(7, 7), sharex=True)
    if len(rows):
        t = rows[:, 0]
        axes[0].step(t, rows[:, 4], where="post", label="total batch size")
        axes[0].step(t, rows[:, 2], where="post", label="local batch size")
        axes[0].set_yscale("log")
        axes[0].legend()
        axes[1].step(t, rows[:, 1], where="post", label="replicas")
        axes[1].step(t, rows[:, 3], where="post", label="accumulation steps")
        axes[1].legend()
        axes[2].step(t, rows[:, 5], where="post")
        axes[2].set_ylabel("goodput (samples/s)")
    axes[2].set_xlabel("simulated time (s)")
    axes[0].set_title(f"replay {report.scenario}")
    fig.tight_layout()
    return [_save(plt, fig, folder / f"replay_{report.scenario}.png")]
