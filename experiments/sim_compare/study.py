"""Simulated against real: item 4's time-to-target comparison replayed from measured profiles.

For each problem and seed of a directory of `time_to_target` runs, what the runs
measured (`measured_profile`: the throughput model the adaptive run's profiler
fitted, or one refitted to the recorded step times; the gradient-noise statistics
the estimators held over progress, the adaptive run's or each fixed run's at its
batch size; see `application`) becomes one simulator application
(`adaptdl.sim.profiled.ProfiledApplication`). Every run of that problem and seed is
then simulated with it through the real core, on the same replicas (one node),
initial batch size and local bounds, with the same scaling rule: the adaptive run
by core's own decision up to the same maximum, each fixed run at its (local batch,
accumulation steps). Each simulation runs

* to the run's **own** target progress: the scale-invariant progress at which the
  real run reached its target (its final progress if it missed); this isolates the
  throughput model and the decisions;
* to the **common** progress: the median over the problem and seed of the progress
  at target; this is the simulator's own prediction, which takes progress as
  scale-invariant (a target is the same progress at every batch size).

The table puts the real CPU and wall seconds to target beside the simulated seconds,
and the ratios best fixed / adaptive and initial / adaptive of each (the best fixed
size chosen in hindsight by each column itself). The profile check line gives, for
each configuration the real runs used, the model's step time over the mean measured
one: what the simulated seconds inherit.

    python -m experiments.sim_compare out/outcome [--out DIR] [--perf cpu]
        [--noise sweep]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from experiments.sim_compare import measured_profile as mp

from adaptdl.core.stats.scaling import AdamScale, AdaScale, LinearScale, ScalingRule
from adaptdl.sim.profiled import ProfiledApplication, simulate_to_progress

RULES: dict[str, type[AdaScale] | type[AdamScale] | type[LinearScale]] = {
    "adascale": AdaScale,
    "adamscale": AdamScale,
    "linear": LinearScale,
}


def load_runs(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """The results in JSON-lines logs, JSON lists, or directories holding either.

    A directory is searched (recursively) for ``time_to_target.jsonl``, and where a
    folder has none, for ``time_to_target.json``.
    """
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            logs = sorted(path.rglob("time_to_target.jsonl"))
            folders = {p.parent for p in logs}
            lists = [
                p for p in sorted(path.rglob("time_to_target.json")) if p.parent not in folders
            ]
            files += logs + lists
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"paths: no file or directory {str(path)!r}")
    runs: list[dict[str, Any]] = []
    for file in files:
        text = file.read_text()
        if file.suffix == ".jsonl":
            runs += [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            data = json.loads(text)
            runs += data if isinstance(data, list) else [data]
    return runs


def split_of(result: dict[str, Any]) -> tuple[int, int] | None:
    """None for an adaptive run, else its fixed (local batch, accumulation steps)."""
    cfg = result["config"]
    return None if cfg.get("autoscale") else (int(cfg["local_bsz"]), int(cfg["accum_steps"]))


#: Where the throughput model comes from (``--perf``).
PERF_SOURCES = ("profiler", "steps", "cpu")
#: Where the gradient statistics come from (``--noise``).
NOISE_SOURCES = ("adaptive", "sweep")
#: Points of progress at which the sweep's statistics are resampled to one grid.
SWEEP_POINTS = 256


def application(
    runs: Sequence[dict[str, Any]],
    target_progress: float,
    perf: str = "profiler",
    noise: str = "adaptive",
) -> tuple[ProfiledApplication, dict[str, Any]]:
    """The application model of the runs of one problem and seed, and what it was made of.

    ``noise``: "adaptive" takes the adaptive run's gradient statistics at every batch
    size (the goodput model's own assumption); "sweep" takes each fixed run's at its
    batch size, linear in the batch size in between (the trace model's rule), and
    needs two fixed runs at least, each with the estimator's recorded statistics.
    ``perf``: "profiler" takes the fit of the adaptive run's job profiler where the
    run recorded it (else as "steps"); "steps" refits the adaptive run's recorded
    step times (wall seconds, evaluation excluded); "cpu" refits the step times of
    all ``runs`` (of one replica count) in CPU seconds
    (`measured_profile.cpu_step_times`), the
    unit of the primary measure.
    """
    if perf not in PERF_SOURCES:
        raise ValueError(f"perf must be one of {PERF_SOURCES}, got {perf!r}")
    if noise not in NOISE_SOURCES:
        raise ValueError(f"noise must be one of {NOISE_SOURCES}, got {noise!r}")
    profile_run = next((r for r in runs if split_of(r) is None), None)
    if profile_run is None:
        raise ValueError("runs must include the adaptive run, whose profile the model takes")
    cfg = profile_run["config"]
    replicas = int(profile_run["replicas"])
    params = mp.profiler_params(profile_run) if perf == "profiler" else None
    perf_source = "profiler"
    if perf == "cpu":
        counts = sorted({int(r["replicas"]) for r in runs})
        if len(counts) > 1:
            # One fit takes one replica count: pooled steps of others would bias it.
            raise ValueError(
                f"perf 'cpu' pools the step times of all runs, which must share one replica "
                f"count; got replicas {counts}"
            )
        pooled: dict[tuple[int, int], list[float]] = {}
        for run in runs:
            for key, values in mp.cpu_step_times(run).items():
                pooled.setdefault(key, []).extend(values)
        params = mp.fit_step_times(pooled, replicas)
        perf_source = "cpu"
    elif params is None:
        params = mp.fit_step_times(mp.step_times(profile_run), replicas)
        perf_source = "steps"
    if noise == "sweep":
        curves = {_total(r): mp.noise_curve(r) for r in runs if split_of(r) is not None}
        measured = {total: c for total, c in sorted(curves.items()) if c is not None}
        if len(measured) < 2:
            raise ValueError(f"noise 'sweep' needs 2 fixed runs with statistics, got {curves}")
        implied = [total for total, c in measured.items() if c.source != "estimator"]
        if implied:
            # Statistics implied by gains take |G|^2 as 1 (only the ratio is known),
            # the estimator's are absolute: rows of both are not comparable.
            raise ValueError(
                f"noise 'sweep' needs the estimator's recorded statistics ('noise') of every "
                f"fixed run; the runs at total batch sizes {implied} have only gains"
            )
        end = max(float(c.progress[-1]) for c in measured.values())
        grid = np.linspace(0.0, end, SWEEP_POINTS)
        stats = [mp.resample(c, grid) for c in measured.values()]
        sizes: list[int] | None = list(measured)
        progress, sqr, var = grid, np.array([s for s, _ in stats]), np.array([v for _, v in stats])
        noise_source = "sweep " + ", ".join(map(str, measured))
        sources = {c.source for c in measured.values()}
    else:
        curve = mp.noise_curve(profile_run)
        if curve is None:
            raise ValueError(f"run {profile_run.get('label')!r} recorded no gradient statistics")
        sizes, progress, sqr, var = None, curve.progress, curve.sqr, curve.var
        noise_source, sources = "adaptive", {curve.source}
    bounds = cfg.get("local_bsz_bounds") or [1, cfg["train_size"]]
    app = ProfiledApplication(
        f"{profile_run.get('problem', cfg['problem'])}-{cfg['seed']}",
        params,
        progress,
        sqr,
        var,
        init_batch_size=int(cfg["init_batch_size"]),
        max_batch_size=int(cfg.get("max_batch_size") or cfg["init_batch_size"]),
        local_bsz_bounds=(int(bounds[0]), int(bounds[1])),
        dataset_size=int(cfg["train_size"]),
        target_progress=target_progress,
        batch_sizes=sizes,
    )
    made = {
        "profile_run": profile_run.get("label"),
        "perf_source": perf_source,
        "perf_params": params.to_dict(),
        "noise_source": noise_source,
        "noise_recorded_as": sorted(sources),
        "noise_points": len(progress),
    }
    return app, made


@attrs.frozen
class Options:
    """How to compare: the model's sources (``perf``, ``noise``: see `application`) and
    laxer targets read off the evaluations (``accuracy``; ``loss_excess`` over the
    optimal loss), None: each run's own."""

    perf: str = "profiler"
    noise: str = "adaptive"
    accuracy: float | None = None
    loss_excess: float | None = None


def compare_group(runs: Sequence[dict[str, Any]], options: Options = Options()) -> dict[str, Any]:
    """Real against simulated time to target for the runs of one problem and seed."""
    accuracy, loss_excess = options.accuracy, options.loss_excess
    if not any(split_of(r) is None for r in runs):
        raise ValueError("runs must include the adaptive run, whose profile the model takes")
    rows = []
    for run in runs:
        loss = None
        if loss_excess is not None and "optimal_loss" in run["config"]:
            loss = run["config"]["optimal_loss"] + loss_excess
        reached = mp.reached_at(run, accuracy=accuracy, loss=loss)
        own = reached["progress"] if reached else float(run["progress"])
        real = reached or {
            "cpu_seconds": run["train_cpu_seconds"],
            "seconds": run["train_seconds"],
        }
        rows.append(
            {
                "label": run["label"],
                "total": _total(run),
                "reached": reached is not None,
                "target_progress": own,
                "real_cpu": float(real["cpu_seconds"]),
                "real_wall": float(real["seconds"]),
            }
        )
    done = [row["target_progress"] for row in rows if row["reached"]]
    common = float(np.median(done)) if done else max(row["target_progress"] for row in rows)
    top = max(common, *(row["target_progress"] for row in rows))
    app, made = application(runs, top, options.perf, options.noise)
    for run, row in zip(runs, rows, strict=True):
        rule: ScalingRule = RULES[run["config"].get("rule", "adascale")]()
        replicas, split = int(run["replicas"]), split_of(run)
        own = row["target_progress"]
        targets = sorted({own, common})
        sim = simulate_to_progress(app, targets, replicas=replicas, split=split, rule=rule)
        at = {target: i for i, target in enumerate(targets)}
        trajectory = sim.trajectory_until(own)
        reached_steps = [s for s in run["steps"] if s[0] <= own]
        row.update(
            sim_own=sim.seconds_at[at[own]],
            sim_common=sim.seconds_at[at[common]],
            sim_batches=sorted({t[2] for t in trajectory}),
            sim_steps=sim.steps_at[at[own]],
            real_steps=len(reached_steps),
            real_batches=sorted({int(s[1]) for s in reached_steps}),
            real_final_batch=int(reached_steps[-1][1]) if reached_steps else 0,
            sim_final_batch=int(trajectory[-1][2]),
        )
        if split_of(run) is None:
            # (seconds, progress, total, local, accumulation) at each change.
            row["sim_trajectory"] = [list(t) for t in trajectory]
    return {
        "common_progress": common,
        "model": made,
        "rows": rows,
        "ratios": {
            key: ratios(rows, key, int(runs[0]["config"]["init_batch_size"]))
            for key in ("real_cpu", "real_wall", "sim_own", "sim_common")
        },
        "profile_check": profile_check(app, runs, cpu=made["perf_source"] == "cpu"),
    }


def ratios(rows: Sequence[dict[str, Any]], key: str, init_batch_size: int) -> dict[str, Any]:
    """Best fixed / adaptive and initial / adaptive of column ``key`` (None: undefined).

    The best fixed run is the one with the smallest value of that column among the
    fixed runs that reached their target; the initial one is the fixed run at
    ``init_batch_size``; a ratio above 1 means adaptive was faster.
    """
    adaptive = next(row for row in rows if row["total"] == 0)
    fixed = [row for row in rows if row["total"] and row["reached"]]
    best = min(fixed, key=lambda row: row[key]) if fixed else None
    initial = next((row for row in rows if row["total"] == init_batch_size), None)
    usable = adaptive["reached"] and adaptive[key] > 0
    return {
        "best_fixed": best["label"] if best else None,
        "best": best[key] / adaptive[key] if best and usable else None,
        "initial": initial[key] / adaptive[key] if initial and usable else None,
    }


def profile_check(
    app: ProfiledApplication, runs: Sequence[dict[str, Any]], *, cpu: bool = False
) -> dict[str, dict[str, float]]:
    """Per run: the model's step time over the run's mean measured one, per configuration.

    Keyed by run label, then "total=local x micro-batches"; ``cpu``: against the
    steps in CPU seconds. Far from 1 on the run the model was fitted to: the fit is
    poor; on another run only: that run ran under other load (or the fit
    extrapolates to its configuration).
    """
    out: dict[str, dict[str, float]] = {}
    for run in runs:
        times = mp.cpu_step_times(run) if cpu else mp.step_times(run)
        replicas = int(run["replicas"])
        checks = out.setdefault(run["label"], {})
        for (local, accum), values in sorted(times.items()):
            model = app.iteration_time((replicas,), local, accum)[0]
            checks[f"{replicas * local * (accum + 1)}={local}x{accum + 1}"] = model / float(
                np.mean(values)
            )
    return out


def table(problem: str, groups: dict[int, dict[str, Any]]) -> str:
    """A markdown table of one problem: medians over seeds, per run label."""
    labels = list(dict.fromkeys(row["label"] for g in groups.values() for row in g["rows"]))
    lines = [
        f"| {problem}: run | real CPU s | real wall s | sim s, own progress | sim s, common "
        "progress | progress at target | batch sizes (at target): real / sim |",
        "|---|---|---|---|---|---|---|",
    ]
    for label in labels:
        rows = [row for g in groups.values() for row in g["rows"] if row["label"] == label]
        missed = "" if all(row["reached"] for row in rows) else " (missed: >=)"

        def med(key: str, rows: list[dict[str, Any]] = rows) -> float:
            return float(np.median([row[key] for row in rows]))

        sizes = sorted({b for row in rows for b in row["sim_batches"]})
        real = sorted({b for row in rows for b in row["real_batches"]}) or [0]
        finals = [
            ",".join(str(b) for b in sorted({row[key] for row in rows}))
            for key in ("real_final_batch", "sim_final_batch")
        ]
        lines.append(
            f"| {label} | {med('real_cpu'):.1f}{missed} | {med('real_wall'):.1f} | "
            f"{med('sim_own'):.1f} | {med('sim_common'):.1f} | {med('target_progress'):.0f} | "
            f"{real[0]}..{real[-1]} ({finals[0]}) / {sizes[0]}..{sizes[-1]} ({finals[1]}) |"
        )
    lines.append("")
    for key, name in (
        ("real_cpu", "real CPU"),
        ("real_wall", "real wall"),
        ("sim_own", "sim, own progress"),
        ("sim_common", "sim, common progress"),
    ):
        per_seed = [g["ratios"][key] for g in groups.values()]
        best = _median_ratio([r["best"] for r in per_seed])
        initial = _median_ratio([r["initial"] for r in per_seed])
        chosen = ", ".join(sorted({str(r["best_fixed"]) for r in per_seed}))
        lines.append(
            f"* {name}: best fixed ({chosen}) / adaptive = {best}; initial / adaptive = {initial}"
        )
    for seed, g in sorted(groups.items()):
        model = g["model"]
        check = "; ".join(
            f"{label} " + ", ".join(f"{k}: {v:.2f}" for k, v in checks.items())
            for label, checks in g["profile_check"].items()
        )
        lines.append(
            f"* seed {seed}: throughput model: {model['perf_source']} fit; gradient statistics:"
            f" {model['noise_source']} ({'/'.join(model['noise_recorded_as'])}, "
            f"{model['noise_points']} points); "
            f"model / measured step time per run and total=local x micro-batches: {check}"
        )
    return "\n".join(lines)


def _median_ratio(values: Sequence[float | None]) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "n/a"
    text = f"{float(np.median(known)):.2f}"
    return text if len(known) == len(values) else f"{text} ({len(known)}/{len(values)} seeds)"


def compare(
    runs: Sequence[dict[str, Any]], options: Options = Options()
) -> dict[str, dict[int, dict[str, Any]]]:
    """`compare_group` for every problem and seed that has an adaptive run."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    keys = sorted({(r["problem"], int(r["seed"])) for r in runs})
    for problem, seed in keys:
        group = [r for r in runs if r["problem"] == problem and int(r["seed"]) == seed]
        if not any(split_of(r) is None for r in group):
            continue  # no measured adaptive profile for this seed
        labels = [r["label"] for r in group]
        twice = sorted({label for label in labels if labels.count(label) > 1})
        if twice:
            raise ValueError(
                f"runs hold {problem} seed {seed} {twice} more than once (two measurements "
                "in the paths?); pass the logs of one measurement, or --problems"
            )
        group.sort(key=lambda r: (split_of(r) is not None, _total(r)))
        out.setdefault(problem, {})[seed] = compare_group(group, options)
    return out


def _total(result: dict[str, Any]) -> int:
    split = split_of(result)
    return 0 if split is None else int(result["replicas"]) * split[0] * (split[1] + 1)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Compare, print one table per problem, write ``sim_compare.json`` (and ``.md``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path, help="run logs or directories of them")
    parser.add_argument("--out", type=Path, help="where to write sim_compare.json/.md")
    parser.add_argument(
        "--perf",
        default="profiler",
        choices=PERF_SOURCES,
        help="throughput model (see application)",
    )
    parser.add_argument(
        "--noise", default="adaptive", choices=NOISE_SOURCES, help="gradient statistics"
    )
    parser.add_argument("--problems", help="comma-separated; default: every problem found")
    parser.add_argument("--target-accuracy", type=float, help="laxer accuracy target (shapes)")
    parser.add_argument("--target-excess", type=float, help="laxer loss excess target (dyck)")
    args = parser.parse_args(argv)
    runs = load_runs(args.paths)
    if args.problems:
        wanted = set(args.problems.split(","))
        runs = [r for r in runs if r["problem"] in wanted]
    options = Options(args.perf, args.noise, args.target_accuracy, args.target_excess)
    result = compare(runs, options)
    text = "\n\n".join(table(problem, groups) for problem, groups in result.items())
    print(text)
    out = args.out or (args.paths[0] if args.paths[0].is_dir() else args.paths[0].parent)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim_compare.json").write_text(json.dumps(result, indent=1))
    (out / "sim_compare.md").write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
