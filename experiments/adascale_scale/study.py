"""AdaScale at scale: the classifier trained to the same progress at scales 1, 4 and 16.

Every run trains the same MLP (`experiments.harness.classifier`) from the same
initialisation, with the learning rate tuned at the initial batch size of 16,
until the job's scale-invariant progress reaches the same target (the adaptive
loop's stop rule). The scale is the total batch size over the initial one: it is
reached with 2 real replicas and gradient accumulation (scale 4: 2 replicas x 16
samples x 2 micro-batches; scale 16: 2 x 32 x 4). Running 16 real replicas on 2
cores would only be slower: the averaged gradient, the gradient-noise statistics
(from the same count of micro-batches) and hence the gain are the same whether the
micro-batches come from replicas or from accumulation.

AdaScale multiplies the learning rate by the gain (in [1, scale]); each step then
counts ``gain`` initial-batch steps of progress, so a run at scale S takes about
``target / gain`` steps. Linear scaling multiplies the learning rate by S over
the same progress. At scale 1 both rules are the identity, so one run stands for
both.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from experiments.harness import regression
from experiments.harness.classifier import PROBLEM
from experiments.harness.launch import accumulated_step, launch

#: (scale, local batch size, accumulation steps) on 2 replicas, initial batch 16.
SHAPES = ((1, 8, 0), (4, 16, 1), (16, 32, 3))

DEFAULT = {**PROBLEM, "progress_epochs": 6, "eval_every_samples": 8192}


def simulate_core(
    scale: int,
    rule: str = "adascale",
    *,
    progress: float = 2000.0,
    lr: float = 0.05,
    init_batch_size: int = 16,
    seed: int = 0,
) -> dict[str, Any]:
    """AdaScale (or linear scaling) on the regression of `gns_accuracy`, in numpy, through core.

    Each step at ``scale`` averages ``max(scale, 2)`` micro-batches of
    ``init_batch_size * scale / max(scale, 2)`` fresh samples, hands their squared
    norms to core's step contract (`adaptdl.core.stats.step`, as the torch adapter does)
    and takes an SGD step with the learning-rate factor of core's decision, until
    the job's progress reaches ``progress``. Returns the gains, the steps taken and the final
    excess loss ``E loss - sigma^2 / 2 = delta' Lambda delta / 2`` (closed form).
    """
    from adaptdl.core.collective import LocalCollective
    from adaptdl.core.stats import scaling
    from adaptdl.core.stats.metrics import MetricsState
    from adaptdl.core.stats.step import StepStatistics

    cfg = {**regression.DEFAULT, "seed": seed}
    p = regression.problem(cfg)
    lam, w_star = p["lam"], p["w_star"]
    count = max(scale, 2)
    batch = init_batch_size * scale
    local = batch // count
    metrics = MetricsState()
    steps = StepStatistics(metrics, LocalCollective())
    core_rule = scaling.AdaScale() if rule == "adascale" else scaling.LinearScale()
    gen = np.random.default_rng(seed + 3)
    w = p["w0"].copy()
    gains = []
    while metrics.progress < progress:
        x = gen.standard_normal((batch, lam.size)) * np.sqrt(lam)
        y = x @ w_star + cfg["sigma"] * gen.standard_normal(batch)
        grads = (x * (x @ w - y)[:, None]).reshape(count, local, -1).mean(axis=1)
        # The micro-batches of one replica, as with accumulation.
        measured, mean = accumulated_step(grads, local)
        decision = steps.step(
            measured, init_batch_size=init_batch_size, batch_size=batch, rule=core_rule
        )
        w = w - lr * decision.lr_factors[0] * mean
        gains.append(decision.gain)
        if not np.all(np.isfinite(w)):
            break
    delta = w - w_star
    return {
        "scale": scale,
        "rule": rule,
        "gains": gains,
        "steps": len(gains),
        "excess_loss": float(0.5 * np.sum(lam * delta**2)),
    }


def run(cfg: dict[str, Any], rule: str, scale: int, local: int, accum: int) -> dict[str, Any]:
    """One training run on 2 replicas at ``2 * local * (accum + 1)`` samples per step."""
    result = launch(
        "experiments.harness.classifier",
        2,
        {**cfg, "rule": rule, "local_bsz": local, "accum_steps": accum},
    )
    result.update(rule=rule, scale=scale, local_bsz=local, accum_steps=accum)
    return result


def run_all(
    cfg: dict[str, Any], shapes: Sequence[tuple[int, int, int]] = SHAPES
) -> list[dict[str, Any]]:
    """Every (rule, scale); scale 1 once, reported for both rules."""
    results = []
    for scale, local, accum in shapes:
        if scale == 1:
            base = run(cfg, "adascale", scale, local, accum)
            results += [base, {**base, "rule": "linear"}]
            continue
        for rule in ("adascale", "linear"):
            results.append(run(cfg, rule, scale, local, accum))
    return results


def summarise(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per run: steps, samples, gains, final validation loss and accuracy, gaps to scale 1."""
    base = {r["rule"]: r for r in results if r["scale"] == 1}
    rows = []
    for r in results:
        steps = np.asarray(r["steps"], dtype=np.float64)
        ref = base[r["rule"]]
        gains = steps[:, 4] if len(steps) else np.ones(1)
        rows.append(
            {
                "rule": r["rule"],
                "scale": r["scale"],
                "shape": f"{r['replicas']} x {r['local_bsz']} x {r['accum_steps'] + 1}",
                "steps": len(steps),
                "samples": r["samples"],
                "progress": r["progress"],
                "mean_gain": float(np.mean(gains)),
                "final_gain": float(gains[-1]),
                "val_loss": r["val_loss"],
                "val_acc": r["val_acc"],
                "loss_gap": (r["val_loss"] - ref["val_loss"]) / ref["val_loss"],
                "acc_gap": r["val_acc"] - ref["val_acc"],
                "diverged": r["diverged"],
                "train_seconds": r["train_seconds"],
            }
        )
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The markdown table of item 2."""
    lines = [
        "| rule | scale | replicas x local bsz x micro-batches | optimiser steps | samples | "
        "gain: mean / final | val loss | val accuracy | loss vs scale 1 | accuracy vs scale 1 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in rows:
        loss = "diverged" if s["diverged"] else f"{s['val_loss']:.4f}"
        lines.append(
            f"| {s['rule']} | {s['scale']} | {s['shape']} | {s['steps']} | {s['samples']} | "
            f"{s['mean_gain']:.2f} / {s['final_gain']:.2f} | {loss} | {s['val_acc']:.2%} | "
            f"{s['loss_gap']:+.1%} | {100 * s['acc_gap']:+.2f} pt |"
        )
    return "\n".join(lines)


def plot(results: Sequence[dict[str, Any]], path: Path) -> None:
    """Validation loss and gain against scale-invariant progress, per rule and scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    seen = set()
    for r in results:
        key = (r["scale"], r["rule"] if r["scale"] != 1 else "both")
        if key in seen:
            continue
        seen.add(key)
        evals = np.asarray(r["evals"], dtype=np.float64)
        steps = np.asarray(r["steps"], dtype=np.float64)
        style = "-" if r["rule"] == "adascale" or r["scale"] == 1 else "--"
        label = f"scale {r['scale']} ({key[1]})"
        axes[0].plot(evals[:, 0], evals[:, 3], style, marker=".", label=label)
        axes[1].plot(steps[:, 0], steps[:, 4], style, label=label)
    axes[0].set(xlabel="progress (initial-batch steps)", ylabel="validation loss", yscale="log")
    axes[1].set(xlabel="progress (initial-batch steps)", ylabel="gain", yscale="log")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def lr_sweep(cfg: dict[str, Any], lrs: Sequence[float] = (0.1, 0.3, 0.6, 1.2)) -> str:
    """Tune the base learning rate at scale 1 only (how `PROBLEM`'s lr was chosen)."""
    lines = ["| base lr | val loss | val accuracy |", "|---|---|---|"]
    for lr in lrs:
        r = run({**cfg, "lr": lr}, "adascale", 1, 8, 0)
        lines.append(f"| {lr} | {r['val_loss']:.4f} | {r['val_acc']:.2%} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run every scale and rule, print the table, write the plot; return the rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/outcome"))
    parser.add_argument("--progress-epochs", type=int, default=DEFAULT["progress_epochs"])
    parser.add_argument(
        "--lr-sweep", action="store_true", help="only tune the base learning rate at scale 1"
    )
    parser.add_argument(
        "--seed", type=int, default=DEFAULT["seed"], help="data and initialisation seed"
    )
    args = parser.parse_args(argv)
    cfg = {**DEFAULT, "progress_epochs": args.progress_epochs, "seed": args.seed}
    if args.lr_sweep:
        print(lr_sweep(cfg))
        return []
    args.out.mkdir(parents=True, exist_ok=True)
    results = run_all(cfg)
    rows = summarise(results)
    plot(results, args.out / "adascale_scale.png")
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
