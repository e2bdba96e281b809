"""Runs of the time-to-target problems: their calibrations, configs, launches and targets.

What every study of training to a target shares (`time_to_target`, `loss_floor`,
`noise_match`): the problems as calibrated now (`PROBLEMS`) and at first (`SHORT`),
the adaptive settings and the fixed sweep (`configs`), the launch of each run as a
torchrun job of `experiments.harness.trainer` (`run`), and reading a logged run at
another target (`retarget`, `own_target`, `check_one_calibration`). A run's label
names its size; `level_of` and `name_of` name a noise-matched one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments.harness.launch import launch
from experiments.harness.trainer import DYCK, SHAPES

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
        result = launch("experiments.harness.trainer", 2, cfg, timeout=3600.0)
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


def level_of(run: dict[str, Any]) -> float:
    """The run's ``noise_match`` level: 0 for a plain run, 1 for ``True`` (older logs)."""
    return float(run["config"].get("noise_match") or 0.0)


def name_of(size: int, level: float) -> str:
    """'fixed 256', 'fixed 256, noise matched' (level 1) or 'fixed 256, noise at 0.5'."""
    if level == 0.0:
        return f"fixed {size}"
    return f"fixed {size}, " + ("noise matched" if level == 1.0 else f"noise at {level:g}")
