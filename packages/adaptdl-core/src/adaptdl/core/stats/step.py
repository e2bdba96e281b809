"""The step contract: what an adapter measured at one optimiser step in, core's decision out.

Once per optimiser step an adapter (torch's `AdaptiveDataParallel`, the simulator's
replay, an experiment in numpy) hands core a `StepMeasurement`: per parameter group
the squared norms of its local micro-batch gradients and of the step's averaged
gradient, how many micro-batches the step averaged, and, for a step of a single
micro-batch, the norms that pair it with the previous step. `StepStatistics` folds
them into the job's `GradientNoiseScale` and returns a `StepDecision`: the
learning-rate factor of each group under the scaling rule, the step's gain and the
job's progress once the step is taken. A program that reports its training loss
hands core the step's `StepLoss` with the decision's question: core folds it into
the job's noise floor (`MetricsState.observe_loss`) at the progress before the step.

Three rules live here and nowhere else:

* the one-step lag: with several replicas, the replicas' local norms are summed in
  the background and folded in at the next step, so that no replica waits on the
  network; a lag of one step is immaterial to a moving average over hundreds;
* the non-finite skip: a step whose norms are not all finite (an overflow, a
  GradScaler's inf step) leaves the estimator untouched;
* progress: each optimiser step adds its gain at the step's scale to the job's
  scale-invariant progress (`MetricsState.progress`), after the step;
* the budget: which steps measure at all (`StepStatistics.measures`), a share of the
  steps that keeps the statistics' cost within a share of the step time
  (`adaptdl.core.stats.statsbudget`); a measured step stands for ``1 / share`` steps in
  the estimator.

An adapter that measures and steps at different moments (torch measures after the
backward pass, steps in ``optimizer.step()``) calls `StepStatistics.measure`, then
`StepStatistics.decide` and `StepStatistics.commit`; one that does both at once
calls `StepStatistics.step`. The loss rides with `decide`, not with the
measurement: every optimiser step that reports a loss has one, while only the
steps the budget chooses measure (and torch reads a step's norms one step late).
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Sequence
from typing import Any

import attrs

from adaptdl.core.collective import Collective, Future
from adaptdl.core.stats.gns import GradientNoiseScale
from adaptdl.core.stats.metrics import MetricsState
from adaptdl.core.stats.scaling import ScalingRule
from adaptdl.core.stats.statsbudget import MeasureBudget
from adaptdl.core.validate import ArgumentTypeError, check_float, check_int

LOG = logging.getLogger("adaptdl.core.stats.step")


def _set_norms(instance: object, *names: str) -> None:
    """Replace each field in ``names`` by a tuple of floats, one per group, or raise.

    Non-finite norms are allowed: they are a measurement (an overflowed gradient)
    that the contract skips, not a caller's mistake.
    """
    for name in names:
        value = getattr(instance, name)
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise ArgumentTypeError(
                f"{name} must be a sequence of floats, one per parameter group, got {value!r}"
            )
        out = []
        for i, v in enumerate(value):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ArgumentTypeError(f"{name}[{i}] must be a real number, got {v!r}")
            out.append(float(v))
        if not out:
            raise ValueError(f"{name} must have one value per parameter group, got none")
        object.__setattr__(instance, name, tuple(out))


def _finite(values: tuple[float, ...]) -> bool:
    return all(math.isfinite(v) for v in values)


@attrs.frozen
class PairedNorms:
    """Squared norms that pair a single-micro-batch step with the previous one.

    Per group, with ``g_p`` the previous step's gradient and ``g_c`` this step's,
    both with this step's preconditioner (if any): ``prev_sqr = |g_p|^2`` and
    ``mixed_sqr = |(g_p + g_c) / 2|^2``; ``prev_batch_size`` samples made ``g_p``.
    """

    prev_sqr: tuple[float, ...]
    mixed_sqr: tuple[float, ...]
    prev_batch_size: int

    def __attrs_post_init__(self) -> None:
        _set_norms(self, "prev_sqr", "mixed_sqr")
        check_int("prev_batch_size", self.prev_batch_size, min=1)
        if len(self.prev_sqr) != len(self.mixed_sqr):
            raise ValueError(
                f"prev_sqr and mixed_sqr must have one value per group each, got "
                f"{len(self.prev_sqr)} and {len(self.mixed_sqr)}"
            )


@attrs.frozen
class StepMeasurement:
    """What one replica measured at one optimiser step.

    Per parameter group:

    * ``local_sqr``: the sum, over this replica's micro-batches of the step, of the
      squared norm of each micro-batch's (mean) gradient;
    * ``total_sqr``: the squared norm of the step's averaged gradient (after the
      all-reduce and accumulation), the same on every replica; with
      ``total_partial``, this replica's part of it (the squares of the share of the
      averaged gradient it holds or was given to measure), the replicas' parts
      adding up to it.

    ``micro_batches``: micro-batches this replica averaged (accumulation steps + 1);
    ``num_replicas``: replicas in the step; ``batch_size``: samples per micro-batch
    (the atomic batch size). ``pair``: for a step of one micro-batch in all, the norms
    that pair it with the previous such step (None: no previous step to pair with).
    ``share``: the share of steps measured when this one was chosen
    (`StepStatistics.share`): it stands for ``1 / share`` steps. ``cost``: seconds the
    replica spent on the statistics' work of this step; ``step_time``: seconds per
    optimiser step lately (0: unknown); both feed the budget. ``total_partial``:
    ``total_sqr`` is this replica's part (several replicas only): a sharded model's
    shard, or a replicated model's gradient split between the replicas so that each
    pays a part of the pass over it; core sums the parts with the local norms.
    """

    local_sqr: tuple[float, ...]
    total_sqr: tuple[float, ...]
    micro_batches: int
    num_replicas: int
    batch_size: int
    pair: PairedNorms | None = None
    share: float = 1.0
    cost: float = 0.0
    step_time: float = 0.0
    total_partial: bool = False

    def __attrs_post_init__(self) -> None:
        _set_norms(self, "local_sqr", "total_sqr")
        object.__setattr__(
            self, "share", check_float("share", self.share, min=0.0, max=1.0, min_exclusive=True)
        )
        object.__setattr__(self, "cost", check_float("cost", self.cost, min=0.0))
        object.__setattr__(self, "step_time", check_float("step_time", self.step_time, min=0.0))
        check_int("micro_batches", self.micro_batches, min=1)
        check_int("num_replicas", self.num_replicas, min=1)
        check_int("batch_size", self.batch_size, min=1)
        if not isinstance(self.total_partial, bool):
            raise ArgumentTypeError(f"total_partial must be a bool, got {self.total_partial!r}")
        if self.total_partial and self.num_replicas == 1:
            raise ValueError(
                "total_partial is for several replicas (one replica's total is whole), got "
                "num_replicas=1"
            )
        groups = len(self.total_sqr)
        if len(self.local_sqr) != groups:
            raise ValueError(
                f"local_sqr and total_sqr must have one value per group each, got "
                f"{len(self.local_sqr)} and {groups}"
            )
        if self.pair is not None:
            if not isinstance(self.pair, PairedNorms):
                raise ArgumentTypeError(f"pair must be PairedNorms or None, got {self.pair!r}")
            if self.count != 1:
                raise ValueError(
                    f"pair is only for a step of one micro-batch in all, got {self.count} "
                    f"({self.num_replicas} replicas x {self.micro_batches} micro-batches)"
                )
            if len(self.pair.prev_sqr) != groups:
                raise ValueError(
                    f"pair must have {groups} values per norm (one per group), got "
                    f"{len(self.pair.prev_sqr)}"
                )

    @property
    def num_groups(self) -> int:
        return len(self.total_sqr)

    @property
    def count(self) -> int:
        """Micro-batches the step averaged over all replicas."""
        return self.num_replicas * self.micro_batches


@attrs.frozen
class StepLoss:
    """The training loss a program reported for one optimiser step, for the noise floor.

    ``loss``: the mean of the finite losses reported for the step's micro-batches
    (NaN when none was finite: the floor counts the step and folds nothing);
    ``rates``: per parameter group, SGD's rate at the group's base learning rate
    (`adaptdl.core.stats.floor.sgd_rate`); ``target_loss``: the training loss aimed
    at (None: none stated). TypeError or ValueError names a field out of range.
    """

    loss: float
    rates: tuple[float, ...]
    target_loss: float | None = None

    def __attrs_post_init__(self) -> None:
        if isinstance(self.loss, bool) or not isinstance(self.loss, (int, float)):
            raise ArgumentTypeError(f"loss must be a real number, got {self.loss!r}")
        object.__setattr__(self, "loss", float(self.loss))
        if isinstance(self.rates, (str, bytes)) or not isinstance(self.rates, Sequence):
            raise ArgumentTypeError(
                f"rates must be a sequence of floats, one per parameter group, got {self.rates!r}"
            )
        rates = tuple(check_float(f"rates[{i}]", r, min=0.0) for i, r in enumerate(self.rates))
        if not rates:
            raise ValueError("rates must have one value per parameter group, got none")
        object.__setattr__(self, "rates", rates)
        if self.target_loss is not None:
            object.__setattr__(self, "target_loss", check_float("target_loss", self.target_loss))


class Fold(enum.Enum):
    """What `StepStatistics.measure` did with a measurement."""

    #: The estimator took the step's statistics now.
    FOLDED = "folded"
    #: The replicas' sum is under way; the statistics are folded in at the next step.
    PENDING = "pending"
    #: One micro-batch with nothing to pair it with (or an unusable pair): nothing
    #: folded, but the step's gradient may pair with the next one.
    UNPAIRED = "unpaired"
    #: The step's own gradient is not finite: nothing folded, nothing to pair with.
    SKIPPED = "skipped"

    @property
    def pairable(self) -> bool:
        """Whether a single-micro-batch step's gradient may pair with the next step's."""
        return self is not Fold.SKIPPED


@attrs.frozen
class StepDecision:
    """Core's answer for one optimiser step.

    ``lr_factors``: per parameter group, the multiplier of its base learning rate
    for this step; ``gain``: the step's AdaScale gain at ``scale`` (total batch size
    over the initial one); ``progress``: the job's scale-invariant progress once
    the step is committed.
    """

    lr_factors: tuple[float, ...]
    gain: float
    scale: float
    progress: float


#: The replicas' sum in flight, this replica's totals (None: in the sum), the step's
#: micro-batches, batch size, share and replicas.
_Pending = tuple[Future[Any], tuple[float, ...] | None, int, int, float, int]


class StepStatistics:
    """The per-step statistics path of one job replica: noise update, lag, skip, rule, progress.

    ``metrics`` holds the job's estimator and progress; ``collective`` sums the
    replicas' local norms (every replica must call `measure` at the same steps, the
    ones `measures` names). ``budget``: which steps measure (default `MeasureBudget()`).
    """

    def __init__(
        self,
        metrics: MetricsState,
        collective: Collective,
        budget: MeasureBudget | None = None,
    ) -> None:
        self.metrics = metrics
        self.collective = collective
        self.budget = budget if budget is not None else MeasureBudget()
        #: Optimiser steps committed so far (the index of the next step).
        self.taken = 0
        self._pending: _Pending | None = None

    @property
    def share(self) -> float:
        """The share of steps measured now (1: every step)."""
        return self.budget.share

    def measures(self, ahead: int = 0) -> bool:
        """Whether the optimiser step ``ahead`` steps after the next one is measured.

        The same answer on every replica: the share moves only in `measure`, on the
        replicas' summed inputs.
        """
        return self.budget.measures(self.taken + check_int("ahead", ahead, min=0))

    def measure(self, measurement: StepMeasurement, init_batch_size: int) -> Fold:
        """Fold one step's measurement into the estimator (made for ``init_batch_size``).

        A sum started at the previous step is folded in first.
        """
        if not isinstance(measurement, StepMeasurement):
            raise ArgumentTypeError(
                f"measurement must be a StepMeasurement, got {type(measurement).__name__}"
            )
        init_batch_size = check_int("init_batch_size", init_batch_size, min=1)
        self._fold_pending()
        m = measurement
        gns = self.metrics.ensure_gns(init_batch_size, m.num_groups)
        if m.num_replicas > 1:
            # The budget's inputs ride with the local norms (several replicas: always two
            # micro-batches or more): every replica moves the share alike, at the fold.
            # Partial totals ride along too, summed into the whole.
            parts = m.total_sqr if m.total_partial else ()
            summed = [*m.local_sqr, *parts, m.cost, m.step_time]
            local = self.collective.allreduce_async(summed)
            total = None if m.total_partial else m.total_sqr
            self._pending = (local, total, m.count, m.batch_size, m.share, m.num_replicas)
            return Fold.PENDING
        self.budget.record(m.cost, m.step_time, next_step=self.taken + 1)
        if m.count >= 2:
            return self._fold(gns, m.local_sqr, m.total_sqr, m.count, m.batch_size, m.share)
        if not _finite(m.total_sqr):
            _warn_skip()
            return Fold.SKIPPED
        if m.pair is None:
            return Fold.UNPAIRED
        values = m.pair.prev_sqr + m.total_sqr + m.pair.mixed_sqr
        if not _finite(values):
            _warn_skip()
            return Fold.UNPAIRED
        gns.update_differenced(
            m.pair.prev_sqr,
            m.total_sqr,
            m.pair.mixed_sqr,
            m.batch_size,
            m.pair.prev_batch_size,
            share=m.share,
        )
        return Fold.FOLDED

    def decide(
        self,
        batch_size: int,
        rule: ScalingRule,
        num_groups: int | None = None,
        *,
        loss: StepLoss | None = None,
    ) -> StepDecision | None:
        """The decision for a step of ``batch_size`` samples in all under ``rule``.

        ``num_groups``: the optimiser's parameter groups (default: the estimator's).
        None before the job has an estimator (no training loader yet): the step
        then takes the base learning rate and makes no recorded progress.
        ``loss``: the step's reported training loss (None: none reported), folded
        into the job's noise floor here, before the step is taken, at the progress
        before it (ignored, like the step, while there is no estimator). The
        decision does not read the floor.
        """
        gns = self.metrics.gns
        if gns is None:
            return None
        if loss is not None and not isinstance(loss, StepLoss):
            raise ArgumentTypeError(f"loss must be a StepLoss or None, got {loss!r}")
        decision = decide(gns, self.metrics.progress, batch_size, rule, num_groups)
        if loss is not None:
            self.metrics.observe_loss(loss.loss, loss.rates, batch_size, loss.target_loss)
        return decision

    def commit(self, decision: StepDecision, *, step: int | None = None) -> None:
        """Record that the step of ``decision`` was taken: add its gain to the progress.

        ``step``: the job's step this is, so that a second model stepped in the same
        batch adds no second step of progress (`MetricsState.add_progress`).
        """
        self.metrics.add_progress(decision.gain, step=step)
        self.taken += 1

    def step(
        self,
        measurement: StepMeasurement,
        *,
        init_batch_size: int,
        batch_size: int,
        rule: ScalingRule,
        loss: StepLoss | None = None,
    ) -> StepDecision:
        """`measure`, `decide` (with the step's ``loss``, if reported) and `commit` one
        step at once; return the decision."""
        self.measure(measurement, init_batch_size)
        decision = self.decide(batch_size, rule, loss=loss)
        assert decision is not None  # measure made the estimator
        self.commit(decision)
        return decision

    def drain(self) -> None:
        """Fold in the sum started at the last step (it would otherwise stay in flight)."""
        self._fold_pending()

    def _fold_pending(self) -> None:
        pending, self._pending = self._pending, None
        gns = self.metrics.gns
        if pending is None or gns is None:
            return
        future, total, count, bsz, share, replicas = pending
        values = list(future.result())
        self._record(values, replicas)
        groups = gns.num_groups
        if total is None:
            total = tuple(values[groups : 2 * groups])
        self._fold(gns, tuple(values[:groups]), total, count, bsz, share)

    def _record(self, summed: Sequence[float], num_replicas: int) -> None:
        """Feed the budget the replicas' mean cost and step time (``summed`` over them)."""
        cost, step_time = summed[-2:]
        # Folded while step `taken` is under way (or between steps, at a drain): the
        # share it moves applies from the step after, which no replica has planned.
        self.budget.record(
            max(cost, 0.0) / num_replicas,
            max(step_time, 0.0) / num_replicas,
            next_step=self.taken + 1,
        )

    @staticmethod
    def _fold(
        gns: GradientNoiseScale,
        local: tuple[float, ...],
        total: tuple[float, ...],
        count: int,
        batch_size: int,
        share: float = 1.0,
    ) -> Fold:
        if not (_finite(local) and _finite(total)):
            _warn_skip()
            return Fold.SKIPPED
        gns.update(local, total, count, batch_size, share=share)
        return Fold.FOLDED


def decide(
    gns: GradientNoiseScale,
    progress: float,
    batch_size: int,
    rule: ScalingRule,
    num_groups: int | None = None,
) -> StepDecision:
    """The decision for a step of ``batch_size`` samples with ``gns`` and ``progress`` so far.

    The factor is the rule's at the whole model's gain, the same for each of
    ``num_groups`` parameter groups (default: the estimator's groups).
    """
    batch_size = check_int("batch_size", batch_size, min=1)
    groups = gns.num_groups if num_groups is None else check_int("num_groups", num_groups, min=1)
    progress = check_float("progress", progress, min=0.0)
    scale = batch_size / gns.init_batch_size
    gain = gns.gain(scale)
    factor = float(rule.lr_factor(gain, scale, progress))
    return StepDecision(
        lr_factors=(factor,) * groups,
        gain=gain,
        scale=scale,
        progress=progress + gain,
    )


def split_by_size(sizes: Sequence[Sequence[int]], replicas: int) -> list[list[int]]:
    """Which replica measures each tensor of a replicated gradient (`StepMeasurement.
    total_partial`): per group, per tensor of ``sizes`` (element counts), its replica.

    The largest first, each to the replica with the fewest elements so far (ties: the
    lower group, index and rank), so every replica computes the same split and the
    most loaded holds at most the least loaded's elements plus one tensor's.
    """
    replicas = check_int("replicas", replicas, min=1)
    loads = [0] * replicas
    owner = [[0] * len(group) for group in sizes]
    order = sorted(
        ((n, i, j) for i, group in enumerate(sizes) for j, n in enumerate(group)),
        key=lambda item: (-item[0], item[1], item[2]),
    )
    for n, i, j in order:
        least = min(range(replicas), key=lambda r: (loads[r], r))
        owner[i][j] = least
        loads[least] += n
    return owner


def _warn_skip() -> None:
    LOG.warning("non-finite gradient: gradient-noise statistics skip this step")
