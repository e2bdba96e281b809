"""The loss floor study (#18, item 4's eleventh to thirteenth follow-ups): its tables.

The floor (`adaptdl.core.stats.floor`, EXPERIMENTAL in core) is run through
``report_loss`` by the trainer's ``floor`` variant:

    python -m experiments.time_to_target --problems shapes --kinds adaptive \
        --floor-target-loss horizon --seed-list S --out out/floor/horizon-S
    python -m experiments.loss_floor LOGS [--pool]     # target_table
    python -m experiments.loss_floor LOGS --gaps P,... # floor_gap_table

`target_table` compares the adaptive runs of each decision (core's rule, core's floor
share through ``report_loss``; in logs of the archive, the per-step credit) with the
fixed sizes in the logs; `floor_gap_table` sets the fixed runs' training loss gaps to
fixed 16 beside what `adaptdl.core.stats.floor.floor_level` predicts.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from experiments.harness.noisematch import extra_noise_weight
from experiments.harness.runs import check_one_calibration, level_of, name_of, own_target, total_of
from experiments.harness.summaries import paired, with_misses
from experiments.harness.trainer import cosine_lr

from adaptdl.core.stats.floor import floor_level, sgd_rate


def kind_of(run: dict[str, Any]) -> str:
    """A run's kind: adaptive (and which decision), or fixed N (and its noise level)."""

    cfg = run["config"]
    if cfg.get("floor_target_loss") is not None:
        target = cfg["floor_target_loss"]
        if target == "horizon":
            return "adaptive, floor share over the horizon"
        return f"adaptive, floor share to loss {target:g}"
    if cfg.get("floor_credit"):
        return "adaptive, per-step credit"
    if cfg.get("autoscale"):
        return "adaptive"
    return name_of(total_of(cfg, run.get("replicas", 2)), level_of(run))


def _by_kind(runs: Sequence[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for r in runs:
        seeds = out.setdefault(kind_of(r), {})
        if r["seed"] in seeds:
            raise ValueError(f"two {kind_of(r)!r} runs of seed {r['seed']} (give --pool)")
        seeds[r["seed"]] = r
    return out


def _cpu(run: dict[str, Any]) -> float:
    return with_misses([run], "cpu_seconds", "train_cpu_seconds")[0]


def pool_repeats(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One run per kind and seed: repeats become their mean (CPU time, a miss at its
    whole run's; progress and samples where every repeat reached the target). The
    pooled run keeps its first repeat's other records (steps, noise)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((kind_of(r), r["seed"]), []).append(r)
    out = []
    for repeats in groups.values():
        cpu = float(np.mean([_cpu(r) for r in repeats]))
        reached = None
        if all(r.get("reached") for r in repeats):
            reached = {
                "cpu_seconds": cpu,
                **{
                    key: float(np.mean([r["reached"][key] for r in repeats]))
                    for key in ("progress", "samples")
                },
            }
        out.append({**repeats[0], "reached": reached, "train_cpu_seconds": cpu})
    return out


def target_table(runs: Sequence[dict[str, Any]]) -> str:
    """Per kind: CPU seconds, progress and samples to the target (medians; a miss counts
    at its whole run's time). For each adaptive kind, `summaries.paired` against the
    plain fixed sizes in ``runs`` (the best by median, in hindsight): per seed their
    CPU time over the run's, the ratio of the medians and its bootstrap interval; for
    each floor decision also core's adaptive run's CPU time over its, per seed."""
    kinds = _by_kind(runs)
    fixed = [k for k in kinds if k.startswith("fixed") and "," not in k]
    labelled = [{**r, "label": kind_of(r)} for r in runs]
    lines = [
        "| run | CPU s (median) | progress | samples | best fixed / run, CPU, per seed "
        "| ratio of the medians [90% interval] | core's adaptive / run, per seed |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind, seeds in kinds.items():
        cpu = float(np.median([_cpu(r) for r in seeds.values()]))
        done = [r["reached"] for r in seeds.values() if r.get("reached")]
        progress = float(np.median([d["progress"] for d in done])) if done else math.nan
        samples = float(np.median([d["samples"] for d in done])) if done else math.nan
        cells, ratio, core = "", "", ""
        own = paired(labelled, ["adaptive"], kind) if kind.startswith("adaptive,") else None
        if own is not None:
            core = ", ".join(
                f"{s}: {v:.2f}" for s, v in zip(own["seeds"], own["ratios"], strict=True)
            )
        pair = paired(labelled, fixed, kind) if fixed and kind not in fixed else None
        if pair is not None:
            cells = f"{pair['label']}: " + ", ".join(
                f"{s}: {v:.2f}" for s, v in zip(pair["seeds"], pair["ratios"], strict=True)
            )
            best = float(np.median([_cpu(kinds[pair["label"]][s]) for s in pair["seeds"]]))
            mine = float(np.median([_cpu(seeds[s]) for s in pair["seeds"]]))
            ratio = f"{best / mine:.2f}"
            if pair["interval"] is not None:
                ratio += " [{:.2f}, {:.2f}]".format(*pair["interval"])
        lines.append(
            f"| {kind} | {cpu:.1f} | {progress:,.0f} | {samples:,.0f} | {cells} | {ratio} "
            f"| {core} |"
        )
    return "\n".join(lines)


def _floor_along(run: dict[str, Any], grid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(training loss, predicted floor) of a fixed run at the progress ``grid``: the
    loss averaged over the steps within 5% of each progress, the floor at the step's
    applied rate (the cosine base rate times the rule's lr factor), tr(Sigma) and noise."""

    cfg = run["config"]
    steps = np.asarray(run["steps"], dtype=np.float64)
    noise = np.asarray(run["noise"], dtype=np.float64)
    m0 = cfg["init_batch_size"]
    cap = cfg["progress_epochs"] * cfg["train_size"] / m0
    near = [(steps[:, 0] > 0.95 * p) & (steps[:, 0] < 1.05 * p) for p in grid]
    loss = np.array([np.mean(steps[m, 6]) if m.any() else math.nan for m in near])
    var = np.interp(grid, noise[:, 0], noise[:, 3], right=math.nan)
    factor = np.interp(grid, steps[:, 0], steps[:, 5], right=math.nan)
    scale = steps[0, 1] / m0
    level = level_of(run)
    floor = []
    for p, v, r in zip(grid, var, factor, strict=True):
        if not (math.isfinite(v) and math.isfinite(r)):
            floor.append(math.nan)
            continue
        # The step's noise, in initial-batch samples: the batch's own, or a
        # noise-matched run's mix (covariance ((1 - k^2) / S + k^2) Sigma / m0).
        k = extra_noise_weight(scale, r, level) if level else 0.0
        batch = m0 / ((1.0 - k * k) / scale + k * k)
        lr = cosine_lr(cfg, min(p / cap, 1.0)) * r
        floor.append(floor_level(sgd_rate(lr, cfg.get("momentum", 0.0)), v, batch))
    return loss, np.array(floor)


def floor_gap_table(runs: Sequence[dict[str, Any]], grid: Sequence[float]) -> str:
    """Per fixed kind, at each progress in ``grid``: the training loss over the seed's
    initial-size run's, measured / predicted by `floor_level` (medians over the seeds
    both ran)."""
    at = np.asarray(grid, dtype=np.float64)
    kinds = _by_kind([r for r in runs if not r["config"].get("autoscale")])
    if not kinds:
        raise ValueError("floor_gap_table needs fixed-size runs")
    sizes = {r["config"]["init_batch_size"] for seeds in kinds.values() for r in seeds.values()}
    if len(sizes) != 1:
        raise ValueError(f"floor_gap_table needs one initial batch size, got {sorted(sizes)}")
    base_kind = f"fixed {sizes.pop()}"
    if base_kind not in kinds:
        raise ValueError(f"floor_gap_table needs the {base_kind} runs")
    base = {s: _floor_along(r, at) for s, r in kinds[base_kind].items()}
    lines = [
        f"| run: training loss over {base_kind}'s, measured / predicted | "
        + " | ".join(f"{p / 1000:g}k" for p in at)
        + " |",
        "|---" * (len(at) + 1) + "|",
    ]
    for kind, seeds in kinds.items():
        gaps = []
        for s, r in seeds.items():
            if kind != base_kind and s in base:
                loss, floor = _floor_along(r, at)
                gaps.append(np.stack([loss - base[s][0], floor - base[s][1]]))
        if not gaps:
            continue
        med = np.nanmedian(np.array(gaps), axis=0)
        cells = [f"{m:+.3f} / {p:+.3f}" for m, p in zip(med[0], med[1], strict=True)]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Print `target_table` (``--gaps``: `floor_gap_table`) of time_to_target logs,
    per problem; a mix of calibrations or targets in one problem is refused."""

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path, help="time_to_target JSON-lines logs")
    parser.add_argument(
        "--gaps", help="comma-separated progress values: the floor's predicted loss gaps there"
    )
    parser.add_argument(
        "--pool", action="store_true", help="average repeats of a kind and seed (pool_repeats)"
    )
    args = parser.parse_args(argv)
    runs = [json.loads(line) for p in args.logs for line in p.read_text().splitlines() if line]
    for problem in sorted({r["problem"] for r in runs}):
        mine = [r for r in runs if r["problem"] == problem]
        try:
            check_one_calibration(mine)
            own_target(mine)
            if args.pool:
                mine = pool_repeats(mine)
            text = (
                floor_gap_table(mine, [float(x) for x in args.gaps.split(",")])
                if args.gaps
                else target_table(mine)
            )
        except ValueError as err:
            parser.error(f"{problem}: {err}")
        print(f"{problem}:\n{text}\n")


if __name__ == "__main__":
    main()
