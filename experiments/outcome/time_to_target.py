"""Time to a target, adaptive against every size of a fixed sweep, over seeds (item 4).

The two problems of `experiments.outcome.problems` (the shapes CNN and the Dyck
transformer; `experiments.outcome.trainer` trains them) on 2 replicas under
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
`experiments.outcome.summaries`'s. `PROBLEMS` holds the problems as calibrated now
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
from experiments.outcome._common import launch
from experiments.outcome.summaries import (
    decision_paths,
    model_table,
    model_vs_measured,
    phase_table,
    summarise,
)
from experiments.outcome.summaries import table as summary_table
from experiments.outcome.trainer import DYCK, SHAPES

#: Fixed total batch sizes (16, 32, ..., 1024) as (local batch, accumulation steps) on 2
#: replicas, within the adaptive run's local bounds.
SWEEP = ((8, 0), (16, 0), (32, 0), (64, 0), (128, 0), (128, 1), (128, 3))

ADAPTIVE = {
    "autoscale": True,
    "max_batch_size": 1024,
    # A local batch of at most 128 stands for a device's memory limit.
    "local_bsz_bounds": [8, 128],
    "gradient_accumulation": True,
}

#: Each problem with its target and progress cap (the cosine schedule's length).
#: Calibrated so that the target takes at least a minute of CPU time at the initial
#: size (the issue's floor; RESULTS.md item 4, seventh and eighth follow-ups): with a
#: shorter run the warm-up at small sizes weighs on every comparison.
PROBLEMS: dict[str, dict[str, Any]] = {
    "shapes": {
        **SHAPES,
        # Four times the images of the first calibration: on 16,384 the CNN overfit
        # (validation loss rising after about 6 epochs) and plateaued at 73-76%.
        "train_size": 65536,
        # At pixel noise 0.5 the accuracy plateaued at 76-77% within 3 epochs (a Bayes
        # error); at 0.4 it still climbs at 8 (final 87.1-88.5% at 16, a draw per seed).
        "noise": 0.4,
        # Four times the validation images: on 2,048 the accuracy's standard error
        # (0.75 points) was half the climb of the last half of training, so the time to
        # a target was mostly the luck of one evaluation. An evaluation every 8,192
        # samples keeps their cost (wall time, not counted as training) as it was.
        "val_size": 8192,
        "eval_every_samples": 8192,
        # One data draw for every seed (the seed varies initialisation and order), so
        # that seeds differ in training only. (With a draw per seed the initial size
        # reached the target in 34-58 CPU s; on one draw its spread stayed wide,
        # 47-110 over 6 seeds: RESULTS.md item 4, eighth follow-up.)
        "data_seed": 0,
        # The target, from the fixed-16 runs of 3 seeds by `choose_targets` (final
        # 87.0-87.8%), reached at 16 in 62-70 CPU s. On 8 epochs the same draw reached
        # it in 50 s (seed 0): a longer cosine schedule keeps the rate up for longer;
        # the final accuracy barely moves.
        "target_accuracy": 0.86,
        "progress_epochs": 12,
    },
    "dyck": {
        **DYCK,
        # Twice the sequences of the first calibration: on 32,768 the fixed-16 runs end
        # within 0.0002 nats of the optimum, on 16,384 within 0.0005-0.001.
        "train_size": 32768,
        # The best possible loss of each seed's draw is known exactly (problems.dyck).
        # The target, from the fixed-16 runs of 3 seeds by `choose_targets`.
        "target_excess": 0.001,
        "progress_epochs": 8,
        "eval_every_samples": 4096,
    },
}

#: The first calibration (RESULTS.md item 4 up to its sixth follow-up; `--short`):
#: shapes at 75% in 22 CPU s at the initial size, dyck at optimal + 0.001 in 36.
SHORT: dict[str, dict[str, Any]] = {
    "shapes": {
        "data_seed": None,
        "noise": 0.5,
        "progress_epochs": 3,
        "val_size": 2048,
        "eval_every_samples": 4096,
        "target_accuracy": 0.75,
    },
    "dyck": {"train_size": 16384, "target_excess": 0.001},
}

#: Settings small enough for CI (tests/outcome): the same code, a fraction of the data.
QUICK = {"train_size": 2048, "val_size": 512, "progress_epochs": 2, "eval_every_samples": 1024}


def total_of(cfg: dict[str, Any], replicas: int = 2) -> int:
    """The total batch size of a fixed run's config on ``replicas`` replicas."""
    return int(replicas * cfg["local_bsz"] * (cfg["accum_steps"] + 1))


def label_of(cfg: dict[str, Any]) -> str:
    """'adaptive' or 'fixed <total>' for a run's config on 2 replicas."""
    if cfg.get("autoscale"):
        return "adaptive"
    return f"fixed {total_of(cfg)}"


def configs(
    problem: str,
    seed: int,
    quick: bool = False,
    *,
    kinds: str = "adaptive,fixed",
    to_cap: bool = False,
    overrides: dict[str, Any] | None = None,
    sizes: Sequence[int] | None = None,
) -> list[dict[str, Any]]:
    """The adaptive run and the fixed sweep for one problem and seed, in run order.

    ``kinds`` selects "adaptive" and/or "fixed" runs; ``to_cap`` runs every one to its
    progress cap instead of stopping at the target (the time to any target no
    stricter is then read off its evaluations, `retarget`); ``overrides`` replace
    settings of the problem (e.g. a target); ``sizes`` keeps only those fixed totals
    of the sweep (ValueError for a total the sweep does not have).
    """
    base = {**PROBLEMS[problem], **(overrides or {}), "seed": seed, "stop_at_target": not to_cap}
    if quick:
        base.update(QUICK)
    wanted = set(kinds.split(","))
    runs = [{**base, **ADAPTIVE}] if "adaptive" in wanted else []
    sweep = {2 * local * (accum + 1): (local, accum) for local, accum in SWEEP}
    if sizes is not None:
        unknown = sorted(set(sizes) - set(sweep))
        if unknown:
            raise ValueError(f"sizes {unknown} are not in the fixed sweep {sorted(sweep)}")
        sweep = {total: split for total, split in sweep.items() if total in sizes}
    if "fixed" in wanted:
        runs += [
            {**base, "local_bsz": local, "accum_steps": accum} for local, accum in sweep.values()
        ]
    return runs


def run(
    problem: str,
    seeds: Sequence[int],
    quick: bool = False,
    *,
    jobs: int = 1,
    log: Path | None = None,
    kinds: str = "adaptive,fixed",
    to_cap: bool = False,
    overrides: dict[str, Any] | None = None,
    sizes: Sequence[int] | None = None,
) -> list[dict[str, Any]]:
    """Every run of ``problem`` for every seed; each result carries label and seed.

    ``jobs`` runs launch at a time (CPU time, the primary measure, is per process;
    wall time then includes the contention). Each result is appended to ``log`` (JSON
    lines) as it arrives, so that an interrupted measurement keeps what it finished.
    """
    from concurrent.futures import ThreadPoolExecutor

    todo = [
        (seed, cfg)
        for seed in seeds
        for cfg in configs(
            problem, seed, quick, kinds=kinds, to_cap=to_cap, overrides=overrides, sizes=sizes
        )
    ]

    def one(item: tuple[int, dict[str, Any]]) -> dict[str, Any]:
        seed, cfg = item
        result = launch("experiments.outcome.trainer", 2, cfg, timeout=3600.0)
        result.update(label=label_of(cfg), seed=seed, problem=problem)
        if log is not None:
            with log.open("a") as f:
                f.write(json.dumps(result) + "\n")
        return result

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, todo))


def retarget(
    result: dict[str, Any], accuracy: float | None = None, excess: float | None = None
) -> dict[str, Any]:
    """``result`` as if its target had been ``accuracy`` (or the loss ``excess`` above
    the optimal one), read off its evaluations.

    Valid for any target when the run went on to its cap, and for a target no stricter
    than the run's own when it stopped there (its trajectory beyond is not known);
    raises ValueError otherwise.
    """
    cfg = result["config"]
    if (accuracy is None) == (excess is None):
        raise ValueError("give exactly one of accuracy and excess")
    stopped = cfg.get("stop_at_target", False) and result["reached"] is not None
    if accuracy is not None:
        own = cfg.get("target_accuracy")
        if own is None or (stopped and accuracy > own):
            raise ValueError(f"accuracy must be <= the run's own target {own!r}, got {accuracy!r}")

        def hit(loss: float, acc: float) -> bool:
            return acc >= accuracy
    else:
        optimal, own = cfg.get("optimal_loss"), cfg.get("target_excess")
        if optimal is None or own is None or (stopped and excess < own):  # type: ignore[operator]
            raise ValueError(f"excess must be >= the run's own target {own!r}, got {excess!r}")
        target_loss = optimal + excess

        def hit(loss: float, acc: float) -> bool:
            return loss <= target_loss

    reached = None
    for progress, samples, seconds, loss, acc, cpu in result["evals"]:
        if hit(loss, acc):
            reached = {
                "seconds": seconds,
                "cpu_seconds": cpu,
                "progress": progress,
                "samples": samples,
                "steps": sum(1 for s in result["steps"] if s[0] <= progress),
            }
            break
    target = {"target_accuracy": accuracy} if accuracy is not None else {"target_excess": excess}
    return {**result, "reached": reached, "retarget": target}


#: The configuration keys that make a problem what it is: its data and its schedule.
CALIBRATION_KEYS = (
    "data_seed",
    "train_size",
    "val_size",
    "noise",
    "length",
    "brackets",
    "max_depth",
    "progress_epochs",
    # How finely the time to the target is read off.
    "eval_every_samples",
)


def check_one_calibration(runs: Sequence[dict[str, Any]]) -> None:
    """Raise ValueError when ``runs`` were made on different calibrations of a problem.

    Times to target on different data or schedules do not compare (`SHORT` against
    `PROBLEMS`, for instance), whatever target they are read at.
    """
    # Runs logged before `data_seed` existed drew their data from their own seed.
    runs = [{**r, "config": {"data_seed": None, **r["config"]}} for r in runs]
    _shared(runs, CALIBRATION_KEYS, "on different calibrations of the problem")


#: The configuration keys that name a run's target.
TARGET_KEYS = ("target_accuracy", "target_excess")


def own_target(runs: Sequence[dict[str, Any]]) -> dict[str, float] | None:
    """The target ``runs`` were run to, or None without runs.

    Raises ValueError when they were run to different targets: their times to target
    do not compare until `retarget` reads them off at one.
    """
    return _shared(
        runs,
        TARGET_KEYS,
        "to different targets",
        "; give one to read them at (--retarget-accuracy, --retarget-excess or --auto-targets)",
    )


def _shared(
    runs: Sequence[dict[str, Any]], keys: Sequence[str], what: str, hint: str = ""
) -> dict[str, Any] | None:
    """The values of ``keys`` (those a run's configuration has) that every run shares;
    None without runs; ValueError ("runs were made ``what``: ...``hint``") otherwise."""
    seen = {tuple((key, r["config"][key]) for key in keys if key in r["config"]) for r in runs}
    if len(seen) > 1:
        raise ValueError(f"runs were made {what}: {sorted(seen, key=repr)}{hint}")
    return dict(seen.pop()) if seen else None


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
        "preconditioned": True if args.preconditioned else None,
        "smoothing": args.smoothing,
        "signal_memory": args.signal_memory,
        "signal_decision_only": True if args.signal_decision_only else None,
        "noise_match": args.noise_match,
        "floor_credit": True if args.floor_credit else None,
        "floor_target_loss": args.floor_target_loss,
    }
    return {key: value for key, value in options.items() if value is not None}


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
    parser.add_argument(
        "--preconditioned",
        action="store_true",
        help="AdamScale(preconditioned=True): the noise of Adam's preconditioned gradient",
    )
    parser.add_argument(
        "--smoothing",
        type=float,
        help="the gradient-noise estimator's smoothing instead of its default (a sweep)",
    )
    parser.add_argument(
        "--signal-memory",
        type=float,
        help="the prototype estimator whose |G|^2 is the step's gradient times the "
        "average of the earlier ones with this memory (signal_persistence)",
    )
    parser.add_argument(
        "--signal-decision-only",
        action="store_true",
        help="with --signal-memory: the product steers the batch-size decision only; "
        "the AdaScale gain keeps core's estimate",
    )
    parser.add_argument(
        "--noise-match",
        nargs="?",
        const=1.0,
        type=float,
        metavar="LEVEL",
        help="fixed sizes whose steps carry the initial batch's gradient noise per unit of "
        "progress, or LEVEL (in (0, 1]) times it (noise_match)",
    )
    parser.add_argument(
        "--floor-credit",
        action="store_true",
        help="the batch-size decision credits the noise floor a batch keeps (floor_credit)",
    )
    parser.add_argument(
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
    if args.signal_decision_only and args.signal_memory is None:
        parser.error("--signal-decision-only needs --signal-memory")
    if args.noise_match is not None and args.from_log:
        parser.error(
            "--noise-match selects the runs to make; summarise noise-matched runs with "
            "python -m experiments.outcome.noise_match"
        )
    if args.noise_match is not None and "adaptive" in args.kinds.split(","):
        parser.error("--noise-match applies to fixed sizes: give --kinds fixed")
    if args.noise_match is not None and not 0.0 < args.noise_match <= 1.0:
        parser.error(f"--noise-match LEVEL must be in (0, 1], got {args.noise_match}")
    from experiments.outcome import floor_credit

    if (wrong := floor_credit.check_options(args, PROBLEMS)) is not None:
        parser.error(wrong)
    if args.preconditioned:
        other = [p for p in args.problems.split(",") if PROBLEMS[p]["rule"] != "adamscale"]
        if other:
            parser.error(f"--preconditioned applies to AdamScale problems (dyck), not {other}")
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
                ("floor_credit", "per-step-credit", "floor_credit"),
                ("floor_target_loss", "floor-share", "floor_credit"),
            ]:
                # Their labels are core's ("fixed 256", "adaptive"): they would merge.
                values = [r["config"].get(key) for r in runs]
                if any(v is not None and v is not False for v in values):  # 0.0 is given
                    parser.error(
                        f"{problem}: the logs hold {kind} runs; summarise them with "
                        f"python -m experiments.outcome.{module}"
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
            from experiments.outcome import noise_match

            print(f"{problem}:\n{noise_match.table(noise_match.at_target(runs))}\n")
            continue
        if args.floor_credit or args.floor_target_loss is not None:
            # Their label is core's ("adaptive"): floor_credit's table names the decision.
            print(f"{problem}:\n{floor_credit.target_table(runs)}\n")
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
