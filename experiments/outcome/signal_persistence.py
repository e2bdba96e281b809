"""How much of a problem's gradient persists from step to step, at the initial batch.

Why. The goodput model's efficiency rates a batch of ``M`` samples by the simple
noise scale ``B = tr(Sigma) / |G|^2``; on shapes (RESULTS.md item 4, eighth
follow-up) the fixed sweep's efficiencies imply a noise scale 1.5 to 5 times
what the estimator reads (about 70-125 against 24-43 early, 350-460 against
150-320 near the target), so the adaptive run stays below the best fixed size.
`gns_truth` found the estimator right about the simple noise scale itself (its
time average) and the exact |G|^2 spiking from step to step under momentum 0.9.
The hypothesis measured here: part of the gradient turns back as the iterate
crosses a valley, which makes no progress, yet counts in |G|^2 as signal.

How. One process trains the problem (`time_to_target`'s shapes or dyck: its data,
optimiser and cosine schedule; at the initial batch the gain is 1, so progress is
steps) at 16 samples a step as two micro-batches of 8, what two replicas hand the
estimator. Per step it records the two-micro-batch estimates of |G|^2 and
tr(Sigma) (core's `step_estimates`) and, for each lag ``k``, the product of the
step's mean gradient with the gradient of a held-out micro-batch ``k`` steps
before (drawn at random, never used in an update): an unbiased estimate of ``G_t .
G_{t-k}`` with no noise term to subtract (up to a term of order B/n: training draws
without replacement within a pass). A component that persists counts in it
as in |G|^2; one that flips sign cancels. Also the product with exponential
averages of those earlier gradients (``g_t . e_{t-1}``, ``e`` normalised to
weights summing to 1). ``--own-gradients`` pairs with the earlier steps' own mean
gradients instead (the first measurement): biased by the gradient's response to
the noise of the step that moved the parameters (`run`). Training stops at the
target, evaluated as `time_to_target` does.

`summarise` splits the run at levels of the evaluation and gives per phase, as
ratios of means, the noise scale that each signal statistic implies with the same
tr(Sigma), and each product over the same-step |G|^2.

The prototype estimator `PersistentSignalScale` (``time_to_target
--signal-memory``) takes the own product (`GradientMemory` reads the parameters'
averaged ``.grad``), as the first measurement did.

    python -m experiments.outcome.signal_persistence --seeds 0,1,2 --out out/persist2/shapes
    python -m experiments.outcome.signal_persistence --from-log out/persist2/shapes/seed0.json ...
"""

from __future__ import annotations

import argparse
import collections
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from adaptdl.core.stats.gns import GradientNoiseScale, step_estimates

LAGS = (1, 2, 4, 8, 16, 32, 64)
AVERAGES = (0.5, 0.9, 0.99)
#: The levels the phases end at: shapes' accuracy, dyck's loss above the optimum (negated).
LEVELS = {"shapes": (0.5, 0.7, 0.8, 0.85, 0.86), "dyck": (-0.1, -0.03, -0.01, -0.003, -0.001)}


def _problem(name: str, seed: int) -> dict[str, Any]:
    """The model, loss, metric (higher is better) and target of ``name`` as
    `time_to_target` runs it (`trainer.build_problem`)."""
    from experiments.outcome.time_to_target import PROBLEMS
    from experiments.outcome.trainer import build_problem

    cfg, model, batch_loss, evaluate = build_problem({**PROBLEMS[name], "seed": seed})
    if name == "shapes":
        metric, target = (lambda: evaluate()[1]), cfg["target_accuracy"]
    else:  # dyck: the loss above the optimum, negated
        metric, target = (lambda: cfg["optimal_loss"] - evaluate()[0]), -cfg["target_excess"]
    return {
        "cfg": cfg,
        "model": model,
        "loss": lambda idx: batch_loss(model, idx),
        "metric": metric,
        "target": target,
    }


def run(
    seed: int,
    problem: str = "shapes",
    lags: Sequence[int] = LAGS,
    averages: Sequence[float] = AVERAGES,
    held_out: bool = True,
) -> dict[str, Any]:
    """Train one seed at the initial batch to the target; per step the statistics above.

    ``held_out`` (the default) pairs each step's mean gradient with the gradients of
    held-out micro-batches of the earlier steps (``b`` samples drawn at random at each
    step, never used in an update), which makes the products unbiased estimates of
    ``G_t . G_{t-k}``. Without it (the first measurements) they pair with the earlier
    steps' own mean gradients, whose noise moved the parameters the later gradient is
    taken at: ``E[g_t . g_{t-k}] = G_t . G_{t-k} + E[G_t . xi_{t-k}]``, the second
    term the gradient's response to that step's noise (about ``-lr tr(H Sigma) / B``
    through the momentum's response), which is not separated then.
    """
    from experiments.outcome.gns_truth import micro_batch_gradients
    from experiments.outcome.trainer import cosine_lr, make_optimizer

    import torch

    prob = _problem(problem, seed)
    cfg, model = prob["cfg"], prob["model"]
    params = list(model.parameters())
    opt = make_optimizer(cfg, params)
    n, b, count = cfg["train_size"], cfg["init_batch_size"] // 2, 2
    batch = b * count
    total_steps = cfg["progress_epochs"] * n / batch
    order = torch.Generator().manual_seed(seed)
    probes = torch.Generator().manual_seed(seed + 20_000)  # the held-out draws' own
    history: list[Any] = []  # the last max(lags) earlier gradients, newest last
    memories = [GradientMemory(beta) for beta in averages]
    rows: list[list[float]] = []  # per step: sqr, var, lag products..., average products...
    evals: list[tuple[int, float]] = []
    perm, pos, step = torch.randperm(n, generator=order), 0, 0
    while True:
        if step * batch % cfg["eval_every_samples"] == 0:
            value = prob["metric"]()
            evals.append((step, value))
            if value >= prob["target"] or step >= total_steps:
                break
        if pos + batch > n:
            perm, pos = torch.randperm(n, generator=order), 0
        idx = perm[pos : pos + batch]
        pos += batch
        grads = [g.double() for g in micro_batch_gradients(prob["loss"], params, idx, b, count)]
        mean = torch.stack(grads).mean(0)
        sqr, var = step_estimates(sum(float(g @ g) for g in grads), float(mean @ mean), count, b)
        earlier = mean  # what later steps pair with
        if held_out:
            probe = torch.randint(n, (b,), generator=probes)
            earlier = micro_batch_gradients(prob["loss"], params, probe, b, 1)[0].double()
        row = [sqr, var]
        row += [float(mean @ history[-k]) if len(history) >= k else math.nan for k in lags]
        row += [memory.pair(mean, earlier) for memory in memories]
        rows.append(row)
        history = [*history[-(max(lags) - 1) :], earlier]
        for group in opt.param_groups:
            group["lr"] = cosine_lr(cfg, min(step / total_steps, 1.0))
        offset = 0
        for p in params:
            p.grad = mean[offset : offset + p.numel()].view_as(p).to(p.dtype).clone()
            offset += p.numel()
        opt.step()
        step += 1
    return {
        "seed": seed,
        "problem": problem,
        "batch": batch,
        "lags": list(lags),
        "averages": list(averages),
        "held_out": held_out,
        "evals": evals,
        "rows": rows,
    }


def summarise(
    runs: Sequence[dict[str, Any]], levels: Sequence[float] | None = None
) -> list[dict[str, Any]]:
    """Per phase (between successive ``levels`` of the evaluation, each run split where
    it first reached them; steps pooled over runs): the noise scales implied."""
    levels = levels or LEVELS[runs[0].get("problem", "shapes")]
    names = ["simple"] + [f"lag {k}" for k in runs[0]["lags"]]
    names += [f"average {a}" for a in runs[0]["averages"]]
    phases: list[list[np.ndarray]] = [[] for _ in range(len(levels))]
    for r in runs:
        rows = np.array(r["rows"], dtype=np.float64)
        start = 0
        for k, level in enumerate(levels):
            end = next((s for s, acc in r["evals"] if acc >= level), len(rows))
            if end > start:
                phases[k].append(rows[start:end])
            start = max(start, end)
    out = []
    for level, parts in zip(levels, phases, strict=True):
        if not parts:
            continue
        rows = np.concatenate(parts)
        var = float(np.mean(rows[:, 1]))
        signal = [float(np.nanmean(rows[:, 0]))] + [
            float(np.nanmean(rows[:, 2 + i])) for i in range(len(names) - 1)
        ]
        out.append(
            {
                "to": level,
                "steps": len(rows),
                "var": var,
                "signal": dict(zip(names, signal, strict=True)),
                "noise_scale": {
                    n: (var / s if s > 0 else math.inf) for n, s in zip(names, signal, strict=True)
                },
            }
        )
    return out


def table(phases: Sequence[dict[str, Any]]) -> str:
    """Two tables, one row per phase: the implied noise scales (inf where the signal
    statistic is at or below 0), and each signal statistic over the same-step |G|^2."""
    names = list(phases[0]["noise_scale"])
    lines = ["| to | steps | tr(Sigma) | " + " | ".join(names) + " |"]
    lines.append("|" + "---|" * (3 + len(names)))
    for p in phases:
        cells = [f"{p['noise_scale'][n]:.0f}" for n in names]
        lines.append(
            f"| {p['to']:.3g} | {p['steps']} | {p['var']:.1f} | " + " | ".join(cells) + " |"
        )
    lines += ["", "| to | |G|^2 | " + " | ".join(f"{n} / simple" for n in names[1:]) + " |"]
    lines.append("|" + "---|" * (1 + len(names)))
    for p in phases:
        simple = p["signal"]["simple"]
        cells = [f"{p['signal'][n] / simple:.2f}" for n in names[1:]]
        lines.append(f"| {p['to']:.3g} | {simple:.3g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@attrs.define(eq=False)
class PersistentSignalScale(GradientNoiseScale):
    """A prototype estimator whose |G|^2 is the product with the past gradients' average.

    For `time_to_target --signal-memory` only: it tries the statistic measured above in
    the adaptive and fixed runs before core takes it. tr(Sigma) is core's
    two-micro-batch estimate; |G|^2 is ``g_t . e_{t-1}``, the step's mean gradient
    with the exponential average of the earlier steps' (`GradientMemory`), which the
    training loop queues (`pending`) before each optimiser step and `update` takes
    in order (the step contract folds a step's norms at the next step). A step
    without a product (the first) keeps core's estimate. One parameter group only.

    ``decision_only`` False: the product replaces |G|^2 everywhere, so the AdaScale
    gain (the learning rate and the progress) rests on it too. True: the estimator
    keeps core's statistics for the gain and answers the batch-size decision's
    questions (`grad_params`, `grad_params_bound`, `resolved`) from a second
    estimator, ``persistent``, that folds the product in their place: a larger
    batch's rate then does not feed back into the statistic its size is chosen on.
    """

    pending: collections.deque[float] = attrs.field(factory=collections.deque)
    decision_only: bool = attrs.field(default=False)
    persistent: GradientNoiseScale | None = attrs.field(default=None)

    def update(
        self,
        local_sqr: Any,
        total_sqr: Any,
        count: int,
        batch_size: int,
        *,
        share: float = 1.0,
    ) -> None:
        """`GradientNoiseScale.update` with |G|^2 replaced by the queued product (a
        measured step standing for ``1 / share`` steps, as there)."""
        if self.num_groups != 1:
            raise ValueError("PersistentSignalScale takes one parameter group")
        local = float(np.asarray(local_sqr).reshape(-1)[0])
        total = float(np.asarray(total_sqr).reshape(-1)[0])
        sqr, var = step_estimates(local, total, count, batch_size)
        signal = sqr
        if self.pending:
            product = self.pending.popleft()
            if math.isfinite(product):
                signal = product
        scale = count * batch_size / self.init_batch_size / share
        if self.decision_only:
            if self.persistent is None:
                self.persistent = GradientNoiseScale(
                    self.init_batch_size, smoothing=self.smoothing
                )
            self.persistent._fold((signal,), (var,), scale)
            super().update(local, total, count, batch_size, share=share)
            return
        if self.differenced:
            self._restart()
        self.differenced = False
        self._fold((signal,), (var,), scale)

    def update_differenced(self, *args: Any, **kwargs: Any) -> None:
        """Refused: a single-micro-batch step has no same-step noise estimate to pair."""
        raise ValueError(
            "PersistentSignalScale needs steps of two or more micro-batches (two replicas)"
        )

    def _decision(self) -> GradientNoiseScale:
        if self.decision_only and self.persistent is not None:
            return self.persistent
        return self

    def grad_params(self) -> Any:
        """The decision's statistics (the persistent ones under ``decision_only``)."""
        source = self._decision()
        return super().grad_params() if source is self else source.grad_params()

    def grad_params_bound(self, z: float) -> Any:
        """The decision's lower confidence bound (persistent under ``decision_only``)."""
        source = self._decision()
        return super().grad_params_bound(z) if source is self else source.grad_params_bound(z)

    @property
    def resolved(self) -> bool:
        """Whether the decision's estimate resolves a gradient."""
        source = self._decision()
        return self.has_estimate and (source._raw_sqr > 0.0)


class GradientMemory:
    """The exponential average ``e`` of the mean gradients of the steps so far.

    `product` returns ``g . e`` for this step's mean gradient ``g`` (the parameters'
    ``.grad``, averaged over the replicas) and then folds ``g`` in: ``e_t = beta *
    e_{t-1} + (1 - beta) * g_t``, normalised by its weights (NaN at the first step).
    ``beta`` 0 pairs each step with the previous one only. These are the steps' own
    gradients, so the product carries the bias `run` describes (``held_out`` False).
    """

    def __init__(self, beta: float) -> None:
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta!r}")
        self.beta = beta
        self.average: Any = None
        self.weight = 0.0

    def product(self, params: Sequence[Any]) -> float:
        """``g . e_{t-1}`` for the gradients of ``params``; folds ``g`` into ``e``."""
        import torch

        return self.pair(
            torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None]).double()
        )

    def pair(self, current: Any, earlier: Any = None) -> float:
        """``current . e_{t-1}`` (NaN before any fold), then folds ``earlier`` (default:
        ``current``) into ``e``: `run`'s held-out measurement folds another draw."""
        earlier = current if earlier is None else earlier
        out = math.nan if self.average is None else float(current @ self.average) / self.weight
        rest = 1.0 - self.beta
        self.average = (
            earlier * rest if self.average is None else self.average * self.beta + earlier * rest
        )
        self.weight = self.weight * self.beta + rest
        return out


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run seeds (or read saved runs) and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0", help="comma-separated seeds")
    parser.add_argument("--problem", default="shapes", choices=sorted(LEVELS))
    parser.add_argument("--out", type=Path, default=Path("out/persist"))
    parser.add_argument("--from-log", type=Path, nargs="+", help="summarise these JSON files")
    parser.add_argument(
        "--own-gradients",
        action="store_true",
        help="pair with the earlier steps' own mean gradients (biased; the first measurement)",
    )
    args = parser.parse_args(argv)
    if args.from_log:
        runs = [json.loads(p.read_text()) for p in args.from_log]
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        runs = []
        for s in (int(v) for v in args.seeds.split(",")):
            r = run(s, args.problem, held_out=not args.own_gradients)
            (args.out / f"seed{s}.json").write_text(json.dumps(r))
            runs.append(r)
    phases = summarise(runs)
    print(table(phases))
    return phases


if __name__ == "__main__":
    main()
