"""The step contract: the lag, the non-finite skip, the rule's factor and progress."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.threadcollective import run_replicas

from adaptdl.core.collective import Collective, LocalCollective
from adaptdl.core.stats import scaling
from adaptdl.core.stats.gns import GradientNoiseScale
from adaptdl.core.stats.metrics import MetricsState
from adaptdl.core.stats.step import (
    Fold,
    PairedNorms,
    StepDecision,
    StepLoss,
    StepMeasurement,
    StepStatistics,
    decide,
    split_by_size,
)

NAN = float("nan")


def measured(
    local: float = 8.0,
    total: float = 1.5,
    micro: int = 2,
    replicas: int = 1,
    bsz: int = 4,
    pair: PairedNorms | None = None,
) -> StepMeasurement:
    return StepMeasurement(
        local_sqr=[local],
        total_sqr=[total],
        micro_batches=micro,
        num_replicas=replicas,
        batch_size=bsz,
        pair=pair,
    )


def stats(collective: Collective | None = None) -> tuple[StepStatistics, MetricsState]:
    metrics = MetricsState()
    return StepStatistics(metrics, collective or LocalCollective()), metrics


def on_two_replicas(fn: Callable[[StepStatistics, MetricsState, int], Any]) -> list[Any]:
    """Run ``fn(steps, metrics, rank)`` on two replicas joined by a real collective."""

    def replica(collective: Collective) -> Any:
        steps, metrics = stats(collective)
        return fn(steps, metrics, collective.rank)

    return run_replicas(2, replica)


def test_one_replica_folds_at_once_like_the_estimator() -> None:
    steps, metrics = stats()
    assert steps.measure(measured(), 8) is Fold.FOLDED
    reference = GradientNoiseScale(8)
    reference.update([8.0], [1.5], 2, 4)
    assert metrics.gns == reference


def test_several_replicas_fold_the_summed_norms_one_step_late() -> None:
    def replica(steps: StepStatistics, metrics: MetricsState, rank: int) -> Any:
        first = steps.measure(measured(local=3.0 + 2 * rank, micro=2, replicas=2), 8)
        updates = metrics.gns.num_updates if metrics.gns is not None else None
        second = steps.measure(measured(local=6.0, micro=2, replicas=2), 8)
        return first, updates, second, metrics.gns

    outcome = on_two_replicas(replica)
    reference = GradientNoiseScale(8)
    reference.update([8.0], [1.5], 4, 4)  # the first step's: 3.0 + 5.0 over 4 micro-batches
    assert outcome == [(Fold.PENDING, 0, Fold.PENDING, reference)] * 2


@settings(max_examples=25, deadline=None)
@given(
    locals_=st.lists(st.floats(0.0, 100.0), min_size=2, max_size=2),
    totals=st.lists(st.floats(0.0, 10.0), min_size=2, max_size=2),
    cut=st.floats(0.0, 1.0),
)
def test_partial_totals_sum_to_the_whole_totals_fold(
    locals_: list[float], totals: list[float], cut: float
) -> None:
    """Replicas that each hand a part of the total (``total_partial``) fold exactly as
    replicas that each hand the whole: the parts are summed with the local norms."""

    def run(partial: bool) -> Any:
        def replica(steps: StepStatistics, metrics: MetricsState, rank: int) -> Any:
            for step, total in enumerate(totals):
                part = total * (cut if rank == 0 else 1.0 - cut) if partial else total
                m = StepMeasurement(
                    local_sqr=[locals_[step] + rank],
                    total_sqr=[part],
                    micro_batches=1,
                    num_replicas=2,
                    batch_size=4,
                    total_partial=partial,
                )
                steps.measure(m, 8)
            steps.drain()
            return metrics.gns

        return on_two_replicas(replica)

    whole, parts = run(False), run(True)
    assert whole[0] == whole[1] and parts[0] == parts[1]

    def numbers(value: Any) -> list[float]:
        if isinstance(value, dict):
            return [x for key in sorted(value) for x in numbers(value[key])]
        if isinstance(value, (list, tuple)):
            return [x for item in value for x in numbers(item)]
        return [float(value)] if isinstance(value, (int, float)) else []

    assert numbers(parts[0].to_json()) == pytest.approx(
        numbers(whole[0].to_json()), rel=1e-9, abs=1e-12
    )


def test_non_finite_steps_leave_the_estimator_alone() -> None:
    steps, metrics = stats()
    steps.measure(measured(), 8)
    before = metrics.gns.to_json() if metrics.gns is not None else None
    assert steps.measure(measured(local=math.inf), 8) is Fold.SKIPPED
    assert steps.measure(measured(total=NAN, micro=1), 8) is Fold.SKIPPED
    assert not Fold.SKIPPED.pairable
    # A usable gradient with an unusable pair may still pair with the next step.
    pair = PairedNorms(prev_sqr=[2.0], mixed_sqr=[math.inf], prev_batch_size=4)
    assert steps.measure(measured(total=2.0, micro=1, pair=pair), 8) is Fold.UNPAIRED
    assert Fold.UNPAIRED.pairable
    assert metrics.gns is not None and metrics.gns.to_json() == before


def test_non_finite_lagged_sum_is_skipped_at_the_next_step() -> None:
    def replica(steps: StepStatistics, metrics: MetricsState, rank: int) -> Any:
        # One replica's overflow makes the sum non-finite on both.
        steps.measure(measured(local=math.inf if rank else 1.0, replicas=2), 8)
        steps.measure(measured(replicas=2), 8)
        return metrics.gns.num_updates if metrics.gns is not None else None

    assert on_two_replicas(replica) == [0, 0]


def test_single_micro_batch_pairs_with_the_previous_one() -> None:
    steps, metrics = stats()
    assert steps.measure(measured(total=3.0, micro=1), 4) is Fold.UNPAIRED
    pair = PairedNorms(prev_sqr=[3.0], mixed_sqr=[2.0], prev_batch_size=2)
    assert steps.measure(measured(total=4.0, micro=1, pair=pair), 4) is Fold.FOLDED
    reference = GradientNoiseScale(4)
    reference.update_differenced([3.0], [4.0], [2.0], 4, 2)
    assert metrics.gns == reference


sizes = st.integers(1, 64)
norms = st.floats(0.0, 1e3)


@settings(max_examples=60, deadline=None)
@given(norms, st.floats(0.0, 1.0), st.integers(2, 8), sizes, sizes, st.floats(0.0, 1e4))
def test_decision_is_the_rules_factor_at_the_gain_and_adds_the_gain(
    local: float, frac: float, micro: int, bsz: int, m0: int, progress: float
) -> None:
    steps, metrics = stats()
    metrics.progress = progress
    steps.measure(measured(local, frac * local / micro, micro, 1, bsz), m0)
    gns = metrics.gns
    assert gns is not None
    batch = bsz * micro
    for rule in (
        scaling.AdaScale(),
        scaling.AdamScale(),
        scaling.LinearScale(),
        scaling.SqrtScale(),
        scaling.LEGWScale(1.0, 1000, m0),
    ):
        decision = steps.decide(batch, rule, num_groups=3)
        assert decision is not None
        gain = gns.gain(batch / m0)
        assert decision.gain == gain
        assert decision.lr_factors == (rule.lr_factor(gain, batch / m0, progress),) * 3
        assert decision.progress == progress + gain
    steps.commit(decision)
    assert metrics.progress == progress + gain


def test_step_is_measure_decide_commit() -> None:
    a, ma = stats()
    b, mb = stats()
    rule = scaling.AdaScale()
    for local, total in ((8.0, 1.5), (9.0, 4.0), (6.0, 0.5)):
        m = measured(local, total)
        da = a.step(m, init_batch_size=2, batch_size=8, rule=rule)
        b.measure(m, 2)
        db = b.decide(8, rule)
        assert db is not None
        b.commit(db)
        assert da == db
    assert ma.to_json() == mb.to_json()
    assert ma.progress > 3.0  # scale 4 with noise: each step worth more than one


losses = st.one_of(st.floats(-1e3, 1e3, allow_nan=False), st.just(NAN))


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(norms, norms, losses), min_size=1, max_size=12),
    st.floats(0.0, 1.0),
    st.one_of(st.none(), st.floats(-10.0, 10.0)),
)
def test_a_steps_loss_reaches_the_floor_as_observing_it_before_the_step_does(
    steps_in: list[tuple[float, float, float]], rate: float, target: float | None
) -> None:
    # The contract's loss is the floor's observation at the progress before the step,
    # with the step's total batch and the estimator as measured for the step.
    steps, metrics = stats()
    reference = MetricsState()
    rule = scaling.AdaScale()
    for local, total, loss in steps_in:
        m = measured(local, total)
        steps.step(
            m, init_batch_size=2, batch_size=8, rule=rule, loss=StepLoss(loss, [rate], target)
        )
        reference.ensure_gns(2, 1).update(m.local_sqr, m.total_sqr, m.count, m.batch_size)
        reference.observe_loss(loss, [rate], 8, target)
        reference_gns = reference.gns
        assert reference_gns is not None
        reference.add_progress(reference_gns.gain(8 / 2))
    assert metrics.floor is not None and reference.floor is not None
    assert metrics.floor.to_json() == reference.floor.to_json()
    assert metrics.floor.steps == len(steps_in)


def test_a_step_without_a_loss_leaves_the_floor_alone() -> None:
    steps, metrics = stats()
    steps.step(measured(), init_batch_size=2, batch_size=8, rule=scaling.AdaScale())
    assert metrics.floor is None
    # Before the job has an estimator there is no step to credit: the loss is not folded.
    fresh, fresh_metrics = stats()
    assert fresh.decide(8, scaling.AdaScale(), loss=StepLoss(1.0, [0.1])) is None
    assert fresh_metrics.floor is None


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"loss": "1.0"}, TypeError, "loss must be a real number"),
        ({"loss": True}, TypeError, "loss must be a real number"),
        ({"rates": 0.1}, TypeError, "rates must be a sequence"),
        ({"rates": []}, ValueError, "rates must have one value per parameter group"),
        ({"rates": [-0.1]}, ValueError, r"rates\[0\] must be"),
        ({"rates": [math.inf]}, ValueError, r"rates\[0\] must be finite"),
        ({"target_loss": math.nan}, ValueError, "target_loss must be finite"),
    ],
)
def test_bad_losses_name_the_field(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        StepLoss(**{"loss": 1.0, "rates": [0.1], **kwargs})
    steps, _ = stats()
    steps.measure(measured(), 4)
    with pytest.raises(TypeError, match="loss must be a StepLoss"):
        steps.decide(8, scaling.AdaScale(), loss=1.0)  # type: ignore[arg-type]


def test_no_decision_before_the_job_has_an_estimator() -> None:
    steps, _ = stats()
    assert steps.decide(8, scaling.AdaScale()) is None


def test_decide_is_a_plain_function_of_estimator_and_progress() -> None:
    gns = GradientNoiseScale(4)
    decision = decide(gns, 2.5, 8, scaling.LinearScale())
    assert decision == StepDecision(lr_factors=(2.0,), gain=1.0, scale=2.0, progress=3.5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"local_sqr": "ab"}, "local_sqr must be a sequence"),
        ({"total_sqr": [True]}, r"total_sqr\[0\] must be a real number"),
        ({"total_sqr": []}, "total_sqr must have one value per parameter group"),
        ({"local_sqr": [1.0, 2.0]}, "one value per group each"),
        ({"micro_batches": 0}, "micro_batches must be"),
        ({"num_replicas": 1.5}, "num_replicas must be an int"),
        ({"batch_size": 0}, "batch_size must be"),
        ({"total_partial": True}, "total_partial is for several replicas"),
        ({"total_partial": 1, "num_replicas": 2}, "total_partial must be a bool"),
        ({"pair": (1.0, 2.0)}, "pair must be PairedNorms"),
        (
            {"pair": PairedNorms(prev_sqr=[1.0], mixed_sqr=[1.0], prev_batch_size=1)},
            "pair is only for a step of one micro-batch",
        ),
    ],
)
def test_bad_measurements_name_the_argument(kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {
        "local_sqr": [1.0],
        "total_sqr": [1.0],
        "micro_batches": 2,
        "num_replicas": 1,
        "batch_size": 4,
        **kwargs,
    }
    with pytest.raises(ValueError, match=match):
        StepMeasurement(**args)


def test_bad_pairs_name_the_argument() -> None:
    with pytest.raises(ValueError, match="prev_batch_size must be"):
        PairedNorms(prev_sqr=[1.0], mixed_sqr=[1.0], prev_batch_size=0)
    with pytest.raises(ValueError, match="one value per group each"):
        PairedNorms(prev_sqr=[1.0], mixed_sqr=[1.0, 2.0], prev_batch_size=1)
    pair = PairedNorms(prev_sqr=[1.0, 2.0], mixed_sqr=[1.0, 2.0], prev_batch_size=1)
    with pytest.raises(ValueError, match="pair must have 1 values per norm"):
        measured(micro=1, pair=pair)


def test_measure_and_decide_refuse_bad_arguments() -> None:
    steps, _ = stats()
    with pytest.raises(TypeError, match="measurement must be a StepMeasurement"):
        steps.measure((1.0, 2.0), 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="init_batch_size must be"):
        steps.measure(measured(), 0)
    steps.measure(measured(), 4)
    with pytest.raises(ValueError, match="batch_size must be"):
        steps.decide(0, scaling.AdaScale())


# -- progress is the job's metric ---------------------------------------------------------


def test_progress_survives_a_new_estimator_shape_and_a_json_round_trip() -> None:
    metrics = MetricsState()
    metrics.ensure_gns(8).update([8.0], [1.5], 2, 4)
    metrics.add_progress(2.5)
    metrics.ensure_gns(8, num_groups=2)  # a model with two groups: a new estimator
    assert metrics.progress == 2.5
    restored = MetricsState()
    restored.from_bytes(metrics.to_bytes())
    assert restored.progress == 2.5
    assert restored.to_json() == metrics.to_json()


def test_metrics_written_with_progress_in_the_estimator_still_load() -> None:
    metrics = MetricsState()
    metrics.ensure_gns(8).update([8.0], [1.5], 2, 4)
    data = json.loads(json.dumps(metrics.to_json()))
    old = dict(data)
    del old["progress"]
    # Schema 1 had neither the job's progress outside nor the spread (schema 3).
    spread = ("sqr_diff_biased", "var_diff_biased", "last_step")
    spread += ("moment_weight", "moment_weight_sq")
    gns_v1 = {k: v for k, v in data["gns"].items() if k not in spread}
    old["gns"] = {**gns_v1, "schema": "adaptdl.gns/1", "progress": 7.25}
    restored = MetricsState()
    restored.load_json(old)
    assert restored.progress == 7.25
    assert metrics.gns is not None
    cleared = dict.fromkeys(spread, 0.0) | {"last_step": None}
    assert restored.gns == attrs.evolve(metrics.gns, **cleared)


@pytest.mark.parametrize("gain", [0.0, -1.0, math.inf, NAN])
def test_add_progress_refuses_a_gain_that_is_not_positive(gain: float) -> None:
    metrics = MetricsState()
    with pytest.raises(ValueError, match="gain must be"):
        metrics.add_progress(gain)
    assert metrics.progress == 0.0


def test_drain_folds_the_last_steps_sum_on_every_replica():
    """After the last step nothing of the statistics may stay in flight."""

    def replica(collective):
        metrics = MetricsState()
        steps = StepStatistics(metrics, collective)
        m = StepMeasurement(
            local_sqr=(4.0,), total_sqr=(1.0,), micro_batches=1, num_replicas=2, batch_size=8
        )
        steps.measure(m, 8)
        before = metrics.gns.to_json()
        steps.drain()
        steps.drain()  # nothing left
        return before != metrics.gns.to_json()

    assert run_replicas(2, replica) == [True, True]


def test_metrics_goodput_accessors_read_the_estimator_and_profiler() -> None:
    # Nothing measured: no model, no warm-up, a gradient taken as resolved.
    metrics = MetricsState()
    assert metrics.goodput_fn(16) is None and metrics.bound_goodput_fn(2.0, 16) is None
    assert metrics.estimate_samples() == 0.0 and metrics.gradient_resolved()
    gns = metrics.ensure_gns(16)
    gns.update(2.0 * 9.0, 4.0, 2, 8)  # |G|^2 = 2 * 4 - 9 = -1: not resolved
    assert not metrics.gradient_resolved()
    assert metrics.estimate_samples() == pytest.approx(16.0)
    for _ in range(4):
        gns.update(2.0 * 5.0, 4.0, 2, 8)  # |G|^2 = 3, tr(Sigma) = 16
    assert metrics.gradient_resolved()
    assert metrics.goodput_fn(16) is None  # nothing profiled yet
    for local in (8, 16, 32):
        for _ in range(5):
            step = 0.001 * local + 0.01
            metrics.profiler.record(1, 2, local, accum_step=False, step_time=step)
    point, bound = metrics.goodput_fn(16), metrics.bound_goodput_fn(2.0, 16)
    assert point is not None and bound is not None
    assert point.grad_params == gns.grad_params()
    assert bound.grad_params == gns.grad_params_bound(2.0)
    assert (
        bound.grad_params.var / bound.grad_params.sqr
        < point.grad_params.var / point.grad_params.sqr
    )


@given(
    sizes=st.lists(st.lists(st.integers(0, 10_000), max_size=8), min_size=1, max_size=4),
    replicas=st.integers(1, 6),
)
def test_split_by_size_gives_every_tensor_one_replica_and_balances_the_elements(
    sizes: list[list[int]], replicas: int
) -> None:
    owner = split_by_size(sizes, replicas)
    assert [len(row) for row in owner] == [len(g) for g in sizes]
    assert all(0 <= o < replicas for row in owner for o in row)
    loads = [0] * replicas
    for group, row in zip(sizes, owner, strict=True):
        for n, o in zip(group, row, strict=True):
            loads[o] += n
    largest = max((n for g in sizes for n in g), default=0)
    assert max(loads) - min(loads) <= largest
    assert split_by_size(sizes, replicas) == owner  # the same on every replica


def test_split_by_size_refuses_no_replicas() -> None:
    with pytest.raises(ValueError, match="replicas"):
        split_by_size([[1]], 0)
