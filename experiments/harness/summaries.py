"""Summaries of time-to-target runs: medians and pairs by seed, the model against the
sweep, decisions and phases, and their markdown tables (`time_to_target` prints them).

Every function reads the runs' results as `time_to_target` logs them: a ``label``
("adaptive" or "fixed <total>"), a ``seed``, ``reached`` (the first evaluation at the
target: CPU and wall seconds, samples, progress, steps; None when missed) and the
run's ``steps``, ``evals``, ``noise`` and ``decisions``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np


def summarise(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per label: median and range of CPU and wall time to the target over seeds."""
    labels = list(dict.fromkeys(r["label"] for r in results))
    rows = []
    for label in labels:
        runs = [r for r in results if r["label"] == label]
        reached = [r["reached"] for r in runs if r["reached"] is not None]
        # A run that misses counts as its whole training time (a lower bound).
        cpu_all = with_misses(runs, "cpu_seconds", "train_cpu_seconds")
        wall_all = with_misses(runs, "seconds", "train_seconds")
        cpu = [x["cpu_seconds"] for x in reached]
        wall = [x["seconds"] for x in reached]
        # The sizes used until the target (a run that went on to its cap used more).
        batches = [
            int(s[1])
            for r in runs
            for s in r["steps"]
            if r["reached"] is None or s[0] <= r["reached"].get("progress", math.inf)
        ]
        rows.append(
            {
                "label": label,
                "runs": len(runs),
                "reached": len(reached),
                "cpu": cpu,
                "wall": wall,
                "cpu_all": cpu_all,
                "wall_all": wall_all,
                "cpu_median": float(np.median(cpu_all)),
                "wall_median": float(np.median(wall_all)),
                "samples_median": float(np.median([x["samples"] for x in reached]))
                if reached
                else None,
                "batch_range": [min(batches), max(batches)] if batches else [],
            }
        )
    fixed = [row for row in rows if row["label"] != "adaptive" and row["reached"] == row["runs"]]
    adaptive = next((row for row in rows if row["label"] == "adaptive"), None)
    best = min(fixed, key=lambda row: row["cpu_median"]) if fixed else None
    initial = next((row for row in rows if row["label"] == "fixed 16"), None)
    out: dict[str, Any] = {"rows": rows, "best_fixed": best["label"] if best else None}
    missed = adaptive is None or adaptive["reached"] < adaptive["runs"]
    for key in ("cpu", "wall"):
        a = adaptive[f"{key}_median"] if adaptive is not None else math.nan
        out[f"{key}_ratio_best"] = None if best is None or missed else best[f"{key}_median"] / a
        out[f"{key}_ratio_initial"] = (
            None if initial is None or missed else initial[f"{key}_median"] / a
        )
    if not missed:
        out["paired_best"] = paired(results, [row["label"] for row in fixed], "adaptive")
        out["paired_initial"] = paired(results, ["fixed 16"], "adaptive") if initial else None
    else:
        out["paired_best"] = out["paired_initial"] = None
    return out


#: Resamples of the seeds behind `paired`'s interval, and the interval's coverage.
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_LEVEL = 0.9


def paired(
    results: Sequence[dict[str, Any]], labels: Sequence[str], against: str
) -> dict[str, Any] | None:
    """The best of runs ``labels`` against run ``against`` in CPU time, seed by seed.

    Over the seeds ``against`` ran, among the ``labels`` that ran every one of them,
    the best is the one with the smallest median CPU time, chosen in hindsight as in
    `summarise`. Returns its ``label``, the ``seeds``, each seed's ratio of its time
    over ``against``'s (``ratios``), how many favour ``against`` (ratio above 1,
    ``wins``), and a percentile bootstrap interval (``interval``, `BOOTSTRAP_LEVEL`)
    of the ratio of the medians that resamples seeds with all their runs and chooses
    the best again in each resample (None under 3 seeds). A missed target counts at
    the run's whole time, as in the medians. None when no label ran every seed.

    The interval says how far the ratio could move with other seeds; it is crude at 3
    to 6 seeds and blind to anything the seeds share (one machine, one session).
    """
    times: dict[str, dict[int, float]] = {}
    for r in results:
        if r["label"] in (*labels, against):
            runs = times.setdefault(r["label"], {})
            if r["seed"] in runs:
                raise ValueError(f"results hold two runs of {r['label']!r} at seed {r['seed']}")
            runs[r["seed"]] = with_misses([r], "cpu_seconds", "train_cpu_seconds")[0]
    seeds = sorted(times.get(against, {}))
    full = [label for label in labels if seeds and set(seeds) <= set(times.get(label, {}))]
    if not full:
        return None
    bottom = np.array([times[against][s] for s in seeds])
    tops = np.array([[times[label][s] for s in seeds] for label in full])
    best = int(np.argmin(np.median(tops, axis=1)))
    interval = None
    if len(seeds) >= 3:
        gen = np.random.default_rng(0)
        pick = gen.integers(0, len(seeds), size=(BOOTSTRAP_RESAMPLES, len(seeds)))
        # (resample, label): each resample's medians; the best label chosen again in each.
        medians = np.median(tops[:, pick], axis=2).T
        ratios = medians.min(axis=1) / np.median(bottom[pick], axis=1)
        tail = (1.0 - BOOTSTRAP_LEVEL) / 2.0
        interval = [float(x) for x in np.quantile(ratios, [tail, 1.0 - tail])]
    per_seed = (tops[best] / bottom).tolist()
    return {
        "label": full[best],
        "seeds": seeds,
        "ratios": per_seed,
        "wins": sum(x > 1.0 for x in per_seed),
        "interval": interval,
    }


def with_misses(runs: Sequence[dict[str, Any]], key: str, total: str) -> list[float]:
    """Each run's time to the target, or its whole training time where it missed."""
    return [float(r["reached"][key] if r["reached"] is not None else r[total]) for r in runs]


def model_vs_measured(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per fixed size: what the runs measured against what the adaptive runs' model said.

    Measured (medians over seeds, runs that reached the target): samples to the
    target, statistical efficiency (the fixed-16 samples over these), CPU throughput
    relative to fixed 16, and the noise scale tr(Sigma) / |G|^2 that the run's own
    estimator held when it reached the target. Modelled (medians over the adaptive
    runs, at their last decision before the target): the efficiency of that total and
    its throughput relative to 16 (`trainer.DecisionLog`).
    """
    fixed = [r for r in results if r["label"] != "adaptive" and r["reached"] is not None]
    adaptive = [r for r in results if r["label"] == "adaptive"]

    def median(values: list[float]) -> float | None:
        return float(np.median(values)) if values else None

    base = median([r["reached"]["samples"] for r in fixed if r["label"] == "fixed 16"])
    base_speed = median(
        [
            r["reached"]["samples"] / r["reached"]["cpu_seconds"]
            for r in fixed
            if r["label"] == "fixed 16"
        ]
    )
    modelled: dict[int, list[tuple[float, float]]] = {}
    for r in adaptive:
        last = decision_at_target(r)
        if last is None:
            continue
        rows = {int(c[0]): c for c in last["candidates"]}
        for total, (_, speed, eff) in rows.items():
            modelled.setdefault(total, []).append((eff, speed / rows[16][1]))
    out = []
    for total in sorted({int(r["label"].split()[-1]) for r in fixed}):
        runs = [r for r in fixed if r["label"] == f"fixed {total}"]
        samples = median([r["reached"]["samples"] for r in runs])
        speed = median([r["reached"]["samples"] / r["reached"]["cpu_seconds"] for r in runs])
        noise = []
        for r in runs:
            rows = [n for n in r.get("noise", []) if n[0] <= r["reached"]["progress"]]
            if rows and rows[-1][2] > 0:
                noise.append(rows[-1][3] / rows[-1][2])
        model = modelled.get(total, [])
        out.append(
            {
                "total": total,
                "runs": len(runs),
                "samples": samples,
                "efficiency": base / samples if base and samples else None,
                "speedup": speed / base_speed if speed and base_speed else None,
                "noise_scale": median(noise),
                "model_efficiency": median([m[0] for m in model]),
                "model_speedup": median([m[1] for m in model]),
            }
        )
    return out


def decision_at_target(run: dict[str, Any]) -> dict[str, Any] | None:
    """The adaptive ``run``'s last decision (with candidates) before its target.

    Decisions logged with the job's progress are placed by it. Older logs have only
    the decision clock, which counts evaluations where the time to target does not:
    a run that stopped at this target made every decision before it, so its last
    one is taken; otherwise the last one the clock places before the target (which
    may be early by the evaluations' time). A run that missed gives its last
    decision; None without decisions.
    """
    decisions = [d for d in run.get("decisions", []) if "candidates" in d]
    reached = run.get("reached")
    if not decisions or reached is None:
        return decisions[-1] if decisions else None
    if all("progress" in d for d in decisions):
        before = [d for d in decisions if d["progress"] <= reached["progress"]]
        return before[-1] if before else decisions[0]
    if run.get("config", {}).get("stop_at_target") and reached["samples"] == run.get("samples"):
        return decisions[-1]
    before = [d for d in decisions if d["seconds"] <= reached["seconds"]]
    return before[-1] if before else decisions[0]


def model_table(problem: str, rows: Sequence[dict[str, Any]]) -> str:
    """The markdown table of `model_vs_measured`."""

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [
        f"| {problem}: total | runs | samples to target | efficiency measured / modelled "
        "| speed-up vs 16 measured (CPU) / modelled (wall) | noise scale at target |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['total']} | {row['runs']} | {fmt(row['samples'], '.0f')} | "
            f"{fmt(row['efficiency'], '.2f')} / {fmt(row['model_efficiency'], '.2f')} | "
            f"{fmt(row['speedup'], '.1f')} / {fmt(row['model_speedup'], '.1f')} | "
            f"{fmt(row['noise_scale'], '.0f')} |"
        )
    return "\n".join(lines)


def table(problem: str, summary: dict[str, Any], target: dict[str, float]) -> str:
    """The markdown table of one problem's `summarise`, at ``target`` (its
    ``target_accuracy`` or ``target_excess``)."""
    cfg = target
    what = (
        f"{cfg['target_accuracy']:.1%} val. accuracy"
        if "target_accuracy" in cfg
        else f"val. loss optimal + {cfg['target_excess']}"
    )
    lines = [
        f"| {problem}: run | CPU s to {what}: median [min, max] | wall s: median "
        "[min, max] | reached | samples (median) | batch sizes used |",
        "|---|---|---|---|---|---|",
    ]
    for row in summary["rows"]:
        missed = row["runs"] - row["reached"]
        cpu = _spread(row["cpu_median"], row["cpu"], row["cpu_all"], missed)
        wall = _spread(row["wall_median"], row["wall"], row["wall_all"], missed)
        samples = "-" if row["samples_median"] is None else f"{row['samples_median']:.0f}"
        lo, hi = row["batch_range"] or (0, 0)
        lines.append(
            f"| {row['label']} | {cpu} | {wall} | {row['reached']}/{row['runs']} | {samples} | "
            f"{lo}..{hi} |"
        )
    lines.append("")
    lines.append(
        f"Best fixed (hindsight, by median CPU time): {summary['best_fixed']}; "
        f"best / adaptive = {_ratio(summary['cpu_ratio_best'])} (CPU), "
        f"{_ratio(summary['wall_ratio_best'])} (wall); initial / adaptive = "
        f"{_ratio(summary['cpu_ratio_initial'])} (CPU), {_ratio(summary['wall_ratio_initial'])}"
        " (wall)"
    )
    for name in ("best", "initial"):
        pair = summary.get(f"paired_{name}")
        if pair:
            interval = pair["interval"]
            lines.append(
                f"Paired by seed, {name} ({pair['label']}) / adaptive (CPU): "
                + ", ".join(
                    f"{seed}: {ratio:.2f}"
                    for seed, ratio in zip(pair["seeds"], pair["ratios"], strict=True)
                )
                + f"; adaptive faster on {pair['wins']} of {len(pair['seeds'])}"
                + (
                    f"; {BOOTSTRAP_LEVEL:.0%} bootstrap interval of the medians' ratio "
                    f"[{interval[0]:.2f}, {interval[1]:.2f}]"
                    if interval
                    else ""
                )
            )
    return "\n".join(lines)


def _spread(median: float, reached: Sequence[float], every: Sequence[float], missed: int) -> str:
    """``median [min, max]``; with misses, over every run, a miss at its whole time.

    The median counts a missed run at its whole time (a lower bound), so the range
    does too: it then holds the median.
    """
    if not reached:
        return f">= {median:.1f} (not reached)"
    if not missed:
        return f"{median:.1f} [{min(reached):.1f}, {max(reached):.1f}]"
    return (
        f"{median:.1f} [{min(every):.1f}, {max(every):.1f}] "
        f"({missed} missed, each counted at its whole time: a lower bound)"
    )


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def decision_paths(runs: Sequence[dict[str, Any]]) -> str:
    """Each adaptive run's decisions, one line per run: ``cpu s: total (noise scale)``.

    The noise scale is the estimate's tr(Sigma) / |G|^2 in samples, then that of its
    confidence bound (``inf``: |G|^2 at or below 0, for the estimate the gradient lost
    in the noise; the bound of this rule never reads 0, that of older logs may;
    ``-``: no estimate yet). Read off the `DecisionLog` records.
    """

    def scale(pair: Sequence[float] | None) -> str:
        if not pair:
            return "-"
        return "inf" if pair[0] <= 0.0 else f"{pair[1] / pair[0]:.0f}"

    lines = []
    for r in runs:
        if r.get("label") != "adaptive" or not r.get("decisions"):
            continue
        reached = r.get("reached") or {}
        head = f"seed {r.get('seed')}: " + (
            f"reached in {reached['cpu_seconds']:.1f} CPU s" if reached else "target not reached"
        )
        steps = []
        for d in r["decisions"]:
            local, accum = d["choice"]
            total = local * r.get("replicas", 1) * (accum + 1)
            steps.append(
                f"{d['cpu_seconds']:.1f}: {total} ({scale(d.get('gns'))}/{scale(d.get('bound'))})"
            )
        lines.append(head + "\n    " + ", ".join(steps))
    return "\n".join(lines)


def phase_table(runs: Sequence[dict[str, Any]], levels: Sequence[float]) -> str:
    """Samples to each validation accuracy in ``levels``, per run label (medians over seeds).

    For each fixed total M and level: the efficiency against the initial size (its
    median samples over the fixed-16 runs'), and the noise scale B that makes
    Pollux's efficiency model (B + 16) / (B + M) equal it, B = (16 - E M) / (E - 1):
    the constant noise scale the sweep behaves as if it had up to that level. A label
    with a seed that never reached a level shows ``-`` there. Read off the
    evaluations (every ``eval_every_samples``), so a count is rounded up to one.
    """
    by_label: dict[str, list[list[float | None]]] = {}
    for r in runs:
        evals = r.get("evals") or []
        by_label.setdefault(r["label"], []).append(
            [next((float(e[1]) for e in evals if e[4] >= level), None) for level in levels]
        )

    def medians(rows: list[list[float | None]]) -> list[float | None]:
        out: list[float | None] = []
        for i in range(len(levels)):
            values = [row[i] for row in rows]
            out.append(float(np.median(values)) if None not in values else None)  # type: ignore[arg-type]
        return out

    base = medians(by_label.get("fixed 16", []))
    head = "| run | " + " | ".join(f"{level:.0%}" for level in levels) + " |"
    lines = [
        "samples (thousands) to each val. accuracy; "
        "fixed sizes: efficiency vs 16 / implied noise scale",
        head,
        "|---" * (len(levels) + 1) + "|",
    ]

    def key(label: str) -> tuple[int, int]:
        return (0, 0) if label == "adaptive" else (1, int(label.split()[-1]))

    for label in sorted(by_label, key=key):
        cells = []
        for i, value in enumerate(medians(by_label[label])):
            if value is None:
                cells.append("-")
                continue
            cell = f"{value / 1e3:.0f}"
            total = None if label == "adaptive" else int(label.split()[-1])
            if total not in (None, 16) and base and base[i]:
                eff = base[i] / value  # type: ignore[operator]
                implied = (16 - eff * total) / (eff - 1) if eff < 1 else math.inf
                cell += f" ({eff:.2f} / {implied:.0f})"
            cells.append(cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
