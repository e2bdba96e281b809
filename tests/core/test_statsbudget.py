"""The measuring budget: which steps measure the gradient statistics, from their cost."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adaptdl.core.collective import Future
from adaptdl.core.stats.gns import GradientNoiseScale
from adaptdl.core.stats.metrics import MetricsState
from adaptdl.core.stats.statsbudget import MeasureBudget
from adaptdl.core.stats.step import Fold, StepMeasurement, StepStatistics
from adaptdl.core.validate import ArgumentTypeError


@given(share=st.floats(0.01, 1.0), start=st.integers(0, 10_000), n=st.integers(1, 500))
def test_measured_steps_are_the_share_evenly_spaced(share: float, start: int, n: int) -> None:
    budget = MeasureBudget(fixed=share)
    measured = [k for k in range(start, start + n) if budget.measures(k)]
    # Exactly floor((start + n) s) - floor(start s) steps: never two closer than 1 / s - 1.
    assert len(measured) == math.floor((start + n) * share) - math.floor(start * share)
    gaps = [b - a for a, b in itertools.pairwise(measured)]
    assert all(math.floor(1 / share) <= g <= math.ceil(1 / share) for g in gaps)


@given(
    costs=st.lists(st.floats(0.5, 2.0), min_size=1, max_size=40),
    steps=st.integers(200, 3000),
    start=st.integers(0, 5000),
)
def test_a_moving_share_measures_that_share_of_the_steps(
    costs: list[float], steps: int, start: int
) -> None:
    # Each measured step's cost moves the share a little (its moving average). The
    # measured steps must stay that share of the steps, as `StepStatistics` drives the
    # budget (the share applies from the step after the one measured): a share that
    # applied from step 0 put the next measured step at a random point of the spacing
    # after every change, which measured about twice the share.
    b = MeasureBudget(budget=0.01, warmup=0, floor=0.0, min_share=0.01)
    measured, expected = 0, 0.0
    for k in range(start, start + steps):
        expected += b.share
        if b.measures(k):
            measured += 1
            b.record(costs[measured % len(costs)] * 0.1, 1.0, next_step=k + 1)
    # The credit carried over every change: off by at most the one step in progress.
    assert abs(measured - expected) <= 1.0 + 1e-9


def test_a_cheap_statistic_is_measured_every_step() -> None:
    budget = MeasureBudget(budget=0.02, warmup=2)
    for k in range(50):
        budget.record(0.001, 0.1, next_step=k + 1)  # 1% of the step
    assert budget.share == 1.0 and budget.measures(7)


@given(cost=st.floats(1e-4, 1.0), step=st.floats(1e-3, 10.0), budget=st.floats(0.001, 0.5))
def test_a_costly_statistic_is_measured_on_the_share_its_budget_allows(
    cost: float, step: float, budget: float
) -> None:
    b = MeasureBudget(budget=budget, warmup=3, min_share=0.01, floor=0.0)
    for k in range(3):
        b.record(cost, step, next_step=k + 1)
    assert b.share == 1.0  # still learning the cost
    b.record(cost, step, next_step=4)
    expected = min(max(budget * step / cost, 0.01), 1.0)
    assert b.share == pytest.approx(expected, rel=1e-9)
    # The statistics' expected cost per step is then within the budget (or the floor).
    assert b.share * cost <= max(budget * step, 0.01 * cost) * (1 + 1e-9)


@given(cost=st.floats(1e-6, 1e-2), step=st.floats(1e-4, 1.0))
def test_the_floor_keeps_a_cheap_statistic_whole_and_the_share_continuous(
    cost: float, step: float
) -> None:
    b = MeasureBudget(budget=0.02, warmup=0, floor=5e-4, min_share=0.01)
    b.record(cost, step, next_step=1)
    allowed = max(0.02 * step, 5e-4)
    assert b.share == pytest.approx(min(max(allowed / cost, 0.01), 1.0), rel=1e-9)
    if cost <= 5e-4:
        assert b.share == 1.0


def test_bad_settings_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="budget"):
        MeasureBudget(budget=0.0)
    with pytest.raises(ValueError, match="min_share"):
        MeasureBudget(min_share=1.5)
    with pytest.raises(ValueError, match="floor"):
        MeasureBudget(floor=-1.0)
    with pytest.raises(ValueError, match="fixed"):
        MeasureBudget(fixed=0.0)
    with pytest.raises(ValueError, match="cost"):
        MeasureBudget().record(-1.0, 1.0, next_step=1)
    with pytest.raises(ValueError, match="next_step"):
        MeasureBudget().record(1.0, 1.0, next_step=-1)
    with pytest.raises(ValueError, match="share"):
        StepMeasurement((1.0,), (1.0,), 2, 1, 4, share=0.0)
    with pytest.raises((ValueError, ArgumentTypeError), match="share"):
        GradientNoiseScale(init_batch_size=4).update(2.0, 1.0, 2, 4, share=2.0)


def test_a_measured_step_stands_for_one_over_its_share_steps() -> None:
    # A step measured at share 1/4 moves the averages as four steps of the same
    # estimate would: its scale is four times larger.
    sampled = GradientNoiseScale(init_batch_size=8, smoothing=0.9)
    every = GradientNoiseScale(init_batch_size=8, smoothing=0.9)
    sampled.update(3.0, 1.0, 2, 4)
    every.update(3.0, 1.0, 2, 4)
    sampled.update(5.0, 2.0, 2, 4, share=0.25)
    for _ in range(4):
        every.update(5.0, 2.0, 2, 4)
    assert sampled.sqr == pytest.approx(every.sqr, rel=1e-12)
    assert sampled.var == pytest.approx(every.var, rel=1e-12)
    assert sampled.weight == pytest.approx(every.weight, rel=1e-12)
    # Fewer steps in the spread: the estimate's errors are larger, not smaller.
    paired = GradientNoiseScale(init_batch_size=4, smoothing=0.9)
    paired.update_differenced(2.0, 3.0, 2.0, 4, share=0.5)
    assert paired.num_updates == 1


class _Summing:
    """A collective of two replicas whose other replica measured ``other``."""

    def __init__(self, other: list[float]) -> None:
        self.other = other

    def allreduce_async(self, values: list[float]) -> Future[list[float]]:
        summed = [a + b for a, b in zip(values, self.other, strict=True)]
        return _Done(summed)


class _Done:
    def __init__(self, value: list[float]) -> None:
        self.value = value

    def result(self) -> list[float]:
        return self.value


def test_replicas_move_the_share_alike_on_their_summed_costs() -> None:
    # Two replicas measured different costs; each folds the sum, so both reach the
    # share of the mean cost, at the same step.
    shares = []
    for mine, other in ((0.04, 0.0), (0.0, 0.04)):
        collective = _Summing([1.0, other, 1.0])
        steps = StepStatistics(
            MetricsState(),
            collective,
            MeasureBudget(budget=0.02, warmup=0),  # type: ignore[arg-type]
        )
        m = StepMeasurement((1.0,), (0.5,), 1, 2, 4, cost=mine, step_time=1.0)
        assert steps.measure(m, 8) is Fold.PENDING
        assert steps.share == 1.0  # nothing folded yet
        steps.drain()
        shares.append(steps.share)
    assert shares[0] == shares[1] == 1.0  # the mean cost, 0.02, is within the budget
    collective = _Summing([1.0, 0.2, 1.0])
    budget = MeasureBudget(budget=0.02, warmup=0, floor=0.0)
    steps = StepStatistics(MetricsState(), collective, budget)  # type: ignore[arg-type]
    steps.measure(StepMeasurement((1.0,), (0.5,), 1, 2, 4, cost=0.2, step_time=1.0), 8)
    steps.drain()
    assert steps.share == pytest.approx(0.1)
    assert [steps.measures(k) for k in range(100)].count(True) in (9, 10)


def test_the_replay_measures_every_step_by_default() -> None:
    steps = StepStatistics(MetricsState(), _Summing([]))  # type: ignore[arg-type]
    assert steps.share == 1.0 and all(steps.measures(k) for k in range(100))
