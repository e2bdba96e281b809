"""The shapes CNN's noise statistics, estimated and exact, along one training run.

Why. On the shapes CNN the adaptive run settles below the best fixed batch size
because the goodput model's efficiency, ``(B_n + 16) / (B_n + M)`` with ``B_n``
the simple noise scale ``tr(Sigma) / |G|^2``, rates large batches below what the
fixed sweep measures (RESULTS.md, item 4). Three explanations fit that: the
estimator is off (a bias of the two-replica estimate), it lags a truth that moves
(an exponential average over about a thousand initial-batch steps), or the simple
noise scale is the wrong statistic for this network (McCandlish et al.'s
curvature-weighted ``B_noise = tr(H Sigma) / G^T H G`` is the one their theory
derives). This experiment tells them apart.

How. One process trains the CNN as `experiments.harness.trainer` does (SGD,
momentum 0.9, learning rate 0.01) at the initial batch, 16 samples per step as
two micro-batches of 8: exactly what two replicas hand the estimator. Each step's
squared norms feed core's `GradientNoiseScale` at every ``smoothing`` given (the
estimates do not steer the training: at the initial batch the gain is 1). Every
``every`` samples it also computes, at the current parameters:

* |G|^2 from the gradient of the whole training set;
* tr(Sigma) as ``b`` times the mean squared deviation of ``b``-sample
  micro-batch gradients from that full gradient (``probe`` samples);
* ``G^T H G`` and tr(H Sigma) from Hessian-vector products (double backward) of
  the loss over ``hessian`` samples, tr(H Sigma) from ``curvature_draws``
  micro-batch deviations.
* |G|^2 and tr(Sigma) the same way on a fresh draw of the data (as many samples,
  another seed): the population's, where the training set's depart from them as
  the network fits the samples it has seen. A step's micro-batches are drawn from
  the samples not yet seen in the current pass, so the estimator measures neither
  exactly: fresh samples in the first pass, the least recently fitted ones after.

The exact values at a point fluctuate with the iterate (|G|^2 at one parameter
vector includes the part of the gradient the momentum iterate is bouncing
along), so `summarise` compares ratios of means over phases of the run (the
estimator's averages are means too), not single points.

    python -m experiments.gns_truth --seeds 0,1 --out out/gns_truth
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from experiments.harness import problems
from experiments.harness.trainer import shapes_cnn

#: The run: the shapes problem of `time_to_target` as first calibrated (`SHORT`: pixel
#: noise 0.5, RESULTS.md item 4, sixth follow-up), truth every ``every`` samples.
DEFAULT: dict[str, Any] = {
    "train_size": 65536,
    "noise": 0.5,
    "lr": 0.01,
    "momentum": 0.9,
    "micro_batch": 8,
    "micro_batches": 2,
    "samples": 98304,
    "every": 8192,
    "probe": 4096,
    "hessian": 2048,
    "curvature_draws": 32,
    "smoothings": [0.999, 0.99],
}


def full_gradient(loss_fn: Callable[[Any], Any], params: Sequence[Any], num_samples: int) -> Any:
    """The gradient of the mean loss over samples ``0 .. num_samples - 1`` (float64)."""
    import torch

    full = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    chunk = 8192
    for lo in range(0, num_samples, chunk):
        idx = torch.arange(lo, min(lo + chunk, num_samples))
        grads = torch.autograd.grad(loss_fn(idx), params)
        full += torch.cat([t.reshape(-1) for t in grads]).double() * len(idx)
    return full / num_samples


def micro_batch_gradients(
    loss_fn: Callable[[Any], Any], params: Sequence[Any], idx: Any, micro_batch: int, count: int
) -> list[Any]:
    """The flat gradient of each of the ``count`` consecutive ``micro_batch``-sample
    slices of ``idx`` (what ``count`` replicas compute for one step)."""
    import torch

    out = []
    for i in range(count):
        grads = torch.autograd.grad(loss_fn(idx[i * micro_batch : (i + 1) * micro_batch]), params)
        out.append(torch.cat([t.reshape(-1) for t in grads]))
    return out


def exact_statistics(
    loss_fn: Callable[[Any], Any],
    params: Sequence[Any],
    num_samples: int,
    micro_batch: int,
    probe: Any,
    hessian: Any,
    curvature_draws: int,
) -> dict[str, float]:
    """|G|^2, tr(Sigma), G^T H G and tr(H Sigma) at the current parameters.

    ``loss_fn(indices)`` is the mean loss over those sample indices (a tensor).
    ``probe`` (indices, a multiple of ``micro_batch`` long) gives tr(Sigma);
    ``hessian`` (indices) the Hessian the curvature terms use; the first
    ``curvature_draws`` micro-batches of ``probe`` give tr(H Sigma). Without
    ``hessian`` (None) only |G|^2 and tr(Sigma) are returned.
    """
    import torch

    if len(probe) % micro_batch:
        raise ValueError(f"probe has {len(probe)} samples, not a multiple of {micro_batch}")
    if hessian is not None and curvature_draws < 1:
        raise ValueError(f"curvature_draws must be >= 1 with a hessian, got {curvature_draws}")

    def flat(tensors: Sequence[Any]) -> Any:
        return torch.cat([t.reshape(-1) for t in tensors])

    def grad(idx: Any, create_graph: bool = False) -> Any:
        return flat(torch.autograd.grad(loss_fn(idx), params, create_graph=create_graph))

    full = full_gradient(loss_fn, params, num_samples)
    if hessian is None:  # no curvature terms
        deviations = [probe[lo : lo + micro_batch] for lo in range(0, len(probe), micro_batch)]
        devs = [float(((grad(idx).double() - full) ** 2).sum()) for idx in deviations]
        return {"sqr": float(full @ full), "var": micro_batch * float(np.mean(devs))}
    g_h = grad(hessian, create_graph=True)

    def hvp(v: Any) -> Any:
        out = torch.autograd.grad(g_h @ v.to(g_h.dtype), params, retain_graph=True)
        return flat(out).double()

    deviations, curvatures = [], []
    for k, lo in enumerate(range(0, len(probe), micro_batch)):
        dev = grad(probe[lo : lo + micro_batch]).double() - full
        deviations.append(float(dev @ dev))
        if k < curvature_draws:
            curvatures.append(float(dev @ hvp(dev)))
    return {
        "sqr": float(full @ full),
        "var": micro_batch * float(np.mean(deviations)),
        "gHg": float(full @ hvp(full)),
        "trHS": micro_batch * float(np.mean(curvatures)),
    }


def run(seed: int, cfg: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train one seed, returning the estimator's readings and the truth at each checkpoint."""
    import torch.nn.functional as F

    import torch
    from adaptdl.core.stats.gns import GradientNoiseScale

    cfg = {**DEFAULT, **(cfg or {})}
    n = cfg["train_size"]
    x_np, y_np = problems.shapes(n, noise=cfg["noise"], seed=seed)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    # A fresh draw of the same distribution: the population's gradient, which the
    # training set's departs from as the network fits the samples it has seen.
    xf_np, yf_np = problems.shapes(n, noise=cfg["noise"], seed=seed + 5_000)
    xf, yf = torch.from_numpy(xf_np), torch.from_numpy(yf_np)
    torch.manual_seed(seed)
    model = shapes_cnn()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=cfg["lr"], momentum=cfg["momentum"])
    b, count = cfg["micro_batch"], cfg["micro_batches"]
    batch = b * count
    estimators = [
        GradientNoiseScale(init_batch_size=batch, smoothing=s) for s in cfg["smoothings"]
    ]
    order = torch.Generator().manual_seed(seed)
    draws = torch.Generator().manual_seed(seed + 10_000)  # the truth's own, not training's

    def loss_fn(idx: Any) -> Any:
        return F.cross_entropy(model(x[idx]), y[idx])

    def fresh_loss_fn(idx: Any) -> Any:
        return F.cross_entropy(model(xf[idx]), yf[idx])

    checkpoints: list[dict[str, Any]] = []
    # Each step's (samples before it, sum of micro-batch squared norms, squared norm of
    # the mean): any other estimator can be replayed on them (`replay`).
    steps: list[tuple[int, float, float]] = []
    # The exact |G|^2 at every step of a window (`window_summary`).
    window: list[tuple[int, float]] = []
    start, length = cfg.get("window") or (0, 0)
    if length and (start % batch or start + length * batch > cfg["samples"]):
        raise ValueError(
            f"window {start},{length} must start at a multiple of {batch} samples and end "
            f"by samples={cfg['samples']}"
        )
    if cfg["probe"] + cfg["hessian"] > n:
        raise ValueError(f"probe + hessian ({cfg['probe']} + {cfg['hessian']}) exceed {n}")
    perm, pos, samples = torch.randperm(n, generator=order), 0, 0
    while True:
        if samples % cfg["every"] == 0:
            drawn = torch.randperm(n, generator=draws)
            probe, hessian = drawn[: cfg["probe"]], drawn[cfg["probe"] :][: cfg["hessian"]]
            truth = exact_statistics(loss_fn, params, n, b, probe, hessian, cfg["curvature_draws"])
            fresh = exact_statistics(fresh_loss_fn, params, n, b, probe, None, 0)
            checkpoints.append(
                {
                    "samples": samples,
                    **truth,
                    "fresh_sqr": fresh["sqr"],
                    "fresh_var": fresh["var"],
                    "estimates": [[e.sqr, e.var] for e in estimators],
                }
            )
        if samples >= cfg["samples"]:
            break
        if start <= samples < start + length * batch:
            full = full_gradient(loss_fn, params, n)
            window.append((samples, float(full @ full)))
        if pos + batch > n:
            perm, pos = torch.randperm(n, generator=order), 0
        idx = perm[pos : pos + batch]
        pos += batch
        grads = micro_batch_gradients(loss_fn, params, idx, b, count)
        mean = torch.stack(grads).mean(0)
        local = sum(float(g @ g) for g in grads)
        total = float(mean @ mean)
        steps.append((samples, local, total))
        for e in estimators:
            e.update(local, total, count, b)
        offset = 0
        for p in params:
            p.grad = mean[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        opt.step()
        samples += batch
    return {
        "seed": seed,
        "config": cfg,
        "checkpoints": checkpoints,
        "steps": steps,
        "window": window,
    }


def window_summary(result: dict[str, Any]) -> dict[str, float] | None:
    """The window's exact |G|^2 along the trajectory against the per-step estimates.

    The exact values' mean, median, minimum and maximum over the window's steps, and
    the mean of the estimator's per-step |G|^2 estimates over the same steps, and
    the mean paired difference (estimate - exact) with its standard error (None
    without a window). An unbiased per-step estimate has a difference within its
    error of 0.
    """
    window = result.get("window") or []
    if not window:
        return None
    per_step = dict(step_sqr(result))
    exact = np.array([v for _, v in window])
    estimates = np.array([per_step[s] for s, _ in window])
    return {
        "steps": len(window),
        "exact_mean": float(exact.mean()),
        "exact_median": float(np.median(exact)),
        "exact_min": float(exact.min()),
        "exact_max": float(exact.max()),
        "estimate_mean": float(estimates.mean()),
        # Paired: the exact value is known at each step, so only the estimate's noise.
        "difference_mean": float((estimates - exact).mean()),
        "difference_error": float((estimates - exact).std(ddof=1) / math.sqrt(len(exact))),
    }


def replay(result: dict[str, Any], smoothings: Sequence[float]) -> dict[str, Any]:
    """``result`` with its estimates recomputed at ``smoothings`` from its recorded steps.

    Each step's squared norms go through core's `GradientNoiseScale` as in `run`,
    so the estimator's readings at any memory come without training again.
    """
    from adaptdl.core.stats.gns import GradientNoiseScale

    cfg = result["config"]
    if not result.get("steps"):
        raise ValueError(f"seed {result['seed']} has no per-step record to replay")
    b, count = cfg["micro_batch"], cfg["micro_batches"]
    estimators = [GradientNoiseScale(init_batch_size=b * count, smoothing=s) for s in smoothings]
    at = {c["samples"]: c for c in result["checkpoints"]}
    readings: dict[int, list[list[float]]] = {}
    steps = result["steps"]
    for k in range(len(steps) + 1):
        # Checkpoints come before the step that starts at their sample count.
        samples = steps[k][0] if k < len(steps) else steps[-1][0] + b * count
        if samples in at:
            readings[samples] = [[e.sqr, e.var] for e in estimators]
        if k < len(steps):
            for e in estimators:
                e.update(steps[k][1], steps[k][2], count, b)
    checkpoints = [{**c, "estimates": readings[c["samples"]]} for c in result["checkpoints"]]
    return {
        **result,
        "config": {**cfg, "smoothings": list(smoothings)},
        "checkpoints": checkpoints,
    }


def summarise(runs: Sequence[dict[str, Any]], phases: int = 3) -> list[dict[str, Any]]:
    """Per phase of the run (checkpoints after the first, split in ``phases``), over runs.

    Ratios of means: the exact simple noise scale sum(var) / sum(sqr), the exact
    curvature-weighted one sum(trHS) / sum(gHg), the same on a fresh draw of the
    data (``fresh``, where recorded), and each estimator's sum(var_est) /
    sum(sqr_est), with the estimated and exact |G|^2 and tr(Sigma).
    """
    rows = []
    smoothings = runs[0]["config"]["smoothings"]
    if any(r["config"]["smoothings"] != smoothings for r in runs):
        raise ValueError("the runs were estimated at different smoothings: replay them alike")
    points = []
    for r in runs:
        per_step = step_sqr(r)
        points += [
            {**c, "time_sqr": _time_average(per_step, c["samples"])}
            for c in r["checkpoints"]
            if c["samples"] > 0
        ]
    ends = sorted({c["samples"] for c in points})
    for k, part in enumerate(np.array_split(np.array(ends), phases)):
        chosen = [c for c in points if c["samples"] in set(part.tolist())]
        if not chosen:
            continue

        def total(key: str, rows: list[dict[str, Any]] = chosen) -> float:
            return math.fsum(c[key] for c in rows)

        row: dict[str, Any] = {
            "phase": k,
            "samples": (int(part[0]), int(part[-1])),
            "points": len(chosen),
            "sqr": total("sqr") / len(chosen),
            "var": total("var") / len(chosen),
            "simple": total("var") / total("sqr"),
            "curvature": total("trHS") / total("gHg"),
        }
        if all("fresh_sqr" in c for c in chosen):
            row["fresh"] = (
                total("fresh_sqr") / len(chosen),
                total("fresh_var") / len(chosen),
                total("fresh_var") / total("fresh_sqr"),
            )
        # One set of resamples per phase, shared by every estimator.
        resamples = np.random.default_rng(k).integers(0, len(chosen), (2000, len(chosen)))
        timed = [c for c in chosen if c["time_sqr"] is not None]
        if timed:
            time_sqr = math.fsum(c["time_sqr"] for c in timed)
            row["time_average"] = (
                time_sqr / len(timed),
                total("var", timed) / time_sqr,
                len(timed),
            )
        for i, s in enumerate(smoothings):
            sqr = math.fsum(c["estimates"][i][0] for c in chosen)
            var = math.fsum(c["estimates"][i][1] for c in chosen)
            ratio = var / sqr if sqr else math.inf
            row[f"est {s}"] = (sqr / len(chosen), var / len(chosen), ratio)
            row[f"vs exact {s}"] = _against_exact(chosen, i, resamples)
            if timed:
                est_sqr = math.fsum(c["estimates"][i][0] for c in timed)
                est_var = math.fsum(c["estimates"][i][1] for c in timed)
                row[f"vs time {s}"] = (
                    (est_var / est_sqr) / row["time_average"][1],
                    est_sqr / time_sqr,
                )
        rows.append(row)
    return rows


#: Half the stretch of per-step estimates `_time_average` averages, in samples.
TIME_AVERAGE_HALF_WIDTH = 4096


def step_sqr(result: dict[str, Any]) -> np.ndarray:
    """Each recorded step's (samples before it, |G|^2 estimate), as core estimates it.

    Core's `step_estimates` on the step's recorded squared norms; an empty (0, 2)
    array without a per-step record.
    """
    from adaptdl.core.stats.gns import step_estimates

    steps = result.get("steps") or ()
    if not steps:
        return np.empty((0, 2))
    count, b = result["config"]["micro_batches"], result["config"]["micro_batch"]
    rows = [(s, step_estimates(lo, t, count, b)[0]) for s, lo, t in steps]
    return np.array(rows, dtype=np.float64)


def _time_average(per_step: np.ndarray, samples: int) -> float | None:
    """The mean of ``per_step``'s |G|^2 estimates within `TIME_AVERAGE_HALF_WIDTH` samples.

    ``per_step`` is `step_sqr`'s. Each step's estimate is unbiased for the exact
    |G|^2 at its step, so their mean over a stretch estimates the trajectory's time
    average there, which a single checkpoint's exact value may miss by a spike.
    None where no step lies that near (no per-step record).
    """
    near = per_step[np.abs(per_step[:, 0] - samples) < TIME_AVERAGE_HALF_WIDTH, 1]
    return float(near.mean()) if near.size else None


def _against_exact(
    points: Sequence[dict[str, Any]], i: int, resamples: np.ndarray
) -> dict[str, tuple[float, float, float]]:
    """Estimator ``i`` over the exact values: noise scale and |G|^2, with 95% intervals.

    Ratios of means over ``points``, and the 2.5 and 97.5 percentiles of the same
    ratios over ``resamples`` (rows of indices into ``points``, drawn with
    replacement): the exact value at one point swings by an order of magnitude, so
    a phase's mean is uncertain.
    """
    est = np.array([c["estimates"][i] for c in points], dtype=np.float64)
    exact = np.array([[c["sqr"], c["var"]] for c in points], dtype=np.float64)

    def ratios(idx: np.ndarray) -> tuple[float, float]:
        e, x = est[idx].sum(0), exact[idx].sum(0)
        return float((e[1] / e[0]) / (x[1] / x[0])), float(e[0] / x[0])

    point = ratios(np.arange(len(points)))
    resampled = np.array([ratios(idx) for idx in resamples])
    lo, hi = np.percentile(resampled, [2.5, 97.5], axis=0)
    return {
        "noise_scale": (point[0], float(lo[0]), float(hi[0])),
        "sqr": (point[1], float(lo[1]), float(hi[1])),
    }


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The phases as a markdown table."""
    keys = [k for k in rows[0] if k.startswith("est ") or k == "fresh"]
    head = "| samples | points | exact |G|^2 / tr(Sigma) | exact B_simple | "
    head += "exact B_noise (curvature) | "
    head += " | ".join(f"{k}: |G|^2 / tr(Sigma) / B_simple" for k in keys) + " |"
    head = head.replace("fresh: ", "exact on a fresh draw: ")
    lines = [head, "|" + "---|" * (5 + len(keys))]
    for r in rows:
        cells = [
            f"{r['samples'][0]}-{r['samples'][1]}",
            str(r["points"]),
            f"{r['sqr']:.2f} / {r['var']:.0f}",
            f"{r['simple']:.0f}",
            f"{r['curvature']:.0f}",
        ]
        cells += [f"{r[k][0]:.2f} / {r[k][1]:.0f} / {r[k][2]:.0f}" for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    against = [k for k in rows[0] if k.startswith("vs exact ")]
    lines += [
        "",
        "| samples | "
        + " | ".join(
            f"est {k[len('vs exact ') :]} / exact: B_simple [95%]; |G|^2 [95%]" for k in against
        )
        + " |",
        "|" + "---|" * (1 + len(against)),
    ]
    for r in rows:
        cells = [f"{r['samples'][0]}-{r['samples'][1]}"]
        for k in against:
            (b, blo, bhi), (g, glo, ghi) = r[k]["noise_scale"], r[k]["sqr"]
            cells.append(f"{b:.2f} [{blo:.2f}, {bhi:.2f}]; {g:.2f} [{glo:.2f}, {ghi:.2f}]")
        lines.append("| " + " | ".join(cells) + " |")
    timed = [k for k in rows[0] if k.startswith("vs time ")]
    if timed and all("time_average" in r for r in rows):
        lines += [
            "",
            "| samples | points with steps | per-step time average: |G|^2 / B_simple | "
            + " | ".join(f"est {k[len('vs time ') :]} / it: B_simple; |G|^2" for k in timed)
            + " |",
            "|" + "---|" * (3 + len(timed)),
        ]
        for r in rows:
            sqr, simple, count = r["time_average"]
            cells = [f"{r['samples'][0]}-{r['samples'][1]}", str(count)]
            cells.append(f"{sqr:.2f} / {simple:.0f}")
            cells += [f"{r[k][0]:.2f}; {r[k][1]:.2f}" for k in timed]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run the seeds (or read ``--from-log``), print the phase table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0", help="comma-separated seeds")
    parser.add_argument("--out", type=Path, default=Path("out/gns_truth"))
    parser.add_argument("--from-log", type=Path, nargs="+", help="summarise these JSON files")
    parser.add_argument("--samples", type=int, help="train this many samples (default 98304)")
    parser.add_argument("--every", type=int, help="the truth every this many samples (8192)")
    parser.add_argument(
        "--replay", help="comma-separated smoothings to recompute the estimates at (`replay`)"
    )
    parser.add_argument(
        "--window",
        help="START,STEPS: the exact |G|^2 at every one of STEPS steps from sample START",
    )
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # one core per seed: seeds run side by side
    if args.from_log:
        runs = [json.loads(p.read_text()) for p in args.from_log]
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        runs = []
        for seed in (int(s) for s in args.seeds.split(",")):
            window = [int(v) for v in args.window.split(",")] if args.window else None
            overrides = {"samples": args.samples, "every": args.every, "window": window}
            result = run(seed, {k: v for k, v in overrides.items() if v is not None})
            (args.out / f"seed{seed}.json").write_text(json.dumps(result))
            runs.append(result)
    if args.replay:
        runs = [replay(r, [float(x) for x in args.replay.split(",")]) for r in runs]
    for r in runs:
        summary = window_summary(r)
        if summary is not None:
            print(
                f"seed {r['seed']}, window from sample {r['window'][0][0]}: "
                + ", ".join(f"{k} {v:.3g}" for k, v in summary.items())
            )
    rows = summarise(runs)
    if rows:
        print(table(rows))
    return rows


if __name__ == "__main__":
    main()
