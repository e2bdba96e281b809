"""Time to a target, adaptive against every size of a fixed sweep, over seeds (item 4).

The two problems of `experiments.harness.problems` (the shapes CNN and the Dyck
transformer; `experiments.harness.trainer` trains them) on 2 replicas under
torchrun, each seed a new initialisation and order (shapes: on one data draw,
`data_seed`) or a new data draw as well (dyck):

* adaptive: ``autoscale_batch_size(1024, local_bsz_bounds=(8, 128),
  gradient_accumulation=True)``, with AdaScale (SGD) or AdamScale (Adam);
* fixed: the same training at every power of two from 16 (the initial) to 1024
  (2 x 128 x 4 micro-batches, within the same local bounds), with the same rule.

Every run stops at its target (validation accuracy for the CNN, validation loss
for the language model) or at its progress cap. The primary measure is this
process's CPU time in training (evaluation excluded), less sensitive than wall
time to the other jobs on a shared machine; both are reported. Per problem and
run the table gives the median over seeds and the range; "best fixed" is the fixed
size with the smallest median, chosen in hindsight.

The summaries and tables (medians, pairs by seed, the model against the sweep) are
`experiments.harness.summaries`'s. `PROBLEMS` holds the problems as calibrated now
(a target at least a minute of CPU time away at the initial size); `--short` runs
the first, shorter calibration (`SHORT`) that RESULTS.md's earlier follow-ups
measured. `--from-log` refuses to summarise runs of two calibrations, or made to
two targets, together.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from experiments.harness.runs import (
    ADAPTIVE,
    CALIBRATION_KEYS,
    PROBLEMS,
    QUICK,
    SHORT,
    SWEEP,
    TARGET_KEYS,
    check_one_calibration,
    configs,
    label_of,
    own_target,
    retarget,
    run,
    total_of,
)
from experiments.harness.summaries import (
    decision_paths,
    model_table,
    model_vs_measured,
    phase_table,
    summarise,
)
from experiments.harness.summaries import table as summary_table
from experiments.harness.variants import Variant
from experiments.loss_floor import study as loss_floor
from experiments.noise_match import study as noise_match

# Re-exported: the runs' machinery is the harness's (`experiments.harness.runs`).
__all__ = [
    "ADAPTIVE",
    "CALIBRATION_KEYS",
    "PROBLEMS",
    "QUICK",
    "SHORT",
    "SWEEP",
    "TARGET_KEYS",
    "check_one_calibration",
    "choose_targets",
    "configs",
    "label_of",
    "main",
    "own_target",
    "retarget",
    "run",
    "total_of",
]


#: Grids the targets are rounded to: half a point of accuracy, 0.0005 nats of loss.
ACCURACY_GRID = 0.005
EXCESS_GRID = 0.0005


def choose_targets(results: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The targets of item 4, from the fixed runs at the initial size alone.

    The rule, fixed before any adaptive run with the final decision rule: a target
    that the initial size reaches on every seed with a margin above its final
    plateau's noise. For accuracy, one point below the lowest final accuracy of the
    fixed-16 runs over seeds, rounded down to the grid; for the loss, one grid step
    above the highest final excess over the optimal loss, rounded up to the grid.
    Returns ``{"target_accuracy": ...}`` or ``{"target_excess": ...}``.
    """
    initial = [r for r in results if r["label"] == "fixed 16"]
    if not initial:
        raise ValueError("results must hold the fixed-16 runs, got none")
    cfg = initial[0]["config"]
    if "target_accuracy" in cfg:
        low = min(r["val_acc"] for r in initial) - 0.01
        return {"target_accuracy": round(math.floor(low / ACCURACY_GRID) * ACCURACY_GRID, 4)}
    high = max(r["val_loss"] - r["config"]["optimal_loss"] for r in initial) + EXCESS_GRID
    return {"target_excess": round(math.ceil(high / EXCESS_GRID) * EXCESS_GRID, 4)}


def table(problem: str, summary: dict[str, Any], target: dict[str, float] | None = None) -> str:
    """The markdown table of one problem at its own target, or at ``target``."""
    cfg = {**PROBLEMS[problem], **(target or {})}
    return summary_table(problem, summary, {key: cfg[key] for key in TARGET_KEYS if key in cfg})


def plot(results: Sequence[dict[str, Any]], summaries: dict[str, Any], path: Path) -> None:
    """Per problem: CPU time to target per run (seeds as points); the adaptive batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    problems = list(summaries)
    fig, axes = plt.subplots(2, len(problems), figsize=(6 * len(problems), 7), squeeze=False)
    for col, problem in enumerate(problems):
        ax = axes[0, col]
        rows = summaries[problem]["rows"]
        for i, row in enumerate(rows):
            ax.bar(i, row["cpu_median"], color="C1" if row["label"] == "adaptive" else "C0")
            ax.plot([i] * len(row["cpu"]), row["cpu"], "k.", ms=5)
        ax.set_xticks(range(len(rows)), [row["label"] for row in rows], rotation=20)
        ax.set(ylabel="CPU s to target (median, seeds as dots)", title=problem)
        ax = axes[1, col]
        for r in results:
            if r["problem"] == problem and r["label"] == "adaptive":
                steps = np.asarray(r["steps"], dtype=np.float64)
                if len(steps):
                    ax.plot(steps[:, 8], steps[:, 1], "-", label=f"seed {r['seed']}")
        ax.set(xlabel="training wall time (s)", ylabel="adaptive total batch", yscale="log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The problem settings that ``main``'s options replace in every run it launches."""
    options = {
        "lr": args.lr,
        "progress_epochs": args.progress_epochs,
        # The variant (at most one: the parser's exclusive group).
        "preconditioned": True if args.preconditioned else None,
        "noise_match": args.noise_match,
        "floor_target_loss": args.floor_target_loss,
    }
    return {key: value for key, value in options.items() if value is not None}


def floor_errors(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--floor-target-loss`` in ``args`` (the `Variant` checks the
    rest: SGD problems only), or None.

    It selects adaptive runs to make: not with ``--from-log`` or fixed runs, and a
    finite loss (or ``horizon``).
    """
    target = args.floor_target_loss
    if target is None:
        return None
    if args.from_log:
        return (
            "--floor-target-loss selects runs to make; summarise their logs with "
            "python -m experiments.loss_floor"
        )
    if args.kinds != "adaptive":
        return (
            "--floor-target-loss applies to adaptive runs: give --kinds adaptive, "
            f"not {args.kinds!r}"
        )
    if isinstance(target, float) and not math.isfinite(target):
        return f"--floor-target-loss must be finite, got {target}"
    return None


def floor_target(text: str) -> float | str:
    """``--floor-target-loss``'s value: a loss, or ``"horizon"`` (no target stated)."""
    if text == "horizon":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a loss or 'horizon', got {text!r}") from None


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run both problems over the seeds, print the tables, write the plot and the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/outcome"))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--seed-list", help="comma-separated seeds to run instead of 0 .. seeds - 1"
    )
    parser.add_argument(
        "--sizes", help="comma-separated fixed total batch sizes to run (default: all)"
    )
    parser.add_argument("--problems", default=",".join(PROBLEMS))
    parser.add_argument("--quick", action="store_true", help="CI-sized runs")
    parser.add_argument(
        "--lr", type=float, help="the base learning rate instead of the problem's (a sweep)"
    )
    parser.add_argument(
        "--progress-epochs",
        type=int,
        help="the progress cap (the cosine schedule's length) instead of the problem's",
    )
    # One variant of core's path at most (experiments.harness.variants).
    variant = parser.add_mutually_exclusive_group()
    variant.add_argument(
        "--preconditioned",
        action="store_true",
        help="AdamScale(preconditioned=True): the noise of Adam's preconditioned gradient",
    )
    variant.add_argument(
        "--noise-match",
        nargs="?",
        const=1.0,
        type=float,
        metavar="LEVEL",
        help="fixed sizes whose steps carry the initial batch's gradient noise per unit of "
        "progress, or LEVEL (in (0, 1]) times it (noise_match)",
    )
    variant.add_argument(
        "--floor-target-loss",
        type=floor_target,
        metavar="LOSS",
        help="the decision credits the initial batch's noise floor with its share of the "
        "training loss left to LOSS (adaptdl.core.stats.floor, through report_loss); 'horizon': "
        "none stated, the loss shed over as much progress again (report_loss's default)",
    )
    parser.add_argument(
        "--short",
        action="store_true",
        help="the first calibration of the problems (`SHORT`), as RESULTS.md's earlier runs",
    )
    parser.add_argument("--jobs", type=int, default=1, help="runs launched at a time")
    parser.add_argument(
        "--kinds", default="adaptive,fixed", help="which runs: adaptive, fixed or both"
    )
    parser.add_argument(
        "--to-cap",
        action="store_true",
        help="run to the progress cap instead of stopping at the target",
    )
    parser.add_argument(
        "--from-log",
        type=Path,
        nargs="+",
        help="summarise the runs in these JSON-lines logs, run nothing",
    )
    parser.add_argument(
        "--retarget-accuracy",
        type=float,
        help="with --from-log: the time to this accuracy, read off the evaluations",
    )
    parser.add_argument(
        "--retarget-excess",
        type=float,
        help="with --from-log: the time to this loss above the optimal one",
    )
    parser.add_argument(
        "--auto-targets",
        action="store_true",
        help="with --from-log: the targets of `choose_targets`, from the fixed-16 runs",
    )
    parser.add_argument(
        "--phases",
        help=(
            "with --from-log: comma-separated validation accuracies; the samples to each, "
            "per run, and the fixed sizes' efficiency against 16 up to each (`phase_table`)"
        ),
    )
    parser.add_argument(
        "--decisions",
        action="store_true",
        help="also print each adaptive run's decisions (CPU s: total, noise scale / bound)",
    )
    args = parser.parse_args(argv)
    if args.short and args.from_log:
        parser.error(
            "--short selects the calibration to run; --from-log reads runs as they were made "
            "(give --retarget-accuracy or --retarget-excess to read them at another target)"
        )
    if args.noise_match is not None and args.from_log:
        parser.error(
            "--noise-match selects the runs to make; summarise noise-matched runs with "
            "python -m experiments.noise_match"
        )
    if args.noise_match is not None and "adaptive" in args.kinds.split(","):
        parser.error("--noise-match applies to fixed sizes: give --kinds fixed")
    if args.noise_match is not None and not 0.0 < args.noise_match <= 1.0:
        parser.error(f"--noise-match LEVEL must be in (0, 1], got {args.noise_match}")
    if (wrong := floor_errors(args)) is not None:
        parser.error(wrong)
    if args.preconditioned:
        other = [p for p in args.problems.split(",") if PROBLEMS[p]["rule"] != "adamscale"]
        if other:
            parser.error(f"--preconditioned applies to AdamScale problems (dyck), not {other}")
    for problem in args.problems.split(","):
        try:
            Variant.of({**PROBLEMS[problem], **run_overrides(args)})
        except ValueError as err:
            parser.error(f"problem {problem}: {err}")
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    summaries: dict[str, Any] = {}
    log = args.out / "time_to_target.jsonl"
    logged = []
    for path in args.from_log or ():
        logged += [json.loads(line) for line in path.read_text().splitlines() if line]
    targets: dict[str, Any] = {}
    for problem in args.problems.split(","):
        short = SHORT[problem] if args.short else {}
        target: dict[str, float] | None = {
            key: short[key] for key in TARGET_KEYS if key in short
        } or None
        if args.from_log is not None:
            runs = [r for r in logged if r["problem"] == problem]
            runs.sort(
                key=lambda r: (
                    r["label"] != "adaptive",
                    int(r["label"].split()[-1]) if r["label"] != "adaptive" else 0,
                    r["seed"],
                )
            )
            for key, kind, module in [
                ("noise_match", "noise-matched", "noise_match"),
                ("floor_credit", "per-step-credit", "loss_floor"),  # logs of the archive
                ("floor_target_loss", "floor-share", "loss_floor"),
            ]:
                # Their labels are core's ("fixed 256", "adaptive"): they would merge.
                values = [r["config"].get(key) for r in runs]
                if any(v is not None and v is not False for v in values):  # 0.0 is given
                    parser.error(
                        f"{problem}: the logs hold {kind} runs; summarise them with "
                        f"python -m experiments.{module}"
                    )
            try:
                check_one_calibration(runs)
            except ValueError as err:
                parser.error(f"{problem}: {err}")
            if args.auto_targets:
                target = choose_targets(runs)
            elif args.retarget_accuracy is not None and "target_accuracy" in PROBLEMS[problem]:
                target = {"target_accuracy": args.retarget_accuracy}
            elif args.retarget_excess is not None and "target_excess" in PROBLEMS[problem]:
                target = {"target_excess": args.retarget_excess}
            if target is not None:
                accuracy, excess = target.get("target_accuracy"), target.get("target_excess")
                runs = [retarget(r, accuracy, excess) for r in runs]
                targets[problem] = target
            else:
                try:
                    target = own_target(runs)
                except ValueError as err:
                    parser.error(f"{problem}: {err}")
        else:
            seeds = (
                [int(x) for x in args.seed_list.split(",")]
                if args.seed_list
                else range(args.seeds)
            )
            runs = run(
                problem,
                seeds,
                quick=args.quick,
                jobs=args.jobs,
                log=log,
                kinds=args.kinds,
                to_cap=args.to_cap,
                overrides=short | run_overrides(args),
                sizes=[int(x) for x in args.sizes.split(",")] if args.sizes else None,
            )
        results += runs
        if args.noise_match is not None:
            # Noise-matched runs carry the plain sizes' labels, which the sweep's summaries
            # would read as hand-tuned sizes: noise_match's table names them instead.
            print(f"{problem}:\n{noise_match.table(noise_match.at_target(runs))}\n")
            continue
        if args.floor_target_loss is not None:
            # Their label is core's ("adaptive"): loss_floor's table names the decision.
            print(f"{problem}:\n{loss_floor.target_table(runs)}\n")
            continue
        summaries[problem] = summarise(runs)
        print(table(problem, summaries[problem], target))
        print()
        if args.decisions:
            print(f"{problem}: decisions (CPU s: total (noise scale / its bound))")
            print(decision_paths(runs))
            print()
        if args.from_log is not None:
            summaries[problem]["model_vs_measured"] = model_vs_measured(runs)
            print(model_table(problem, summaries[problem]["model_vs_measured"]))
            print()
            if args.phases and "target_accuracy" in PROBLEMS[problem]:
                levels = [float(x) for x in args.phases.split(",")]
                print(f"{problem}: " + phase_table(runs, levels))
                print()
    (args.out / "time_to_target.json").write_text(json.dumps(results))
    if targets:
        (args.out / "targets.json").write_text(json.dumps(targets))
    if summaries:
        plot(results, summaries, args.out / "time_to_target.png")
    return summaries


if __name__ == "__main__":
    main()
