"""PNG plots of simulation results (needs the ``plots`` extra: matplotlib)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from adaptdl.sim.metrics import SimResult
from adaptdl.sim.replay import ReplayReport


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("--plot needs matplotlib: pip install 'adaptdl-sim[plots]'") from exc
    return plt


def plot_cluster(results: Sequence[SimResult], folder: Path | str, prefix: str = "") -> list[Path]:
    """Write the JCT CDF per policy, and GPUs and batch size per job over time per policy."""
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
    ax.legend()
    ax.grid(alpha=0.3)
    path = folder / f"{prefix}jct_cdf.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)
    for r in results:
        for column, label, name in ((1, "GPUs", "gpus"), (2, "total batch size", "batch_size")):
            fig, ax = plt.subplots(figsize=(7, 4))
            for job in r.jobs:
                if not job.history:
                    continue
                t = [h[0] / 3600.0 for h in job.history]
                v = [h[column] for h in job.history]
                if job.finish is not None:
                    t.append(job.finish / 3600.0)
                    v.append(v[-1])
                ax.step(t, v, where="post", linewidth=0.7, alpha=0.7)
            ax.set_xlabel("time (hours)")
            ax.set_ylabel(f"{label} per job")
            if column == 2:
                ax.set_yscale("log")
            ax.set_title(f"{r.policy}: {label} per job over time")
            path = folder / f"{prefix}{r.policy}_{name}.png"
            fig.tight_layout()
            fig.savefig(path, dpi=120)
            plt.close(fig)
            written.append(path)
    return written


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
    path = folder / f"replay_{report.scenario}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]
