"""Adaptive batch size on real training, against a sweep of fixed batch sizes in the same run.

The classifier of `experiments.harness.classifier` on 2 replicas (torchrun, CPU):

* adaptive: ``autoscale_batch_size(max_batch_size, local_bsz_bounds,
  gradient_accumulation=True)``: AdaptDL's goodput-driven decision picks the local
  batch size and accumulation steps at the start of every pass, from the
  throughput model fitted on the job's own step timings and the gradient noise
  measured so far; AdaScale adapts the learning rate;
* fixed: the same training at each total batch size of a small sweep (AdaScale
  too, so that every run gets the learning rate its batch size deserves, the
  strongest fixed baseline short of tuning each one by hand).

Every run stops when the validation accuracy first reaches the target; the time
to it is training wall time, evaluation excluded. The machine is shared and
noisy, so the runs are interleaved in one invocation and the figure reported is
the ratio of the best fixed run's time to the adaptive run's.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from experiments.harness.classifier import PROBLEM
from experiments.harness.launch import launch

#: Fixed total batch sizes of the sweep (16, 64, 256, 1024), as (local batch size,
#: accumulation steps) on 2 replicas, within the same local bounds as the adaptive run.
SWEEP = ((8, 0), (32, 0), (128, 0), (128, 3))

DEFAULT = {
    **PROBLEM,
    "progress_epochs": 10,  # the cap, and the length of the cosine schedule
    "eval_every_samples": 2048,
    "target_accuracy": 0.94,
    "stop_at_target": True,
    "max_batch_size": 1024,
    # A local batch of at most 128 stands for a device's memory limit: larger totals
    # need accumulation, so the decision is over (local batch, accumulation steps).
    "local_bsz_bounds": [8, 128],
    "gradient_accumulation": True,
}


def run_adaptive(cfg: dict[str, Any]) -> dict[str, Any]:
    """The adaptive run."""
    # It goes on to the progress cap after reaching the target (the time to the target is
    # recorded when it is reached), so that the plot shows its later decisions too.
    result = launch(
        "experiments.harness.classifier",
        2,
        {**cfg, "autoscale": True, "rule": "adascale", "stop_at_target": False},
    )
    result["label"] = "adaptive"
    return result


def run_fixed(cfg: dict[str, Any], local: int, accum: int) -> dict[str, Any]:
    """One fixed run at total batch size ``2 * local * (accum + 1)``."""
    result = launch(
        "experiments.harness.classifier",
        2,
        {**cfg, "rule": "adascale", "local_bsz": local, "accum_steps": accum},
    )
    result["label"] = f"fixed {2 * local * (accum + 1)}"
    return result


def summarise(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per run the time, progress and samples to the target; the best fixed one; the ratio."""
    rows = []
    for r in results:
        steps = np.asarray(r["steps"], dtype=np.float64)
        reached = r["reached"]
        if reached is not None:
            steps = steps[: reached["steps"]]  # what it took to reach the target
        rows.append(
            {
                "label": r["label"],
                "seconds": reached["seconds"] if reached else None,
                "cpu_seconds": reached["cpu_seconds"] if reached else None,
                "first_pass_seconds": _first_decision_seconds(steps),
                "samples": reached["samples"] if reached else None,
                "progress": reached["progress"] if reached else None,
                # Where the run ended, and why: a run that misses its target ends at
                # the progress cap or on divergence, never before (`trainer.train`).
                "final_progress": r["progress"],
                "ended": _ended(r),
                "steps": len(steps),
                "batch_sizes": sorted({int(b) for b in steps[:, 1]}) if len(steps) else [],
                "final_batch": int(steps[-1, 1]) if len(steps) else 0,
                "final_accum": int(steps[-1, 3]) if len(steps) else 0,
                "val_acc": r["val_acc"],
            }
        )
    fixed = [row for row in rows if row["label"] != "adaptive" and row["seconds"] is not None]
    adaptive = next(row for row in rows if row["label"] == "adaptive")
    best = min(fixed, key=lambda row: row["seconds"]) if fixed else None
    ratio = cpu_ratio = None
    if best is not None and adaptive["seconds"] is not None:
        ratio = best["seconds"] / adaptive["seconds"]
        best_cpu = min(row["cpu_seconds"] for row in fixed)
        cpu_ratio = best_cpu / adaptive["cpu_seconds"]
    return {
        "rows": rows,
        "best_fixed": best["label"] if best else None,
        "ratio": ratio,
        "cpu_ratio": cpu_ratio,
    }


def _ended(result: dict[str, Any]) -> str:
    """Why a run ended: "diverged", "target" (a run stopped at its target) or "cap"."""
    if result.get("diverged"):
        return "diverged"
    if result["reached"] is not None and result["config"].get("stop_at_target"):
        return "target"
    return "cap"


def _first_decision_seconds(steps: np.ndarray) -> float | None:
    """Training time until the batch size first differs from the first step's (None: never)."""
    if not len(steps):
        return None
    changed = np.flatnonzero(steps[:, 1] != steps[0, 1])
    return float(steps[changed[0], 8]) if len(changed) else None


def table(summary: dict[str, Any], target: float) -> str:
    """The markdown table of item 3."""
    lines = [
        f"| run | time to {target:.1%} val. accuracy: wall / CPU (s) | samples | progress | "
        "optimiser steps (to the target, or to the run's end) | batch sizes used | "
        "batch at target (accum) | time at initial batch (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in summary["rows"]:
        secs = "not reached"
        if row["seconds"] is not None:
            secs = f"{row['seconds']:.2f} / {row['cpu_seconds']:.2f}"
        first = row["first_pass_seconds"]
        sizes = ", ".join(str(b) for b in row["batch_sizes"])
        if len(row["batch_sizes"]) > 6:
            sizes = (
                f"{row['batch_sizes'][0]} .. {row['batch_sizes'][-1]} ({len(row['batch_sizes'])})"
            )
        # A missed target has no progress at it: show where the run ended, and why.
        progress = (
            f"{row['progress']:.0f}"
            if row["progress"] is not None
            else f"{row['final_progress']:.0f} at its end ({row['ended']})"
        )
        lines.append(
            f"| {row['label']} | {secs} | {row['samples'] or '-'} | "
            f"{progress} | {row['steps']} | {sizes} | "
            f"{row['final_batch']} ({row['final_accum']}) | "
            f"{'-' if first is None else f'{first:.2f}'} |"
        )
    ratio = summary["ratio"]
    lines.append("")
    cpu = summary["cpu_ratio"]
    lines.append(
        f"Best fixed batch size: {summary['best_fixed']}; time(best fixed) / time(adaptive) = "
        + (f"{ratio:.2f} (wall), {cpu:.2f} (CPU)" if ratio is not None else "n/a")
    )
    return "\n".join(lines)


def plot(results: Sequence[dict[str, Any]], path: Path) -> None:
    """The adaptive run over time (batch size, accumulation, gain, goodput); all accuracies."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    adaptive = next(r for r in results if r["label"] == "adaptive")
    steps = np.asarray(adaptive["steps"], dtype=np.float64)
    t = steps[:, 8]
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5), constrained_layout=True)
    panels = (
        (axes[0, 0], steps[:, 1], "total batch size", "log"),
        (axes[0, 1], steps[:, 3], "accumulation steps", "linear"),
        (axes[0, 2], steps[:, 4], "gain", "linear"),
        (axes[1, 0], steps[:, 7], "modelled goodput (samples/s)", "log"),
        (axes[1, 1], steps[:, 2], "local batch size", "log"),
    )
    for ax, values, name, yscale in panels:
        ax.plot(t, values, "-")
        ax.set(xlabel="training time (s)", ylabel=name, yscale=yscale)
    ax = axes[1, 2]
    for r in results:
        evals = np.asarray(r["evals"], dtype=np.float64)
        ax.plot(
            evals[:, 2], evals[:, 4], "-" if r["label"] == "adaptive" else "--", label=r["label"]
        )
    ax.axhline(adaptive["config"]["target_accuracy"], color="k", lw=0.8)
    ax.set(xlabel="training time (s)", ylabel="validation accuracy", ylim=(0.5, 1.0))
    ax.legend(fontsize=8)
    fig.suptitle("autoscale_batch_size on 2 replicas (adaptive run)")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the adaptive job and the fixed sweep, print the table, write the plot."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/outcome"))
    parser.add_argument("--target-accuracy", type=float, default=DEFAULT["target_accuracy"])
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = {**DEFAULT, "target_accuracy": args.target_accuracy}
    results = [run_adaptive(cfg)] + [run_fixed(cfg, local, accum) for local, accum in SWEEP]
    (args.out / "autoscale_vs_fixed.json").write_text(json.dumps(results))
    summary = summarise(results)
    plot(results, args.out / "autoscale_vs_fixed.png")
    print(table(summary, cfg["target_accuracy"]))
    return summary


if __name__ == "__main__":
    main()
