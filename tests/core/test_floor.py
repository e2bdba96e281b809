"""`adaptdl.core.stats.floor`: SGD's noise floor, its share of the loss left, and the credit
the batch-size decision reads through `MetricsState`."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptdl.core.goodput import GoodputFunction, GradParams, PerfParams
from adaptdl.core.stats.floor import (
    LAPSE_STEPS,
    FloorConfig,
    LossFloor,
    check_rule,
    floor_level,
    floor_share,
    sgd_rate,
    shared_params,
)
from adaptdl.core.stats.gns import GradientNoiseScale
from adaptdl.core.stats.metrics import MetricsConfig, MetricsState
from adaptdl.core.stats.scaling import AdamScale, AdaScale, LEGWScale, LinearScale, SqrtScale

PERF = PerfParams(0.05, 0.01, 0.1, 0.01, 0.02, 0.005, 1.5)


@settings(max_examples=300, deadline=None)
@given(
    st.floats(1e-3, 10.0),
    st.floats(1e-3, 1e3),  # with noise: without, there is no floor to credit
    st.sampled_from([8, 16, 64]),
    st.floats(1.0, 4096.0),
    st.floats(0.0, 0.999),
)
def test_the_shared_params_are_pollux_at_the_floor_shares_time_to_target(
    sqr: float, var: float, m0: int, batch: float, share: float
) -> None:
    # Time to the target at batch M goes as (1 - f + f E) / (throughput E): the
    # efficiency that multiplies throughput is E / (1 - f + f E), Pollux's at B'.
    params = GradParams(sqr=sqr, var=var)
    e = GoodputFunction(PERF, params, m0).efficiency(batch)
    shared = shared_params(params, share)
    assert shared.sqr == params.sqr and shared.var >= params.var
    expected = e / (1.0 - share + share * e)
    assert GoodputFunction(PERF, shared, m0).efficiency(batch) == pytest.approx(expected, rel=1e-9)


@settings(max_examples=200, deadline=None)
@given(st.floats(1e-3, 10.0), st.floats(1e-3, 1e3), st.floats(0.0, 0.9))
def test_a_floor_share_never_shrinks_the_decisions_optimum(
    sqr: float, var: float, share: float
) -> None:
    # The property the decision leans on: crediting the floor moves the optimum to a
    # batch at least as large, never a smaller one.
    base = GoodputFunction(PERF, GradParams(sqr=sqr, var=var), 16)
    credited = GoodputFunction(PERF, shared_params(base.grad_params, share), 16)
    _, local, _ = base.optimize(1, 2, max_batch_size=4096, atomic_bsz_range=(1, 2048))
    _, credited_local, _ = credited.optimize(1, 2, max_batch_size=4096, atomic_bsz_range=(1, 2048))
    assert credited_local >= local


def test_shared_params_keep_statistics_without_noise_or_share_and_refuse_a_share_outside() -> None:
    params = GradParams(sqr=2.0, var=6.0)
    assert shared_params(params, 0.0) is params
    # Noise scale 16 * 6 / 2 = 48 at M0 = 16; at share 0.5: (48 + 8) / 0.5 = 112.
    assert shared_params(params, 0.5).var * 16 / 2.0 == pytest.approx(112.0)
    for still in (GradParams(sqr=2.0, var=0.0), GradParams(sqr=0.0, var=6.0)):
        assert shared_params(still, 0.5) is still
    for bad in (-0.1, 1.0, math.nan):
        with pytest.raises(ValueError, match=r"share must be (in|finite)"):
            shared_params(params, bad)


def test_the_floor_level_and_sgds_rate_and_their_refusals_name_the_argument() -> None:
    # lr / (1 - momentum) * tr(Sigma) / (4 M): 0.01 / 0.1 * 120 / 64.
    assert floor_level(sgd_rate(0.01, 0.9), 120.0, 16.0) == pytest.approx(0.1875)
    assert sgd_rate(0.01, 0.9, dampening=0.5) == pytest.approx(0.05)
    assert sgd_rate(0.01, 0.0, dampening=0.5) == 0.01  # torch dampens momentum only
    assert floor_level(sgd_rate(0.01), 120.0, 256.0) == pytest.approx(0.01 * 120 / 1024)
    for call, name in [
        (lambda: sgd_rate(-0.1), "lr"),
        (lambda: sgd_rate(0.1, 1.0), "momentum"),
        (lambda: sgd_rate(0.1, -0.5), "momentum"),  # in [0, 1)
        (lambda: sgd_rate(0.1, 0.5, 2.0), "dampening"),
        (lambda: sgd_rate(math.inf), "lr"),
        (lambda: floor_level(0.1, -1.0, 16.0), "var"),
        (lambda: floor_level(0.1, 1.0, 0.0), "batch"),
    ]:
        with pytest.raises(ValueError, match=f"^{name} must be"):
            call()


def test_the_floor_share_of_the_loss_left_to_the_target() -> None:
    # Loss 0.6 at E = 0.5 with floor0 0.2: drift 0.5; left to 0.35 at the initial
    # batch's noise: 0.5 - 0.35 + 0.2 = 0.35, of which the floor 0.2.
    assert floor_share(0.2, 0.6, 0.5, 0.35) == pytest.approx(0.2 / 0.35)
    assert floor_share(0.2, 0.6, 0.5, 0.35, cap=0.5) == 0.5
    # Without a target: the least share the loss allows, 0.2 / (0.5 + 0.2).
    assert floor_share(0.2, 0.6, 0.5) == pytest.approx(0.2 / 0.7)
    # The floor all that is left (or more): the cap.
    assert floor_share(0.2, 0.45, 1.0, 0.3) == 0.9
    # No floor, or a loss not finite: no share.
    assert floor_share(0.0, 0.6, 1.0, 0.35) == 0.0
    assert floor_share(0.2, math.nan, 1.0, 0.35) == 0.0
    with pytest.raises(ValueError, match="cap must be in"):
        floor_share(0.2, 0.6, 1.0, 0.35, cap=1.0)


@settings(max_examples=300, deadline=None)
@given(
    st.floats(0.0, 1.0),
    st.floats(0.0, 5.0),
    st.floats(0.0, 5.0),
    st.floats(1e-3, 1.0),
    st.floats(-1.0, 1.0),
)
def test_the_floor_share_is_within_its_cap_and_falls_as_the_loss_left_grows(
    floor0: float, loss: float, more: float, efficiency: float, target: float
) -> None:
    share = floor_share(floor0, loss, efficiency, target)
    assert 0.0 <= share <= 0.9
    # More loss left (a higher loss, or a lower target) never raises the floor's share.
    assert floor_share(floor0, loss + more, efficiency, target) <= share
    assert floor_share(floor0, loss, efficiency, target - more) <= share


def _estimator(groups: int = 1, steps: int = 4) -> GradientNoiseScale:
    est = GradientNoiseScale(init_batch_size=16, num_groups=groups)
    for sqr_local, total in [(40.0, 15.0), (42.0, 15.5), (38.0, 14.5), (41.0, 15.2)][:steps]:
        est.update([sqr_local / groups] * groups, [total / groups] * groups, 2, 8)
    return est


def _metrics(est: GradientNoiseScale) -> MetricsState:
    """Metrics whose estimator is ``est`` (through the declared factory) and whose
    floor credits from its first loss."""
    metrics = MetricsState(
        config=MetricsConfig(estimator="measured", floor=FloorConfig(min_steps=1)),
        estimators={"measured": lambda b, g: est},
    )
    assert metrics.ensure_gns(est.init_batch_size, est.num_groups) is est
    return metrics


def test_observe_sets_the_share_from_the_loss_average_after_its_minimum() -> None:
    est = _estimator()
    floor = LossFloor(min_steps=3)
    rate = sgd_rate(0.01, 0.9)
    point = est.grad_params()
    floor.observe(0.5, [rate], est, 32, target_loss=0.1)
    floor.observe(math.nan, [rate], est, 32, target_loss=0.1)  # skipped, yet counted
    assert not floor.active and floor.share_at(point) == 0.0 and floor.steps == 2
    floor.observe(0.7, [rate], est, 32, target_loss=0.1)
    assert floor.active
    # The bias-corrected average of 0.5 and 0.7 (memory 0.99).
    average = (0.99 * 0.5 + 0.7) / 1.99
    assert floor.average == pytest.approx(average)
    floor0 = floor_level(rate, est.var, 16.0)
    assert floor.floor0_at(point) == pytest.approx(floor0)
    now = est.gain(2.0) / 2.0
    share = floor.share_at(point)
    assert share == pytest.approx(floor_share(floor0, average, now, 0.1)) and share > 0.0
    assert floor.credit(point) == shared_params(point, share)


def test_the_bound_has_the_floor_of_its_own_noise_and_no_jump_at_none() -> None:
    est = _estimator()
    floor = LossFloor(min_steps=1)
    floor.observe(5.0, [sgd_rate(0.05, 0.9)], est, 16)  # the floor 0.63 of it
    point = est.grad_params()
    assert point is not None
    # Less noise at the bound: a lower floor (in proportion), a smaller share.
    for fraction in (0.5, 0.1, 1e-3, 1e-9):
        less = GradParams(sqr=point.sqr, var=point.var * fraction)
        expected = floor_share(floor.floor0_at(point) * fraction, 5.0, 1.0, 0.0)
        assert floor.share_at(less) == pytest.approx(expected)
        assert floor.share_at(less) < floor.share_at(point)
    # Continuous at no noise: the credited noise scale tends to 0 with the bound's.
    tiny = floor.credit(GradParams(sqr=point.sqr, var=point.var * 1e-9))
    assert tiny is not None and tiny.var < point.var * 1e-6
    assert floor.credit(GradParams(sqr=point.sqr, var=0.0)) == GradParams(sqr=point.sqr, var=0.0)


def test_the_credit_lapses_without_finite_losses_and_a_restart_resumes_it() -> None:
    est = _estimator()
    floor = LossFloor(min_steps=1)
    floor.observe(0.02, [sgd_rate(0.05, 0.9)], est, 16)
    point = est.grad_params()
    assert floor.share_at(point) > 0.0
    for _ in range(LAPSE_STEPS):
        floor.idle_step()
        floor.observe(math.nan, [sgd_rate(0.05, 0.9)], est, 16)  # not a loss to go on
    assert floor.active
    floor.idle_step()  # LAPSE_STEPS + 1 optimiser steps without a finite loss
    assert not floor.active and floor.share_at(point) == 0.0 and floor.credit(point) == point
    floor.observe(0.02, [sgd_rate(0.05, 0.9)], est, 16)
    assert floor.active
    # Restored, the first decision is credited as the last one was, and the lapse
    # goes on counting.
    restored = LossFloor.from_json(json.loads(json.dumps(floor.to_json())))
    assert restored.share_at(point) == floor.share_at(point) > 0.0
    for _ in range(LAPSE_STEPS + 1):
        restored.idle_step()
    assert not restored.active


def test_an_estimate_that_stops_resolving_a_gradient_stops_the_credit() -> None:
    est = _estimator()
    floor = LossFloor(min_steps=1)
    floor.observe(0.02, [sgd_rate(0.05, 0.9)], est, 16)
    assert floor.active
    lost = GradientNoiseScale(init_batch_size=16)
    lost.update(40.0, 8.0, 2, 8)  # |G|^2 estimated below 0
    floor.observe(0.02, [sgd_rate(0.05, 0.9)], lost, 16)
    assert not floor.active and floor.share_at(est.grad_params()) == 0.0
    # Statistics with no signal or no noise get no share (and no division by 0).
    floor.observe(0.02, [sgd_rate(0.05, 0.9)], est, 16)
    for params in (GradParams(sqr=0.0, var=0.0), GradParams(sqr=0.0, var=1.0)):
        assert floor.share_at(params) == 0.0


def test_observe_sums_the_groups_floors_and_waits_for_a_resolved_gradient() -> None:
    two = _estimator(groups=2)
    floor = LossFloor(min_steps=1)
    floor.observe(0.6, [0.1, 0.3], two, 16)
    expected = floor_level(0.1, two.group_var[0], 16) + floor_level(0.3, two.group_var[1], 16)
    assert floor.floor0_at(two.grad_params()) == pytest.approx(expected)
    with pytest.raises(ValueError, match=r"rates must have one value per parameter group \(2\)"):
        floor.observe(0.6, [0.1], two, 16)
    # No estimator yet, or one that resolves no gradient: the loss is folded, no share.
    fresh = LossFloor(min_steps=1)
    fresh.observe(0.6, [0.1], None, 16)
    assert not fresh.active and fresh.average == pytest.approx(0.6)
    lost = GradientNoiseScale(init_batch_size=16)
    lost.update(40.0, 8.0, 2, 8)  # |G|^2 estimated below 0: (2 * 8 - 40 / 2) / 1
    assert not lost.resolved
    fresh.observe(0.6, [0.1], lost, 16)
    assert not fresh.active
    fresh.observe(True, [0.1], None, 16)  # type: ignore[arg-type]  # not a loss: skipped
    assert fresh.average == pytest.approx(0.6)
    with pytest.raises(ValueError, match="target_loss must be finite"):
        fresh.observe(0.6, [0.1], lost, 16, target_loss=math.inf)
    with pytest.raises(ValueError, match=r"batch_size must be > 0\.0, got 0\.0"):
        fresh.observe(0.6, [0.1], lost, 0)


def test_the_floor_round_trips_as_data_and_refuses_bad_state() -> None:
    floor = LossFloor(min_steps=1)
    floor.observe(0.6, [0.1], _estimator(), 16)
    again = LossFloor.from_json(json.loads(json.dumps(floor.to_json())))
    assert again.to_json() == floor.to_json()
    data = floor.to_json()
    with pytest.raises(ValueError, match=r"schema must be 'adaptdl\.floor/2'"):
        LossFloor.from_json({**data, "schema": "adaptdl.floor/0"})
    with pytest.raises(ValueError, match=r"missing \['loss_sum'\]"):
        LossFloor.from_json({k: v for k, v in data.items() if k != "loss_sum"})
    with pytest.raises(ValueError, match=r"loss_weight must be in \[0\.0, 1\.0\]"):
        LossFloor.from_json({**data, "loss_weight": 2.0})
    assert data["basis"] is not None
    with pytest.raises(ValueError, match=r"scale must be >= 1\.0"):
        LossFloor.from_json({**data, "basis": {**data["basis"], "scale": 0.5}})
    with pytest.raises(ValueError, match=r"LossFloor basis needs exactly the keys"):
        LossFloor.from_json({**data, "basis": {"average": 1.0}})
    for bad in ({"memory": 1.0}, {"cap": -0.1}, {"min_steps": 0}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be"):
            LossFloor(**bad)


def test_metrics_credit_the_share_in_the_goodput_models_and_checkpoint_it() -> None:
    metrics = _metrics(_estimator())
    for _ in range(4):
        metrics.profiler.record(1, 1, 16, accum_step=False, step_time=0.02)
    raw = metrics.grad_params()
    fn = metrics.goodput_fn(16)
    bound = metrics.bound_goodput_fn(1.0, 16)
    assert raw is not None and fn is not None and bound is not None
    assert fn.grad_params == raw and metrics.floor is None and metrics.floor_share() == 0.0
    metrics.observe_loss(0.02, [sgd_rate(0.05, 0.9)], 16)
    share = metrics.floor_share()
    assert 0.0 < share <= 0.9
    credited = metrics.goodput_fn(16)
    assert credited is not None and credited.grad_params == shared_params(raw, share)
    assert metrics.grad_params() == raw  # the estimator's own, for programs and logs
    credited_bound = metrics.bound_goodput_fn(1.0, 16)
    assert credited_bound is not None
    assert credited_bound.grad_params == metrics.floor.credit(bound.grad_params)
    assert credited_bound.grad_params.var > bound.grad_params.var
    # Each optimiser step counts toward the lapse; a loss folded restarts it.
    for _ in range(LAPSE_STEPS + 1):
        metrics.add_progress(1.0)
    assert metrics.goodput_fn(16).grad_params == raw  # type: ignore[union-attr]
    metrics.observe_loss(0.02, [sgd_rate(0.05, 0.9)], 16)
    restored = MetricsState()
    restored.from_bytes(metrics.to_bytes())
    assert restored.floor is not None and restored.floor.to_json() == metrics.floor.to_json()
    assert restored.goodput_fn(16).grad_params == credited.grad_params
    # A checkpoint written before the floor was kept (or without losses) has none.
    old = json.loads(metrics.to_bytes())
    del old["floor"]
    restored.load_json(old)
    assert restored.floor is None
    with pytest.raises(ValueError, match="the metrics state's floor: schema must be"):
        restored.load_json({**old, "floor": {"schema": "x"}})


def test_one_model_per_job_reports_the_loss() -> None:
    metrics = MetricsState()
    metrics.claim_loss("generator")
    metrics.claim_loss("generator")
    with pytest.raises(ValueError, match=r"'discriminator' reports .* but 'generator' already"):
        metrics.claim_loss("discriminator")


def test_the_floor_is_credited_under_adascale_only() -> None:
    check_rule(AdaScale, "AdaScale()")
    for kind in (AdamScale, LinearScale, SqrtScale, LEGWScale, None):
        with pytest.raises(ValueError, match=r"needs the AdaScale scaling rule.*got the rule"):
            check_rule(kind, "the rule")  # type: ignore[arg-type]


def _feed(
    floor: LossFloor,
    floor0: float,
    drift: Callable[[float], float],
    steps: int,
    target_loss: float | None = None,
) -> None:
    """Fold ``steps`` losses, one per unit of progress from 1: the drift at the
    progress plus the initial batch's floor (batch 16, efficiency 1)."""
    est, rate = _estimator(), sgd_rate(0.01, 0.9)
    assert floor_level(rate, est.var, 16.0) == pytest.approx(floor0)
    for step in range(1, steps + 1):
        p = float(step)
        floor.observe(drift(p) + floor0, [rate], est, 16, target_loss=target_loss, progress=p)


def test_without_a_target_the_share_is_the_floors_of_the_drift_shed_over_the_horizon() -> None:
    est = _estimator()
    point = est.grad_params()
    floor0 = floor_level(sgd_rate(0.01, 0.9), est.var, 16.0)
    per_doubling = 0.5 * floor0

    def drift(p: float) -> float:  # 1.0 at the end
        return 1.0 + per_doubling * (math.log2(20_000) - math.log2(p))

    floor = LossFloor()
    _feed(floor, floor0, drift, 20_000)
    # What the last halving of progress shed is taken as what the next doubling
    # sheds: the loss left is that plus the floor (the loss's average lags ~100 steps).
    assert floor.share_at(point) == pytest.approx(floor0 / (floor0 + per_doubling), rel=0.02)
    # Against a stated target of 0 (the least credit), the horizon credits more here.
    least = LossFloor()
    _feed(least, floor0, drift, 20_000, target_loss=0.0)
    assert least.share_at(point) < 0.5 * floor.share_at(point)
    # A stated target still rules; the drift is recorded all the same, so dropping the
    # target (None again) reads the horizon at once.
    least.observe(least.average, [sgd_rate(0.01, 0.9)], est, 16, progress=20_001.0)
    assert least.share_at(point) == pytest.approx(floor.share_at(point), rel=0.02)


def test_a_drift_that_sheds_nothing_leaves_the_floor_all_that_is_left() -> None:
    est = _estimator()
    floor0 = floor_level(sgd_rate(0.01, 0.9), est.var, 16.0)
    flat = LossFloor()
    _feed(flat, floor0, lambda p: 0.3, 2_000)
    assert flat.share_at(est.grad_params()) == flat.cap
    # One that rose says nothing of what comes (a rate warming up, a loss diverging):
    # the share reads how far it moved, so a large rise gets little credit.
    rising = LossFloor()
    _feed(rising, floor0, lambda p: 0.3 + 1e-4 * p, 2_000)
    rise = 1e-4 * 1_000  # over the last halving (the average's lag moves both ends)
    share = rising.share_at(est.grad_params())
    assert share == pytest.approx(floor0 / (floor0 + rise), rel=0.02)
    assert share < 0.7 * rising.cap  # a rise of 0.1 against a floor of about 0.12
    # Before the record reaches back half the progress (or without progress), the
    # least credit: the share of a target of 0.
    early = LossFloor(min_steps=1)
    early.observe(0.3 + floor0, [sgd_rate(0.01, 0.9)], est, 16, progress=0.0)
    expected = floor_share(floor0, 0.3 + floor0, 1.0, 0.0)
    assert early.share_at(est.grad_params()) == pytest.approx(expected)
    for progress in (10.0, 15.0):  # back to 7.5: before the first point, at 10
        early.observe(0.3 + floor0, [sgd_rate(0.01, 0.9)], est, 16, progress=progress)
    assert [p for p, _ in early.drift.points] == [10.0, 15.0]
    assert early.share_at(est.grad_params()) == pytest.approx(expected)


def test_the_metrics_fold_the_loss_at_the_jobs_progress() -> None:
    metrics = _metrics(_estimator())
    for _ in range(5):
        metrics.add_progress(2.0)
        metrics.observe_loss(0.5, [sgd_rate(0.01, 0.9)], 16)
    assert metrics.floor is not None
    # Back to the last point at or below half the progress.
    assert [p for p, _ in metrics.floor.drift.points] == [4.0, 6.0, 8.0, 10.0]


def test_a_floor_state_written_before_the_drift_was_kept_loads_without_one() -> None:
    floor = LossFloor(min_steps=1)
    point = _estimator().grad_params()
    assert point is not None
    floor.observe(0.6, [0.1], _estimator(), 16, progress=3.0)
    data = floor.to_json()
    kept = floor.floor0_at(point)  # at batch 16, efficiency 1
    assert data["schema"] == "adaptdl.floor/2"
    assert data["drift"] == [[3.0, pytest.approx(0.6 - kept)]]
    old = {k: v for k, v in data.items() if k not in ("drift_sum", "drift_weight", "drift")}
    loaded = LossFloor.from_json({**old, "schema": "adaptdl.floor/1"})
    assert loaded.drift.points == () and loaded.drift_weight == 0.0
    # Its drift starts now: nothing recorded until the average holds enough losses.
    full = LossFloor()
    for _ in range(120):
        full.observe(0.6, [0.1], _estimator(), 16)  # no progress given: none recorded
    state = {k: v for k, v in full.to_json().items() if k not in ("drift_sum", "drift_weight")}
    state = {k: v for k, v in state.items() if k != "drift"}
    resumed = LossFloor.from_json({**state, "schema": "adaptdl.floor/1"})
    resumed.observe(0.6, [0.1], _estimator(), 16, progress=4.0)
    assert resumed.drift.points == () and resumed.steps > resumed.min_steps
    assert loaded.share_at(point) == floor.share_at(point)
    with pytest.raises(ValueError, match=r"needs exactly the keys"):
        LossFloor.from_json({**data, "schema": "adaptdl.floor/1"})
    with pytest.raises(ValueError, match="drift must be finite"):
        LossFloor.from_json({**data, "drift": [[3.0, math.nan]]})


def test_the_drift_is_recorded_once_the_average_holds_its_memorys_worth() -> None:
    # Before min_steps losses, the average is about the mean since the start: a loss
    # falling from the first step would read as a plateau, and the share jump to its cap.
    est = _estimator()
    floor0 = floor_level(sgd_rate(0.01, 0.9), est.var, 16.0)
    floor = LossFloor()
    _feed(floor, floor0, lambda p: 2.0 - 0.002 * p, 99)
    assert floor.drift.points == () and not floor.active
    floor.observe(2.0 - 0.2 + floor0, [sgd_rate(0.01, 0.9)], est, 16, progress=100.0)
    assert [p for p, _ in floor.drift.points] == [100.0] and floor.active


def test_the_drift_average_ages_through_gaps_and_records_once_it_holds_enough() -> None:
    est, rate = _estimator(), sgd_rate(0.01, 0.9)
    lost = GradientNoiseScale(init_batch_size=16)
    lost.update(40.0, 8.0, 2, 8)  # |G|^2 estimated below 0
    floor = LossFloor()
    # An estimate resolved only from the 150th step: the drift is averaged, and then
    # recorded, from its own 100th loss, not the floor's.
    for step in range(1, 150):
        floor.observe(1.0, [rate], lost, 16, progress=float(step))
    assert floor.steps >= floor.min_steps and floor.drift_weight == 0.0
    for step in range(150, 249):
        floor.observe(1.0, [rate], est, 16, progress=float(step))
    assert floor.drift.points == ()
    floor.observe(1.0, [rate], est, 16, progress=249.0)
    assert [p for p, _ in floor.drift.points] == [249.0]
    # A gradient lost mid-run ages the average a step (its value kept): a flicker
    # leaves it recording; a long stretch leaves it too light to, until it refills.
    for step in range(250, 400):
        floor.observe(1.0, [rate], est, 16, progress=float(step))
    held = floor.drift_weight
    floor.observe(1.0, [rate], lost, 16, progress=400.0)
    assert floor.drift_weight == pytest.approx(0.99 * held) and floor.drift.points
    floor.observe(1.0, [rate], est, 16, progress=440.0)
    assert floor.drift.points[-1][0] == 440.0
    for step in range(441, 501):
        floor.observe(1.0, [rate], lost, 16, progress=float(step))
    floor.observe(1.0, [rate], est, 16, progress=560.0)
    assert floor.drift.points[-1][0] == 440.0  # 60 steps lost: too light to record
    # Steps without a loss age it alike (a lapse): a stale average would be
    # recorded far from its losses.
    for step in range(561, 800):
        floor.observe(1.0, [rate], est, 16, progress=float(step))
        floor.idle_step()  # one optimiser step per loss, as the adapter counts them
    held = floor.drift_weight
    assert held > 0.6 and floor.drift.points[-1][0] > 700.0
    for _ in range(LAPSE_STEPS + 1):
        floor.idle_step()
    floor.observe(1.0, [rate], est, 16, progress=1_200.0)
    # The 101 steps without a loss aged it, then this loss folded (the fold's own
    # memory): too light to record.
    assert floor.drift_weight == pytest.approx(held * 0.99**101 * 0.99 + 0.01)
    assert floor.drift.points[-1][0] < 1_200.0


def test_a_flickering_estimate_leaves_the_horizon_reading() -> None:
    # |G|^2 near 0 late in training can fall below it now and then: each such step
    # ages the drift's average, it does not restart it.
    est, rate = _estimator(), sgd_rate(0.01, 0.9)
    floor0 = floor_level(rate, est.var, 16.0)
    lost = GradientNoiseScale(init_batch_size=16)
    lost.update(40.0, 8.0, 2, 8)
    floor = LossFloor()
    for step in range(1, 4_001):
        gns = lost if step % 50 == 0 else est
        loss = 1.0 - 0.05 * math.log2(step) + floor0
        floor.observe(loss, [rate], gns, 16, progress=float(step))
    floor.observe(1.0 - 0.05 * math.log2(4_001) + floor0, [rate], est, 16, progress=4_001.0)
    assert floor.share_at(est.grad_params()) == pytest.approx(floor0 / (floor0 + 0.05), rel=0.05)


def test_the_drift_does_not_jump_when_a_larger_batch_lowers_the_floor() -> None:
    # The floor kept at each step's batch is subtracted: a loss that falls with the
    # floor when the batch grows (here at once) leaves the drift where it was.
    est, rate = _estimator(), sgd_rate(0.01, 0.9)
    floor0 = floor_level(rate, est.var, 16.0)
    floor = LossFloor()
    for step in range(1, 1_001):
        batch = 16 if step <= 500 else 64
        kept = floor0 * est.gain(batch / 16) / (batch / 16)
        floor.observe(0.5 + kept, [rate], est, batch, progress=float(step))
    assert [d for _, d in floor.drift.points] == pytest.approx([0.5] * len(floor.drift.points))


def test_observe_checks_the_rates_from_the_first_step() -> None:
    with pytest.raises(ValueError, match=r"rates must have one value per parameter group \(2\)"):
        LossFloor().observe(0.6, [0.1], _estimator(groups=2), 16)


def test_a_recorded_drift_round_trips_with_the_floor() -> None:
    est = _estimator()
    floor = LossFloor()
    _feed(floor, floor_level(sgd_rate(0.01, 0.9), est.var, 16.0), lambda p: 2.0 / p, 1_000)
    again = LossFloor.from_json(json.loads(json.dumps(floor.to_json())))
    assert again.drift.points == floor.drift.points and len(floor.drift.points) > 3
    assert again.share_at(est.grad_params()) == floor.share_at(est.grad_params())
    with pytest.raises(ValueError, match="drift_weight must be in"):
        LossFloor.from_json({**floor.to_json(), "drift_weight": 1.5})
