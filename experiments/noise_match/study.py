"""Whether a large batch reaches the target early because its steps are less noisy.

Why. On shapes the fixed sweep reaches the target at less scale-invariant progress
the larger its batch (RESULTS.md item 4: about 18.7k initial-batch steps at 16,
13.5k at 128, 10.1k at 256), so the AdaScale gain, and the goodput model's
efficiency built on the same noise scale, credit a large batch with less than it
achieves. Two accounts fit that. (a) Noise: at scale ``S = M / 16`` and gain ``r``
a step of ``M`` samples moves as far as ``r`` initial-batch steps in expectation
(AdaScale's premise), but carries ``r / S`` of their gradient noise per unit of
progress; near a target set by the noise floor, less noise is worth progress the
gain does not count. (b) Drift: one large step at ``r`` times the rate moves
further than ``r`` small ones (the gain's expansion is wrong about the mean, e.g.
through momentum or curvature).

How. `time_to_target --noise-match` trains a fixed size with one change: before each
optimiser step, the averaged gradient ``g_M`` becomes ``g_M + k (g_m - g_M)``, where
``g_m`` is the gradient of the mean loss over ``m = 16`` of the batch's own samples
(the first ``m / replicas`` of each replica's, averaged over the replicas) and ``k``
(`extra_noise_weight`) gives the step the covariance ``Sigma / (r m)``: per unit of
progress, the initial batch's noise. Its mean is unchanged and so are the gain, the
rate and the progress (the estimator reads the gradients before the change). If the
matched run needs the initial size's progress to reach the target, (a) is the
account; if it keeps the plain run's, (b).

``--noise-match LEVEL`` asks for LEVEL (in (0, 1]) times that noise instead.

    python -m experiments.time_to_target --problems shapes --kinds fixed \
        --sizes 128,256 --noise-match --seed-list 0,1,2 --out out/nm/matched
    python -m experiments.time_to_target --problems shapes --kinds fixed \
        --sizes 16,128,256 --seed-list 0,1,2 --out out/nm/plain
    python -m experiments.noise_match out/nm/matched/time_to_target.jsonl \
        out/nm/plain/time_to_target.jsonl --levels 0.5,0.7,0.8,0.86

The summary takes the runs of one calibration and target per problem (it refuses a
mix) and counts a run that missed the target as infinitely late.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from experiments.harness.noisematch import check_config, extra_noise_weight, match_noise
from experiments.harness.runs import (
    check_one_calibration,
    level_of,
    name_of,
    own_target,
    retarget,
    total_of,
)

# Re-exported: the mechanism lives in the harness, which the trainer applies.
__all__ = ["check_config", "extra_noise_weight", "level_of", "match_noise", "name_of"]


def _size(run: dict[str, Any]) -> int:
    return total_of(run["config"], run.get("replicas", 2))


def _at(run: dict[str, Any], key: str) -> float:
    """``key`` of the run's ``reached`` record; infinite for a run that missed."""
    return float(run["reached"][key]) if run["reached"] is not None else math.inf


def _mean_gain(run: dict[str, Any]) -> float:
    """The mean AdaScale gain of the run's steps up to its target (all of them if missed)."""
    steps = run["steps"]
    count = run["reached"]["steps"] if run["reached"] is not None else len(steps)
    return float(np.mean([s[4] for s in steps[:count]])) if count else math.nan


def _over(top: float, bottom: float) -> float:
    """``top / bottom``; NaN where ``bottom`` is 0 (a record without it)."""
    return top / bottom if bottom else math.nan


def _median(values: Sequence[float]) -> float:
    return float(np.median(values)) if len(values) else math.nan


def at_target(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per kind of run (its size and `level_of`), medians over its seeds, a run that
    missed the target counting as infinitely late: the progress, samples and CPU
    seconds at the target (``progress``, ``samples``, ``cpu_seconds``), the mean gain
    to it (``gain``), and per seed, in seed order, against that seed's run at the
    smallest plain size (where it reached the target): the progress over its
    (``ratios``, median ``ratio``) and its samples over these (``efficiencies``,
    median ``efficiency``); for a matched kind also the progress over the plain run
    of its size and seed (``over_plain``)."""
    plain = {(r["seed"], _size(r)): r for r in runs if not level_of(r)}
    smallest = min((size for _, size in plain), default=None)
    groups: dict[tuple[int, float], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((_size(r), level_of(r)), []).append(r)
    rows = []
    for (size, level), group in sorted(groups.items()):
        group = sorted(group, key=lambda r: r["seed"])
        bases = [plain.get((r["seed"], smallest)) for r in group]
        paired = [(r, b) for r, b in zip(group, bases, strict=True) if b and b["reached"]]
        ratios = [_over(_at(r, "progress"), _at(b, "progress")) for r, b in paired]
        efficiencies = [_over(_at(b, "samples"), _at(r, "samples")) for r, b in paired]
        over_plain = []
        if level:
            for r in group:
                p = plain.get((r["seed"], size))
                if p is not None and p["reached"] is not None:
                    over_plain.append(_over(_at(r, "progress"), _at(p, "progress")))
        rows.append(
            {
                "size": size,
                "level": level,
                "seeds": [r["seed"] for r in group],
                "reached": sum(r["reached"] is not None for r in group),
                "progress": _median([_at(r, "progress") for r in group]),
                "samples": _median([_at(r, "samples") for r in group]),
                "cpu_seconds": _median([_at(r, "cpu_seconds") for r in group]),
                "gain": _median([_mean_gain(r) for r in group]),
                "ratios": ratios,
                "ratio": _median(ratios),
                "efficiencies": efficiencies,
                "efficiency": _median(efficiencies),
                "over_plain": over_plain,
            }
        )
    return rows


def _num(x: float, digits: int) -> str:
    return "miss" if math.isinf(x) else f"{x:.{digits}f}"


def _each(values: Sequence[float]) -> str:
    """'median (each, ...)' of per-seed values, or '-' without any."""
    if not values:
        return "-"
    return f"{_num(_median(values), 2)} ({', '.join(_num(x, 2) for x in values)})"


def table(rows: Sequence[dict[str, Any]]) -> str:
    """`at_target`'s rows as a Markdown table."""
    lines = [
        "| run | seeds (reached) | progress at target (median) | over the smallest plain "
        "size's, per seed: median (each) | over the plain run of its size, per seed | "
        "mean gain to target (median) | samples (median) | samples of the smallest plain "
        "size over these, per seed | CPU s (median) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        seeds = ",".join(str(s) for s in r["seeds"])
        lines.append(
            f"| {name_of(r['size'], r['level'])} | {seeds} ({r['reached']}) | "
            f"{_num(r['progress'], 0)} | {_each(r['ratios'])} | {_each(r['over_plain'])} | "
            f"{r['gain']:.2f} | {_num(r['samples'], 0)} | {_each(r['efficiencies'])} | "
            f"{_num(r['cpu_seconds'], 1)} |"
        )
    return "\n".join(lines)


def level_table(runs: Sequence[dict[str, Any]], levels: Sequence[float]) -> str:
    """Per kind of run and level: the median over seeds of the progress at which it
    first reached the level (read off its evaluations, `time_to_target.retarget`: an
    accuracy, or for a loss target the excess over the optimal loss) over that seed's
    smallest plain size's."""
    key = "accuracy" if "target_accuracy" in runs[0]["config"] else "excess"
    columns = []
    for level in levels:
        rows = at_target([retarget(r, **{key: level}) for r in runs])
        columns.append({(r["size"], r["level"]): r["ratio"] for r in rows})
    lines = [
        "| progress to the level over the smallest plain size's, per seed (median) | "
        + " | ".join(f"{level:g}" for level in levels)
        + " |",
        "|---" * (len(levels) + 1) + "|",
    ]
    for size, level in sorted(columns[0]):
        cells = " | ".join(_num(c.get((size, level), math.nan), 2) for c in columns)
        lines.append(f"| {name_of(size, level)} | {cells} |")
    return "\n".join(lines)


def along_table(runs: Sequence[dict[str, Any]], edges: Sequence[float]) -> str:
    """Core's |G|^2, tr(Sigma) and their ratio along each kind of run: per kind and
    progress bin (between consecutive ``edges``), the median over seeds of each run's
    mean over the trainer's ``noise`` records in the bin."""
    cells: dict[tuple[int, float], list[list[tuple[float, float]]]] = {}
    for r in runs:
        noise = np.asarray(r["noise"], dtype=float).reshape(-1, 5)
        row = []
        for lo, hi in itertools.pairwise(edges):
            inside = noise[(noise[:, 0] >= lo) & (noise[:, 0] < hi)]
            row.append(
                (float(inside[:, 2].mean()), float(inside[:, 3].mean()))
                if len(inside)
                else (math.nan, math.nan)
            )
        cells.setdefault((_size(r), level_of(r)), []).append(row)
    bins = [f"{lo / 1000:g}k-{hi / 1000:g}k" for lo, hi in itertools.pairwise(edges)]
    lines = [
        "| run: |G|^2 / tr(Sigma) / noise scale, by progress | " + " | ".join(bins) + " |",
        "|---" * (len(bins) + 1) + "|",
    ]
    for (size, level), rows in sorted(cells.items()):
        values = np.asarray(rows)  # seeds x bins x (|G|^2, tr(Sigma))
        text = []
        for column in range(values.shape[1]):
            sqr, var = values[:, column, 0], values[:, column, 1]
            if not np.isfinite(sqr).any():
                text.append("- / - / -")
                continue
            g, v = float(np.nanmedian(sqr)), float(np.nanmedian(var))
            text.append(f"{g:.2f} / {v:.0f} / {v / g:.0f}")
        lines.append(f"| {name_of(size, level)} | " + " | ".join(text) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path, help="time_to_target JSON-lines logs")
    parser.add_argument(
        "--levels",
        help="comma-separated levels (accuracies, or losses above the optimal one) to read "
        "the progress at, no stricter than the runs' target",
    )
    parser.add_argument(
        "--along",
        help="comma-separated progress edges of the bins in which to read the runs' noise "
        "statistics",
    )
    args = parser.parse_args(argv)
    runs = [json.loads(line) for p in args.logs for line in p.read_text().splitlines() if line]
    fixed = [r for r in runs if not r["config"].get("autoscale")]
    rows = []
    for problem in sorted({r["problem"] for r in fixed}):
        mine = [r for r in fixed if r["problem"] == problem]
        try:
            # Matched and plain runs compare only on one calibration and one target.
            check_one_calibration(mine)
            own_target(mine)
        except ValueError as err:
            parser.error(f"{problem}: {err}")
        print(f"{problem}:")
        problem_rows = at_target(mine)
        print(table(problem_rows))
        if args.levels:
            print()
            print(level_table(mine, [float(x) for x in args.levels.split(",")]))
        if args.along:
            print()
            print(along_table(mine, [float(x) for x in args.along.split(",")]))
        print()
        rows += [{"problem": problem, **row} for row in problem_rows]
    return rows


if __name__ == "__main__":
    main()
