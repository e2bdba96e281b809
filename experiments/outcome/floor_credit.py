"""A batch-size decision crediting a batch with the noise floor it keeps (#18, eleventh follow-up).

The tenth follow-up (`noise_match`) found that shapes' large fixed batches reach the
target at less scale-invariant progress because a step at gain ``r`` on ``S`` times
the initial batch carries ``r / S`` of the initial batch's gradient noise per unit of
progress, and that ``r / S`` is Pollux's efficiency ``E(M) = (B + M0) / (B + M)``.
The goodput model credits a batch with its progress per second only; the loss the
noise costs is not in it. This prototype puts it in.

**The account.** To second order, one step ``dx`` changes the loss by ``G_t . dx +
dx' H dx / 2``: a first-order gain ``F = -G_t . dx`` less a curvature cost. The
noise's part of that cost per unit of progress scales as ``r / S = E(M)`` (the
squared rate ``r^2`` over ``M``, per ``r`` units), so the loss gained per unit of
progress at batch ``M``, over the first-order gain, is about ``1 - kappa E(M)``,
``kappa`` the share of the first-order gain the initial batch's noise costs. The
decision's objective becomes progress per second times that:
``throughput(M) E(M) (1 - kappa E(M))`` (Pollux's goodput at ``kappa = 0``).

**The measurement** (`FloorMeter`), from what a data-parallel job sees anyway:
the step's averaged gradient ``g_t``, the update ``dx_t`` and the next step's
gradient ``g_{t+1}`` (a fresh batch at ``x_{t+1}``). ``g_{t+1} . dx_t`` is unbiased
for ``G_{t+1} . dx_t = G_t . dx_t + dx_t' H dx_t``. ``g_t . dx_t`` is not for ``G_t .
dx_t``: the update holds ``g_t``'s own noise with the weight ``w_t`` the optimiser
gives the current gradient (the learning rate applied, for SGD with or without
momentum), so ``E[g_t . dx_t] = E[G_t . dx_t] - w_t tr(Sigma) / M``, and the job's
noise estimate supplies ``tr(Sigma)``. With ``S_t = g_t . dx_t + w_t tr(Sigma) / M``
and ``A_t = g_{t+1} . dx_t``, the share of the first-order gain the curvature takes
back is ``lambda = (A - S) / (-2 S)`` (averages over steps). All of it is booked to
the noise (the drift's own curvature cost, ``r eta0 h / 2`` per unit of progress,
is left out: it would credit the large batches less), so ``kappa = lambda / E(M_t)``
at the batch ``M_t`` it was measured at.

**The decision.** Core's optimiser maximises Pollux's goodput exactly; this
objective is not of its form. `FloorCreditScale` gives the decision a noise scale
``B'`` whose Pollux optimum has the same stationarity condition at the current
batch ``M``: ``d log(E (1 - kappa E)) / d log M = d log E / d log M * (1 - 2 kappa
E) / (1 - kappa E)``, so ``B' + M = (B + M) (1 - kappa E) / (1 - 2 kappa E)``
(`credited_scale`; unbounded where ``2 kappa E >= 1``, where a larger batch is
worth more per unit of progress whatever its cost in progress). Decisions repeat
along the run, so the current batch moves toward the credited optimum. The AdaScale
gain (the learning rate and the progress) keeps core's estimate.

SGD-type optimisers only: under Adam the noise's weight in the update is the
preconditioner, not a number (`check_config` refuses it).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from experiments.outcome.time_to_target import total_of
from experiments.outcome.trainer import cosine_lr

from adaptdl.core.gns import GradientNoiseScale
from adaptdl.core.goodput import GradParams

#: ``2 kappa E`` at or above this: the credited noise scale is taken as unbounded.
_UNBOUNDED = 1.0 - 1e-9
#: The noise scale given for "unbounded" (a finite number, for GradParams).
_HUGE = 1e12


def credited_scale(scale: float, batch: float, init_batch: float, kappa: float) -> float:
    """The noise scale ``B'`` whose Pollux optimum matches the floor-credited one at ``batch``.

    ``scale`` is the measured noise scale ``B``, ``kappa`` the share of the initial
    batch's first-order gain its noise costs (0 gives ``B`` back). Unbounded
    (`_HUGE`) where ``2 kappa E(batch) >= 1``.
    """
    if not (scale >= 0.0 and batch > 0.0 and init_batch > 0.0):
        raise ValueError(
            f"need scale >= 0, batch > 0, init_batch > 0; got {scale!r}, {batch!r}, {init_batch!r}"
        )
    if not math.isfinite(kappa) or kappa <= 0.0 or not math.isfinite(scale):
        return scale
    e = min((scale + init_batch) / (scale + batch), 1.0)
    if 2.0 * kappa * e >= _UNBOUNDED:
        return _HUGE
    return max((scale + batch) * (1.0 - kappa * e) / (1.0 - 2.0 * kappa * e) - batch, scale)


@attrs.define(eq=False)
class FloorMeter:
    """The curvature's share ``lambda`` of the first-order gain, measured along a run.

    The training loop calls `before_step` with the step's averaged gradients and
    parameters, then `after_step` once the optimiser has moved them. Sums are
    exponential averages with memory ``beta`` per step; `share` is None until
    ``min_steps`` pairs are in.
    """

    beta: float = 0.99
    min_steps: int = 50
    batch: float = 0.0
    pairs: int = 0
    _gain_sum: float = 0.0  # -S, the first-order gain
    _cost_sum: float = 0.0  # (A - S) / 2, the curvature cost
    _grad: Any = None
    _params: Any = None
    _step: Any = None
    _first_order: float = math.nan

    def __attrs_post_init__(self) -> None:
        if not 0.0 <= self.beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {self.beta!r}")

    def before_step(self, params: Sequence[Any]) -> None:
        """Read the step's gradient and parameters; pair the previous step's update."""
        import torch

        grad = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None]).double()
        if self._step is not None and math.isfinite(self._first_order):
            after = float(grad @ self._step)
            self._fold(-self._first_order, 0.5 * (after - self._first_order))
        self._grad = grad
        self._params = torch.cat(
            [p.detach().reshape(-1) for p in params if p.grad is not None]
        ).double()

    def after_step(self, params: Sequence[Any], weight: float, var: float, batch: float) -> None:
        """The update just applied; ``weight`` is the current gradient's in it (the
        learning rate applied), ``var`` the job's tr(Sigma), ``batch`` the total size."""
        import torch

        now = torch.cat([p.detach().reshape(-1) for p in params if p.grad is not None]).double()
        self._step = now - self._params
        self._first_order = float(self._grad @ self._step) + weight * var / batch
        self.batch = float(batch)
        self._grad = self._params = None

    def _fold(self, gain: float, cost: float) -> None:
        if not (math.isfinite(gain) and math.isfinite(cost)):
            return
        self._gain_sum = self.beta * self._gain_sum + (1.0 - self.beta) * gain
        self._cost_sum = self.beta * self._cost_sum + (1.0 - self.beta) * cost
        self.pairs += 1

    @property
    def share(self) -> float | None:
        """``lambda``: the curvature cost over the first-order gain (None while immature)."""
        if self.pairs < self.min_steps or self._gain_sum <= 0.0:
            return None
        return self._cost_sum / self._gain_sum


@attrs.define(eq=False)
class FloorCreditScale(GradientNoiseScale):
    """Core's estimator, whose answers to the batch-size decision credit the noise floor.

    `grad_params` and `grad_params_bound` give the noise scale `credited_scale` makes of
    core's (each of them, at the meter's current batch); the gain is core's.
    """

    meter: FloorMeter | None = attrs.field(default=None)

    def kappa(self, scale: float) -> float:
        """The initial batch's share at the measured ``scale`` (0 while immature)."""
        if self.meter is None or self.meter.share is None or self.meter.batch <= 0.0:
            return 0.0
        m0 = float(self.init_batch_size)
        e = min((scale + m0) / (scale + self.meter.batch), 1.0) if math.isfinite(scale) else 1.0
        return max(self.meter.share, 0.0) / e

    def _credit(self, params: GradParams | None) -> GradParams | None:
        if params is None or self.meter is None or params.sqr <= 0.0:
            return params
        m0 = float(self.init_batch_size)
        scale = params.var * m0 / params.sqr
        kappa = self.kappa(scale)
        credited = credited_scale(scale, max(self.meter.batch, m0), m0, kappa)
        return GradParams(sqr=params.sqr, var=credited * params.sqr / m0)

    def grad_params(self) -> GradParams | None:
        """Core's statistics with the credited noise scale."""
        return self._credit(super().grad_params())

    def grad_params_bound(self, z: float) -> GradParams | None:
        """Core's lower confidence bound with the credited noise scale."""
        return self._credit(super().grad_params_bound(z))


def floor_level(lr: float, momentum: float, var: float, batch: float) -> float:
    """SGD with momentum's quadratic noise floor, ``lr / (1 - momentum) * tr(Sigma) / (4 batch)``.

    The loss a run at learning rate ``lr`` and total batch ``batch`` keeps above its
    noiseless path once the directions the noise excites have settled; in a quadratic
    model it does not depend on the curvature. ``var`` is tr(Sigma) per sample.
    """
    if not (lr >= 0.0 and 0.0 <= momentum < 1.0 and var >= 0.0 and batch > 0.0):
        raise ValueError(
            f"need lr >= 0, 0 <= momentum < 1, var >= 0, batch > 0; got "
            f"{lr!r}, {momentum!r}, {var!r}, {batch!r}"
        )
    return lr / (1.0 - momentum) * var / (4.0 * batch)


def floor_share(
    floor0: float, loss: float, efficiency: float, target_loss: float, cap: float = 0.9
) -> float:
    """The share ``f`` of the loss left to shed to ``target_loss`` that is the initial
    batch's noise floor ``floor0``, in [0, ``cap``].

    ``loss`` is the training loss now, at a batch of statistical ``efficiency`` (whose
    floor is ``floor0 * efficiency``). Left to shed at the initial batch: the drift
    ``loss - floor0 * efficiency`` less the target, plus ``floor0``. At or past the
    point where the floor is all that is left, ``cap``.
    """
    if not 0.0 <= cap < 1.0:
        raise ValueError(f"cap must be in [0, 1), got {cap!r}")
    left = loss - floor0 * efficiency - target_loss + floor0
    if not (math.isfinite(left) and math.isfinite(floor0)) or floor0 <= 0.0:
        return 0.0
    if left <= floor0:
        return cap
    return min(floor0 / left, cap)


def shared_scale(scale: float, init_batch: float, share: float) -> float:
    """The noise scale ``B' = (B + f M0) / (1 - f)`` at floor share ``f = share``.

    Exact, not an approximation: with ``E = (B + M0) / (B + M)``, the time to the
    target at batch ``M`` goes as ``(1 - f + f E) / (throughput E)`` (the drift's
    progress, plus the floor's ``f`` of the loss scaled by the noise level ``E``), and
    ``E / (1 - f + f E) = (B' + M0) / (B' + M)``: Pollux's efficiency at ``B'``.
    """
    if not 0.0 <= share < 1.0:
        raise ValueError(f"share must be in [0, 1), got {share!r}")
    return (scale + share * init_batch) / (1.0 - share)


@attrs.define(eq=False)
class FloorShareScale(GradientNoiseScale):
    """Core's estimator whose answers to the decision use `shared_scale` at ``share``.

    The training loop sets ``share`` (`floor_share`) as the run goes; the gain is core's.
    """

    share: float = 0.0

    def _shared(self, params: GradParams | None) -> GradParams | None:
        if params is None or params.sqr <= 0.0 or self.share <= 0.0:
            return params
        m0 = float(self.init_batch_size)
        scale = shared_scale(params.var * m0 / params.sqr, m0, self.share)
        return GradParams(sqr=params.sqr, var=scale * params.sqr / m0)

    def grad_params(self) -> GradParams | None:
        """Core's statistics at the shared noise scale."""
        return self._shared(super().grad_params())

    def grad_params_bound(self, z: float) -> GradParams | None:
        """Core's lower confidence bound at the shared noise scale."""
        return self._shared(super().grad_params_bound(z))


def check_config(cfg: dict[str, Any]) -> None:
    """Refuse what the measurement does not cover: Adam (a preconditioned update)."""
    if cfg.get("optimizer", "sgd") != "sgd":
        raise ValueError(
            f"floor_credit needs an SGD-type optimiser, got optimizer={cfg.get('optimizer')!r}"
        )


def kind_of(run: dict[str, Any]) -> str:
    """A run's kind: adaptive (and which decision), or fixed N (and its noise level)."""
    cfg = run["config"]
    if cfg.get("floor_target_loss") is not None:
        return f"adaptive, floor share to loss {cfg['floor_target_loss']:g}"
    if cfg.get("floor_credit"):
        return "adaptive, per-step credit"
    if cfg.get("autoscale"):
        return "adaptive"
    level = cfg.get("noise_match")
    size = f"fixed {total_of(cfg, run.get('replicas', 2))}"
    return f"{size}, noise level {float(level):g}" if level else size


def _by_kind(runs: Sequence[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for r in runs:
        seeds = out.setdefault(kind_of(r), {})
        if r["seed"] in seeds:
            raise ValueError(f"two {kind_of(r)!r} runs of seed {r['seed']} (give --pool)")
        seeds[r["seed"]] = r
    return out


def pool_repeats(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One run per kind and seed: repeats become their mean (CPU time, a miss at its
    whole run's; progress and samples where every repeat reached the target)."""
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


def _cpu(run: dict[str, Any]) -> float:
    """CPU seconds to the target, or the whole run's where it missed (as `summaries`)."""
    reached = run.get("reached")
    return float(reached["cpu_seconds"] if reached else run["train_cpu_seconds"])


def target_table(runs: Sequence[dict[str, Any]]) -> str:
    """Per kind: CPU seconds, progress and samples to the target (medians; a miss counts
    at its whole run's time) and, for each adaptive kind, `summaries.paired` against the
    best fixed size in ``runs``: per seed its CPU time over the run's, the ratio of the
    medians and its bootstrap interval; for each floor decision, core's adaptive run's
    CPU time over its, per seed."""
    from experiments.outcome.summaries import paired

    kinds = _by_kind(runs)
    fixed = [k for k in kinds if k.startswith("fixed") and "noise level" not in k]
    if not fixed:
        raise ValueError("no fixed-size runs to compare with")
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
        if kind not in fixed and (pair := paired(labelled, fixed, kind)) is not None:
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
    """(training loss, predicted floor) of a fixed run at the progress ``grid``."""
    cfg = run["config"]
    steps = np.asarray(run["steps"], dtype=np.float64)
    noise = np.asarray(run["noise"], dtype=np.float64)
    cap = cfg["progress_epochs"] * cfg["train_size"] / cfg["init_batch_size"]
    loss = np.array(
        [
            np.mean(steps[m, 6])
            if (m := (steps[:, 0] > 0.95 * p) & (steps[:, 0] < 1.05 * p)).any()
            else math.nan
            for p in grid
        ]
    )
    var = np.interp(grid, noise[:, 0], noise[:, 3], right=math.nan)
    gain = np.interp(grid, steps[:, 0], steps[:, 5], right=math.nan)
    size = steps[0, 1]
    level = float(cfg.get("noise_match") or 0.0)
    floor = []
    for p, v, r in zip(grid, var, gain, strict=True):
        if not (math.isfinite(v) and math.isfinite(r)):
            floor.append(math.nan)
            continue
        # The step's noise: the batch's own, or the matched level's (noise_match).
        batch = min(size, cfg["init_batch_size"] * r / level) if level else size
        lr = cosine_lr(cfg, min(p / cap, 1.0)) * r
        floor.append(floor_level(lr, cfg.get("momentum", 0.0), v, batch))
    return loss, np.array(floor)


def floor_gap_table(runs: Sequence[dict[str, Any]], grid: Sequence[float]) -> str:
    """Per fixed kind, at each progress in ``grid``: the training loss over the seed's fixed
    16 run's, measured / predicted by `floor_level` (medians over seeds)."""
    at = np.asarray(grid, dtype=np.float64)
    kinds = _by_kind([r for r in runs if not r["config"].get("autoscale")])
    base_kind = f"fixed {runs[0]['config']['init_batch_size']}"
    if base_kind not in kinds:
        raise ValueError(f"floor_gap_table needs the {base_kind} runs")
    base = {s: _floor_along(r, at) for s, r in kinds[base_kind].items()}
    lines = [
        "| run: training loss over fixed 16's, measured / predicted | "
        + " | ".join(f"{p / 1000:g}k" for p in at)
        + " |",
        "|---" * (len(at) + 1) + "|",
    ]
    for kind, seeds in kinds.items():
        if kind == base_kind:
            continue
        gaps = []
        for s, r in seeds.items():
            if s in base:
                loss, floor = _floor_along(r, at)
                gaps.append(np.stack([loss - base[s][0], floor - base[s][1]]))
        med = np.nanmedian(np.array(gaps), axis=0)
        cells = [f"{m:+.3f} / {p:+.3f}" for m, p in zip(med[0], med[1], strict=True)]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Print `target_table` (``--gaps``: `floor_gap_table`) of time_to_target logs."""
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
    if args.pool:
        runs = pool_repeats(runs)
    try:
        if args.gaps:
            print(floor_gap_table(runs, [float(x) for x in args.gaps.split(",")]))
        else:
            print(target_table(runs))
    except ValueError as err:
        parser.error(str(err))


if __name__ == "__main__":
    main()
