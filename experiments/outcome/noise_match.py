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

    python -m experiments.outcome.time_to_target --problems shapes --kinds fixed \
        --sizes 128,256 --noise-match --seed-list 0,1,2 --out out/nm/matched
    python -m experiments.outcome.noise_match out/nm/*/time_to_target.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def extra_noise_weight(scale: float, gain: float, level: float = 1.0) -> float:
    """``k`` for which ``g_M + k (g_m - g_M)`` has covariance ``level * Sigma / (gain * m)``.

    ``g_m`` is the mean gradient of ``m`` of the ``M = scale * m`` samples whose mean is
    ``g_M``, so ``Cov(g_m, g_M) = Sigma / M`` and the mix's covariance is
    ``((1 - k^2) / M + k^2 / m) Sigma``. ``gain`` is clipped to ``[1, scale]`` (the
    AdaScale gain's range). At ``level`` 1 (the initial batch's noise per unit of
    progress) a gain of 1 gives ``k = 1`` (the small batch's gradient) and ``scale``
    gives 0 (no added noise); a ``level`` in (0, 1) asks for that fraction of it, and
    ``k`` is 0 where the batch's own noise is already below it.
    """
    if not (scale >= 1.0 and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number >= 1, got {scale!r}")
    if not math.isfinite(gain):
        raise ValueError(f"gain must be finite, got {gain!r}")
    if not 0.0 < level <= 1.0:
        raise ValueError(f"level must be in (0, 1], got {level!r}")
    if scale == 1.0:
        return 0.0
    r = min(max(gain, 1.0), scale)
    return math.sqrt(max(scale * level / r - 1.0, 0.0) / (scale - 1.0))


def check_config(cfg: dict[str, Any], replicas: int) -> int:
    """The samples each of ``replicas`` contributes to the small batch of a
    ``noise_match`` run of the trainer config ``cfg``; ValueError for an adaptive
    run, one that accumulates, or an initial batch the replicas do not divide."""
    b0 = cfg["init_batch_size"]
    if cfg.get("autoscale") or cfg.get("accum_steps", 0) or replicas < 1 or b0 % replicas:
        raise ValueError(
            "noise_match needs a fixed size without accumulation and an initial batch "
            f"that the replicas divide; got autoscale={cfg.get('autoscale')!r}, "
            f"accum_steps={cfg.get('accum_steps')!r}, init_batch_size={b0!r}, "
            f"replicas={replicas!r}"
        )
    return int(b0 // replicas)


def match_noise(
    model: Any,
    batch_loss: Callable[[Any, Any], Any],
    local_indices: Any,
    local_samples: int,
    weight: float,
) -> None:
    """Mix ``weight`` of the small-batch gradient into ``model``'s averaged ``.grad``.

    The small batch is the first ``local_samples`` of ``local_indices`` on every
    replica (the loader's order is already shuffled), its gradient averaged over the
    replicas with `torch.distributed` when a process group is up. The gradient is
    taken through detached copies of the parameters, so AdaptDL's gradient hooks
    (on the parameters themselves) do not see it.
    """
    import torch.distributed as dist

    import torch

    if not 0 < local_samples <= len(local_indices):
        raise ValueError(
            f"local_samples must be in [1, {len(local_indices)}] (the local batch), "
            f"got {local_samples}"
        )
    named = [(name, p) for name, p in model.named_parameters() if p.grad is not None]
    copies = {name: p.detach().requires_grad_() for name, p in named}

    def net(*inputs: Any) -> Any:
        return torch.func.functional_call(model, copies, inputs)

    loss = batch_loss(net, local_indices[:local_samples])
    grads = torch.autograd.grad(loss, list(copies.values()))
    flat = torch.cat([g.reshape(-1) for g in grads])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
    offset = 0
    with torch.no_grad():
        for _, p in named:
            small = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            p.grad.add_(small - p.grad, alpha=weight)


def level_of(run: dict[str, Any]) -> float:
    """The run's ``noise_match`` level: 0 for a plain run, 1 for ``True`` (older logs)."""
    return float(run["config"].get("noise_match") or 0.0)


def name_of(size: int, level: float) -> str:
    """'fixed 256', 'fixed 256, noise matched' (level 1) or 'fixed 256, noise at 0.5'."""
    if level == 0.0:
        return f"fixed {size}"
    return f"fixed {size}, " + ("noise matched" if level == 1.0 else f"noise at {level:g}")


def _size(run: dict[str, Any]) -> int:
    cfg = run["config"]
    return int(2 * cfg["local_bsz"] * (cfg["accum_steps"] + 1))


def at_target(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per kind of run (its size and `level_of`): the seeds that ran and reached the
    target, medians over them of the progress, samples and CPU seconds at the target,
    and the median over seeds of the progress over that seed's smallest plain size's
    (``ratio``; ``ratios``, in the order of the seeds, where both reached it)."""
    smallest = min((_size(r) for r in runs if not level_of(r)), default=None)
    base = {
        r["seed"]: r["reached"]["progress"]
        for r in runs
        if _size(r) == smallest and not level_of(r) and r["reached"]
    }
    groups: dict[tuple[int, float], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((_size(r), level_of(r)), []).append(r)
    rows = []
    for (size, level), group in sorted(groups.items()):
        reached = sorted((r for r in group if r["reached"] is not None), key=lambda r: r["seed"])

        def median(key: str, reached: list[dict[str, Any]] = reached) -> float:
            return float(np.median([r["reached"][key] for r in reached])) if reached else math.nan

        ratios = [r["reached"]["progress"] / base[r["seed"]] for r in reached if r["seed"] in base]
        rows.append(
            {
                "size": size,
                "level": level,
                "seeds": sorted(r["seed"] for r in group),
                "reached": len(reached),
                "progress": median("progress"),
                "samples": median("samples"),
                "cpu_seconds": median("cpu_seconds"),
                "ratio": float(np.median(ratios)) if ratios else math.nan,
                "ratios": ratios,
            }
        )
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    """`at_target`'s rows as a Markdown table."""
    lines = [
        "| run | seeds (reached) | progress at target (median) | over the smallest plain "
        "size's, per seed: median (each) | samples | CPU s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = name_of(r["size"], r["level"])
        seeds = ",".join(str(s) for s in r["seeds"])
        lines.append(
            f"| {name} | {seeds} ({r['reached']}) | {r['progress']:.0f} | "
            f"{r['ratio']:.2f} ({', '.join(f'{x:.2f}' for x in r['ratios'])}) | "
            f"{r['samples']:.0f} | {r['cpu_seconds']:.1f} |"
        )
    return "\n".join(lines)


def level_table(runs: Sequence[dict[str, Any]], levels: Sequence[float]) -> str:
    """Per kind of run and level: the median over seeds of the progress at which it
    first reached the level (read off its evaluations, `time_to_target.retarget`: an
    accuracy, or for a loss target the excess over the optimal loss) over that seed's
    smallest plain size's."""
    from experiments.outcome.time_to_target import retarget

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
        cells = " | ".join(f"{c.get((size, level), math.nan):.2f}" for c in columns)
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
        sqr, var = (
            [np.nanmedian(c) if np.isfinite(c).any() else math.nan for c in values[:, :, i].T]
            for i in (0, 1)
        )
        text = [f"{g:.2f} / {v:.0f} / {v / g:.0f}" for g, v in zip(sqr, var, strict=True)]
        name = name_of(size, level)
        lines.append(f"| {name} | " + " | ".join(text) + " |")
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
    rows = at_target(fixed)
    print(table(rows))
    if args.levels:
        print()
        print(level_table(fixed, [float(x) for x in args.levels.split(",")]))
    if args.along:
        print()
        print(along_table(fixed, [float(x) for x in args.along.split(",")]))
    return rows


if __name__ == "__main__":
    main()
