"""Gradient noise scale: exact estimator algebra, convergence on known problems, state."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from adaptdl.core.goodput import GoodputFunction, GradParams, PerfParams
from adaptdl.core.stats.gns import GNS_SCHEMA, GradientNoiseScale, squared_norm, step_estimates
from adaptdl.core.stats.scaling import adascale_gain

SETTINGS = settings(max_examples=100, deadline=None)

stats = st.floats(min_value=1e-3, max_value=1e3)
sizes = st.integers(min_value=1, max_value=256)


def expected_norms(sqr: float, var: float, count: int, b: int) -> tuple[float, float]:
    """Return (local_sqr, total_sqr) equal to their expectations."""
    return count * (sqr + var / b), sqr + var / (count * b)


def feed_expected(gns: GradientNoiseScale, sqr: float, var: float, count: int, b: int) -> None:
    local, total = expected_norms(sqr, var, count, b)
    gns.update(local, total, count, b)


# -- the estimators are unbiased: fed their expectations they return the truth --


@SETTINGS
@given(stats, stats, st.integers(min_value=2, max_value=64), sizes, sizes)
def test_update_recovers_statistics_from_expected_norms(
    sqr: float, var: float, count: int, b: int, m0: int
) -> None:
    gns = GradientNoiseScale(m0)
    feed_expected(gns, sqr, var, count, b)
    assert gns.sqr == pytest.approx(sqr, rel=1e-6, abs=1e-9 * var)
    assert gns.var == pytest.approx(var, rel=1e-6, abs=1e-9 * sqr * b * count)


@SETTINGS
@given(stats, stats, sizes, sizes, sizes)
def test_differenced_recovers_statistics_from_expected_norms(
    sqr: float, var: float, b_prev: int, b_cur: int, m0: int
) -> None:
    gns = GradientNoiseScale(m0)
    prev, cur = sqr + var / b_prev, sqr + var / b_cur
    mixed = sqr + var * (1 / b_prev + 1 / b_cur) / 4
    gns.update_differenced(prev, cur, mixed, b_cur, prev_batch_size=b_prev)
    assert gns.sqr == pytest.approx(sqr, rel=1e-6, abs=1e-9 * var)
    assert gns.var == pytest.approx(var, rel=1e-6, abs=1e-9 * sqr * min(b_prev, b_cur))


def test_differenced_pair_equals_two_micro_batch_update() -> None:
    rng = np.random.default_rng(1)
    g_prev, g_cur = rng.normal(size=7), rng.normal(size=7)
    mixed = (g_prev + g_cur) / 2
    a, b = GradientNoiseScale(16), GradientNoiseScale(16)
    a.update_differenced(g_prev @ g_prev, g_cur @ g_cur, mixed @ mixed, 8)
    b.update(g_prev @ g_prev + g_cur @ g_cur, mixed @ mixed, 2, 8)
    assert a.sqr == pytest.approx(b.sqr, rel=1e-12)
    assert a.var == pytest.approx(b.var, rel=1e-12)


def test_hand_computed_update() -> None:
    # Micro-batch gradients (1, 0) and (0, 1), batch 2 each: m_s = 1, m_B = 0.5.
    gns = GradientNoiseScale(4)
    gns.update(2.0, 0.5, 2, 2)
    assert gns.sqr == pytest.approx(0.0)  # (2 * 0.5 - 1) / 1
    assert gns.var == pytest.approx(2.0)  # (1 - 0.5) * 2 * 2 / 1
    assert gns.grad_params() == GradParams(sqr=0.0, var=0.5)


def test_step_estimates_are_what_update_folds_in() -> None:
    # Three micro-batches (1, 0), (0, 1), (1, 1) of 2 samples: m_s = 4/3, m_B = 5/9.
    sqr, var = step_estimates(4.0, 5.0 / 9.0, 3, 2)
    assert sqr == pytest.approx((3 * 5 / 9 - 4 / 3) / 2)
    assert var == pytest.approx((4 / 3 - 5 / 9) * 2 * 3 / 2)
    gns = GradientNoiseScale(6)
    gns.update(4.0, 5.0 / 9.0, 3, 2)
    assert (gns._raw_sqr, gns._raw_var) == pytest.approx((sqr, var), rel=1e-12)  # as is
    with pytest.raises(ValueError, match="count must be >= 2"):
        step_estimates(1.0, 1.0, 1, 2)


# -- the moving average --


def test_first_update_is_taken_as_is_by_bias_correction() -> None:
    gns = GradientNoiseScale(32, smoothing=0.9)
    feed_expected(gns, 3.0, 50.0, 4, 8)
    assert gns.sqr == pytest.approx(3.0)
    assert gns.var == pytest.approx(50.0)
    assert gns.num_updates == 1


def test_moving_average_weights_steps_by_their_scale() -> None:
    m0, s = 32, 0.9
    gns = GradientNoiseScale(m0, smoothing=s)
    feed_expected(gns, 1.0, 10.0, 2, 16)  # scale 1
    feed_expected(gns, 3.0, 30.0, 8, 16)  # scale 4
    t1, t2 = s**1, s**4
    w1, w2 = (1 - t1) * t2, 1 - t2
    assert gns.sqr == pytest.approx((w1 * 1.0 + w2 * 3.0) / (w1 + w2))
    assert gns.var == pytest.approx((w1 * 10.0 + w2 * 30.0) / (w1 + w2))
    # A larger batch moves the average more than a smaller one does.
    assert w2 > w1 / t2


def test_negative_raw_estimates_are_clamped_on_read_but_kept_in_the_average() -> None:
    gns = GradientNoiseScale(8, smoothing=0.5)
    gns.update(2.0, 0.0, 2, 1)  # raw sqr = (0 - 1) / 1 = -1
    assert gns.sqr == 0.0
    assert gns.sqr_biased[0] < 0.0
    feed_expected(gns, 4.0, 1.0, 2, 1)
    # The negative history still pulls the average below 4.
    assert 0.0 < gns.sqr < 4.0


def test_unbiased_update_after_differenced_ones_restarts_the_average() -> None:
    gns = GradientNoiseScale(8, smoothing=0.99)
    gns.update_differenced(10.0, 10.0, 1.0, 8)  # very noisy, biased kind
    assert gns.differenced
    feed_expected(gns, 2.0, 5.0, 4, 8)
    assert not gns.differenced
    assert gns.sqr == pytest.approx(2.0)
    assert gns.var == pytest.approx(5.0)


def test_differenced_update_after_unbiased_ones_keeps_the_average() -> None:
    gns = GradientNoiseScale(8, smoothing=0.5)
    feed_expected(gns, 2.0, 5.0, 4, 8)
    gns.update_differenced(4.0, 4.0, 4.0, 8)  # raw estimate: sqr 4, var 0
    assert 2.0 < gns.sqr < 4.0
    assert 0.0 < gns.var < 5.0


def test_reset_forgets_estimates() -> None:
    gns = GradientNoiseScale(8)
    feed_expected(gns, 1.0, 100.0, 4, 8)
    gns.reset()
    assert not gns.has_estimate
    assert gns.grad_params() is None


# -- convergence on problems with known gradient statistics --


def run_microbatches(
    gns: GradientNoiseScale,
    grads: np.ndarray,
    b: int,
    precond: np.ndarray | None = None,
    groups: tuple[slice, ...] = (slice(None),),
) -> None:
    """Feed per-step gradients of micro-batches of ``b`` samples, shape (steps, count, dim).

    As the torch adapter would: ``update`` for several micro-batches a step, else
    ``update_differenced`` with the previous step.
    """
    count = grads.shape[1]
    prev = None
    for step in grads:
        if count > 1:
            mean = step.mean(axis=0)
            local = [sum(squared_norm(g[s], pre(precond, s)) for g in step) for s in groups]
            total = [squared_norm(mean[s], pre(precond, s)) for s in groups]
            gns.update(local, total, count, b)
        else:
            cur = step[0]
            if prev is not None:
                mixed = (prev + cur) / 2
                gns.update_differenced(
                    [squared_norm(prev[s], pre(precond, s)) for s in groups],
                    [squared_norm(cur[s], pre(precond, s)) for s in groups],
                    [squared_norm(mixed[s], pre(precond, s)) for s in groups],
                    b,
                )
            prev = cur


def pre(precond: np.ndarray | None, s: slice) -> np.ndarray | None:
    return None if precond is None else precond[s]


def gaussian_problem(seed: int, dim: int = 16) -> tuple[np.random.Generator, Any, Any]:
    rng = np.random.default_rng(seed)
    mean = rng.normal(size=dim) * 0.5
    sd = rng.uniform(0.5, 2.0, size=dim)
    return rng, mean, sd


@pytest.mark.parametrize(
    ("count", "b"),
    [(2, 4), (4, 4), (8, 2), (3, 16), (1, 8)],
    ids=["2x4", "4x4", "8x2", "3x16", "single-8-differenced"],
)
def test_estimates_converge_on_gaussian_per_sample_gradients(count: int, b: int) -> None:
    rng, mean, sd = gaussian_problem(10 + count * b)
    steps = 3000
    samples = mean + sd * rng.standard_normal((steps, count, b, mean.size))
    gns = GradientNoiseScale(32)
    run_microbatches(gns, samples.mean(axis=2), b)
    assert gns.sqr == pytest.approx(mean @ mean, rel=0.1)
    assert gns.var == pytest.approx(sd @ sd, rel=0.1)
    # A step worth more (less) than an initial-batch step when its batch is larger (smaller).
    assert (gns.gain(count * b / 32) > 1.0) == (count * b > 32)


def test_estimates_converge_on_linear_regression_gradients() -> None:
    # Loss (x.w - y)^2 / 2 with y = x.w* + eps, x ~ N(0, I), eps ~ N(0, s^2), at
    # fixed w: per-sample gradient x (x.d - eps) with d = w - w*. Its mean is d and
    # (Isserlis) its covariance |d|^2 I + d d^T + s^2 I: not Gaussian.
    rng = np.random.default_rng(7)
    dim, noise, count, b, steps = 8, 0.5, 4, 4, 3000
    d = rng.normal(size=dim) * 0.3
    x = rng.standard_normal((steps, count, b, dim))
    eps = noise * rng.standard_normal((steps, count, b))
    per_sample = x * (x @ d - eps)[..., None]
    gns = GradientNoiseScale(16)
    run_microbatches(gns, per_sample.mean(axis=2), b)
    true_var = (dim + 1) * (d @ d) + dim * noise**2
    assert gns.sqr == pytest.approx(d @ d, rel=0.1)
    assert gns.var == pytest.approx(true_var, rel=0.1)


@pytest.mark.parametrize("count", [4, 1], ids=["4-micro-batches", "differenced"])
def test_preconditioned_estimates_converge_per_group(count: int) -> None:
    rng, mean, sd = gaussian_problem(3)
    precond = rng.uniform(0.5, 3.0, size=mean.size)
    groups = (slice(0, 6), slice(6, None))
    b, steps = 4, 3000
    samples = mean + sd * rng.standard_normal((steps, count, b, mean.size))
    gns = GradientNoiseScale(16, num_groups=2)
    run_microbatches(gns, samples.mean(axis=2), b, precond, groups)
    true_sqr = [float(((mean / precond)[s] ** 2).sum()) for s in groups]
    true_var = [float(((sd / precond)[s] ** 2).sum()) for s in groups]
    assert gns.group_sqr == pytest.approx(true_sqr, rel=0.1)
    assert gns.group_var == pytest.approx(true_var, rel=0.1)
    assert gns.sqr == pytest.approx(sum(true_sqr), rel=0.1)
    assert gns.var == pytest.approx(sum(true_var), rel=0.1)


# -- gain and the goodput statistics --


def test_gain_and_grad_params_before_any_update() -> None:
    gns = GradientNoiseScale(64)
    assert not gns.has_estimate
    assert gns.gain(8.0) == 1.0
    assert gns.group_gains(8.0) == (1.0,)
    assert gns.grad_params() is None
    assert gns.noise_scale is None


@SETTINGS
@given(stats, stats, sizes, st.floats(min_value=0.1, max_value=1e3))
def test_gain_is_adascale_gain_of_grad_params(sqr: float, var: float, m0: int, s: float) -> None:
    gns = GradientNoiseScale(m0)
    feed_expected(gns, sqr, var, 2, 4)
    params = gns.grad_params()
    assert params is not None
    assert params.var == pytest.approx(gns.var / m0)
    assert gns.gain(s) == adascale_gain(params.sqr, params.var, s)
    if s >= 1:
        assert 1.0 <= gns.gain(s) <= s


@SETTINGS
@given(stats, stats, sizes, st.floats(min_value=1.0, max_value=1e3))
def test_grad_params_feed_goodput_efficiency_consistently(
    sqr: float, var: float, m0: int, s: float
) -> None:
    # One initial-batch sample's worth of progress per sample, times the gain per step.
    gns = GradientNoiseScale(m0)
    feed_expected(gns, sqr, var, 2, 4)
    params = gns.grad_params()
    assert params is not None
    fn = GoodputFunction(PerfParams(0.1, 0.01, 0.0, 0.0, 0.0, 0.0, 1.0), params, m0)
    assert fn.efficiency(s * m0) == pytest.approx(gns.gain(s) / s, rel=1e-9)


def test_noise_scale_is_var_over_sqr() -> None:
    gns = GradientNoiseScale(8)
    feed_expected(gns, 2.0, 50.0, 4, 8)
    assert gns.noise_scale == pytest.approx(25.0)
    gns = GradientNoiseScale(8)
    gns.update(2.0, 0.5, 2, 2)  # sqr estimate 0
    assert gns.noise_scale == math.inf


def test_group_gains_use_each_groups_statistics() -> None:
    gns = GradientNoiseScale(4, num_groups=2)
    # Group 0: no noise; group 1: all noise.
    gns.update([2 * 1.0, 2 * 0.5], [1.0, 0.5 / 2], 2, 2)
    assert gns.group_sqr == pytest.approx((1.0, 0.0))
    assert gns.group_var == pytest.approx((0.0, 1.0), abs=1e-12)
    gains = gns.group_gains(8.0)
    assert gains[0] == pytest.approx(1.0)
    assert gains[1] == pytest.approx(8.0)
    assert 1.0 < gns.gain(8.0) < 8.0


# -- persistence --


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("update"),
            st.floats(0.0, 1e3),
            st.floats(0.0, 1.0),
            st.integers(2, 16),
            st.integers(1, 64),
        ),
        st.tuples(
            st.just("diff"),
            st.floats(0.0, 1e3),
            st.floats(0.0, 1e3),
            st.floats(0.0, 1.0),
            st.integers(1, 64),
        ),
    ),
    max_size=12,
)


def apply(gns: GradientNoiseScale, op: tuple[Any, ...]) -> None:
    if op[0] == "update":
        _, local, frac, count, b = op
        # total between |mean|^2's bounds: at most local / count.
        gns.update(local, frac * local / count, count, b)
    else:
        _, prev, cur, frac, b = op
        gns.update_differenced(prev, cur, frac * (prev + cur) / 2, b)


@SETTINGS
@given(ops, ops, st.integers(1, 512), st.floats(0.5, 0.9999))
def test_json_round_trip_is_exact_and_behaves_the_same(
    before: list[tuple[Any, ...]], after: list[tuple[Any, ...]], m0: int, smoothing: float
) -> None:
    gns = GradientNoiseScale(m0, smoothing=smoothing)
    for op in before:
        apply(gns, op)
    restored = GradientNoiseScale.from_json(json.loads(json.dumps(gns.to_json())))
    assert restored == gns
    for op in after:
        apply(gns, op)
        apply(restored, op)
    assert restored == gns
    assert restored.to_json() == gns.to_json()


def test_json_is_documented_schema() -> None:
    gns = GradientNoiseScale(8, num_groups=2)
    data = gns.to_json()
    assert data["schema"] == GNS_SCHEMA == "adaptdl.gns/3"
    assert data["sqr_biased"] == [0.0, 0.0]
    assert json.loads(json.dumps(data)) == data


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"schema": "adaptdl.gns/0"}, "schema"),
        ({"extra": 1}, "unexpected"),
        ({"weight": None}, "weight"),
        ({"weight": 1.5}, "weight"),
        ({"weight": 0.0, "sqr_biased": [1.0]}, "weight must be > 0"),
        ({"sqr_biased": [1.0, 2.0]}, "sqr_biased must have 1"),
        ({"var_biased": "ab"}, "var_biased"),
        ({"var_biased": [float("nan")]}, r"var_biased\[0\]"),
        ({"differenced": "yes"}, "differenced"),
        ({"progress": 1.0}, "unexpected"),  # progress is the job's (MetricsState)
        ({"num_updates": 1.5}, "num_updates"),
        ({"smoothing": 1.0}, "smoothing"),
    ],
)
def test_from_json_rejects_bad_state(change: dict[str, Any], match: str) -> None:
    gns = GradientNoiseScale(8)
    feed_expected(gns, 1.0, 1.0, 2, 2)
    data = {**gns.to_json(), **change}
    with pytest.raises(ValueError, match=match):
        GradientNoiseScale.from_json(data)


def test_from_json_rejects_missing_keys_and_non_mappings() -> None:
    data = GradientNoiseScale(8).to_json()
    del data["differenced"]
    with pytest.raises(ValueError, match=r"missing \['differenced'\]"):
        GradientNoiseScale.from_json(data)
    with pytest.raises(TypeError, match="mapping"):
        GradientNoiseScale.from_json([1, 2])  # type: ignore[arg-type]


# -- bad input --


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"init_batch_size": 0}, "init_batch_size must be >= 1"),
        ({"init_batch_size": 2.5}, "init_batch_size must be an int"),
        ({"init_batch_size": 8, "num_groups": 0}, "num_groups must be >= 1"),
        ({"init_batch_size": 8, "smoothing": 0.0}, r"smoothing must be in \(0\.0, 1\.0\), got"),
        ({"init_batch_size": 8, "smoothing": 1.0}, r"smoothing must be in \(0\.0, 1\.0\), got"),
        ({"init_batch_size": 8, "smoothing": float("nan")}, "smoothing must be finite"),
    ],
)
def test_constructor_rejects_bad_configuration(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GradientNoiseScale(**kwargs)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((2.0, 1.0, 0, 4), "count must be >= 1"),
        ((2.0, 1.0, 1, 4), "update_differenced"),
        ((2.0, 1.0, 2.0, 4), "count must be an int"),
        ((2.0, 1.0, 2, 0), "batch_size must be >= 1"),
        ((2.0, 1.0, 2, True), "batch_size must be an int"),
        ((-1.0, 1.0, 2, 4), "local_sqr must be finite and >= 0"),
        ((2.0, float("nan"), 2, 4), "total_sqr must be finite and >= 0"),
        ((float("inf"), 1.0, 2, 4), "local_sqr must be finite"),
        (([2.0, 1.0], 1.0, 2, 4), r"local_sqr must have shape \(1,\)"),
        (("2", 1.0, 2, 4), "local_sqr must be a number"),
        ((2.0, [True], 2, 4), "total_sqr must be an array of real numbers"),
    ],
)
def test_update_rejects_bad_input(args: tuple[Any, ...], match: str) -> None:
    gns = GradientNoiseScale(8)
    with pytest.raises(ValueError, match=match):
        gns.update(*args)
    assert gns == GradientNoiseScale(8)  # nothing changed


def test_update_wants_one_value_per_group() -> None:
    gns = GradientNoiseScale(8, num_groups=2)
    with pytest.raises(ValueError, match="one value per parameter group"):
        gns.update(2.0, 1.0, 2, 4)
    with pytest.raises(ValueError, match=r"total_sqr must be finite and >= 0, got -1.0 \(group 1"):
        gns.update([2.0, 2.0], [1.0, -1.0], 2, 4)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((1.0, 1.0, 1.0, 0), {}, "batch_size must be >= 1"),
        ((1.0, 1.0, 1.0, 4), {"prev_batch_size": 0}, "prev_batch_size must be >= 1"),
        ((-1.0, 1.0, 1.0, 4), {}, "prev_sqr must be finite and >= 0"),
        ((1.0, float("nan"), 1.0, 4), {}, "cur_sqr must be finite"),
        ((1.0, 1.0, -0.5, 4), {}, "mixed_sqr must be finite and >= 0"),
    ],
)
def test_update_differenced_rejects_bad_input(
    args: tuple[Any, ...], kwargs: dict[str, Any], match: str
) -> None:
    gns = GradientNoiseScale(8)
    with pytest.raises(ValueError, match=match):
        gns.update_differenced(*args, **kwargs)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan")])
def test_gains_reject_bad_scale(scale: float) -> None:
    gns = GradientNoiseScale(8)
    for method in (gns.gain, gns.group_gains):
        with pytest.raises(ValueError, match="scale must be"):
            method(scale)


def test_squared_norm_with_and_without_preconditioner() -> None:
    grad = np.array([[3.0, 4.0], [0.0, 2.0]])
    assert squared_norm(grad) == 29.0
    assert squared_norm(grad, np.array([1.0, 2.0])) == 9.0 + 4.0 + 1.0
    assert squared_norm([3, 4], 0.5) == 100.0
    with pytest.raises(ValueError, match=r"precond must be finite and > 0, got 0\.0"):
        squared_norm(grad, np.array([1.0, 0.0]))
    with pytest.raises(ValueError, match="grad must be finite"):
        squared_norm([np.inf])
    with pytest.raises(TypeError, match="grad must be an array of real numbers"):
        squared_norm(["a"])


# -- the spread of the estimates -------------------------------------------------------


def _feed_exact(gns: GradientNoiseScale, sqr: float, var: float, count: int, b: int) -> None:
    """One step whose |G|^2 and tr(Sigma) estimates are exactly ``sqr`` and ``var``."""
    total = sqr + var / (b * count)
    gns.update([count * (total + var * (count - 1) / (b * count))], [total], count, b)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0.0, 50.0), st.floats(1.0, 500.0), st.sampled_from([2, 4, 16])),
        min_size=2,
        max_size=30,
    ),
    st.sampled_from([0.5, 0.9, 0.99]),
)
def test_errors_are_the_weighted_standard_errors(
    steps: list[tuple[float, float, int]], smoothing: float
) -> None:
    # The reference: the weighted mean's standard error from the explicit weights
    # a_k = (1 - theta_k) prod_{j > k} theta_j of the per-step estimates.
    b, m0 = 4, 8
    gns = GradientNoiseScale(init_batch_size=m0, smoothing=smoothing)
    for sqr, var, count in steps:
        _feed_exact(gns, sqr, var, count, b)
    thetas = np.array([smoothing ** (count * b / m0) for _, _, count in steps])
    # The differences are folded in from the second step on, each with its step's theta.
    later = thetas[1:]
    a = np.array([(1 - t) * np.prod(later[i + 1 :]) for i, t in enumerate(later)])
    n = a.sum() ** 2 / (a @ a)
    assert gns.effective_updates == pytest.approx(n, rel=1e-9)
    # Relative to the level max(|G|^2, 0) + tr(Sigma) / M0, of the two steps and of
    # the current estimates.
    levels = np.array([max(sqr, 0.0) + var / m0 for sqr, var, _ in steps])
    pair = 0.5 * (levels[1:] + levels[:-1])
    now = max(gns.sqr, 0.0) + gns.var / m0
    for column, error in ((0, gns.sqr_error), (1, gns.var_error)):
        x = np.array([step[column] for step in steps])
        half_sq = 0.5 * (np.diff(x) / pair) ** 2
        expected = now * math.sqrt(a @ half_sq / a.sum() / n) if n > 1 + 1e-9 else math.inf
        assert error == pytest.approx(expected, rel=1e-6, abs=1e-9 * (1 + abs(x).max()))


def test_errors_ignore_a_transient_of_the_level() -> None:
    # Under Adam the per-step estimates fall by orders of magnitude early in training,
    # their noise with them. The relative differences count little of that transient;
    # absolute ones (or the spread of the levels) would count it for thousands of steps.
    gen = np.random.default_rng(1)
    b, count, m0, steps = 8, 2, 16, 1500
    falling = GradientNoiseScale(init_batch_size=m0, smoothing=0.999)
    steady = GradientNoiseScale(init_batch_size=m0, smoothing=0.999)
    for step in range(steps):
        level = 1.0 + 1e3 * math.exp(-step / 30)  # 1000x in the first 200 steps
        noise = 0.2 * gen.standard_normal()
        _feed_exact(falling, level * (0.5 + noise), level * m0 * 0.5, count, b)
        _feed_exact(steady, 0.5 + noise, m0 * 0.5, count, b)
    # (The averages still carry the transient, the estimator's smoothing; the errors
    # relative to them do not.)
    assert falling.sqr_error / falling.sqr < 1.5 * steady.sqr_error / steady.sqr


def test_errors_of_iid_steps_shrink_like_one_over_root_n() -> None:
    gen = np.random.default_rng(0)
    gns = GradientNoiseScale(init_batch_size=16, smoothing=0.999)
    b, count, var = 8, 2, 1000.0
    errors = {}
    for step in range(1, 2001):
        _feed_exact(gns, 50.0 + 10.0 * gen.standard_normal(), var, count, b)
        if step in (100, 400, 1600):
            errors[step] = gns.sqr_error
    # sd 10 over n effective steps (n close to the step count while it is << 1000).
    assert errors[100] == pytest.approx(10.0 / math.sqrt(gns_n(100)), rel=0.25)
    assert errors[400] < errors[100] / 1.6
    assert gns.var_error == pytest.approx(0.0, abs=1e-6 * var)  # tr(Sigma) exact every step


def gns_n(steps: int, smoothing: float = 0.999) -> float:
    theta = smoothing  # scale 1 per step
    a = np.array([(1 - theta) * theta ** (steps - 1 - i) for i in range(steps)])
    return float(a.sum() ** 2 / (a @ a))


def test_errors_are_infinite_before_three_steps_and_bound_supports_no_growth() -> None:
    gns = GradientNoiseScale(init_batch_size=16)
    assert gns.grad_params_bound(2.0) is None
    gns.update([4.0], [1.5], 2, 8)
    gns.update([4.1], [1.5], 2, 8)  # one difference: no spread yet
    assert gns.sqr_error == math.inf and gns.var_error == math.inf
    bound = gns.grad_params_bound(2.0)
    assert bound is not None and bound.var == 0.0  # no noise supported: no growth
    assert gns.grad_params_bound(0.0) == gns.grad_params()
    gns.update([4.2], [1.4], 2, 8)
    assert math.isfinite(gns.sqr_error) and math.isfinite(gns.var_error)
    gns.reset()
    assert gns.effective_updates == 0.0 and gns.sqr_error == math.inf


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0.0, 100.0), st.floats(0.0, 100.0)), min_size=3, max_size=20),
    st.floats(0.0, 4.0),
    st.floats(0.0, 4.0),
)
# Found by hypothesis: a negative |G|^2 estimate gave no growth at z = 0.5 but a
# positive bound, so growth, at z = 1.
@example([(0.0, 0.0), (1.0, 0.0), (4.0, 1.0)], 1.0, 0.5)
@example([(0.0, 0.0), (1.0, 0.0), (0.0, 0.0)], 1.0, 0.5)
def test_bound_has_no_more_noise_than_the_estimate_and_tightens_with_z(
    pairs: list[tuple[float, float]], z1: float, z2: float
) -> None:
    gns = GradientNoiseScale(init_batch_size=16, smoothing=0.9)
    for local, total in pairs:
        gns.update([local + total], [total], 2, 8)
    point = gns.grad_params()
    lo, hi = sorted((z1, z2))
    a, b = gns.grad_params_bound(lo), gns.grad_params_bound(hi)
    assert point is not None and a is not None and b is not None
    assert a.var <= point.var and b.var <= a.var
    assert a.sqr >= point.sqr - 1e-12 * (1 + point.sqr) and b.sqr >= a.sqr - 1e-12 * (1 + a.sqr)
    # The noise scale, what the decision acts on, never grows with the confidence asked.
    assert b.var * a.sqr <= a.var * b.sqr * (1 + 1e-12)


def test_state_of_the_schema_without_spread_loads() -> None:
    gns = GradientNoiseScale(16, smoothing=0.99)
    for k in range(5):
        gns.update([4.0 + k], [1.5], 2, 8)
    old = {
        k: v
        for k, v in gns.to_json().items()
        if k not in ("sqr_diff_biased", "var_diff_biased", "last_step")
        and k not in ("moment_weight", "moment_weight_sq")
    } | {"schema": "adaptdl.gns/2"}
    loaded = GradientNoiseScale.from_json(old)
    assert loaded.sqr == gns.sqr and loaded.var == gns.var and loaded.samples == gns.samples
    assert loaded.sqr_error == math.inf  # no spread known
    for local in (5.0, 6.0):
        loaded.update([local], [1.5], 2, 8)
    assert loaded.sqr_error == math.inf  # one difference since the load
    loaded.update([4.5], [1.5], 2, 8)
    assert math.isfinite(loaded.sqr_error)
    assert GradientNoiseScale.from_json(loaded.to_json()) == loaded
    with pytest.raises(ValueError, match=r"unexpected|missing"):
        GradientNoiseScale.from_json(old | {"schema": "adaptdl.gns/3"})


norms = st.lists(st.floats(min_value=0.0, max_value=1e6), min_size=2, max_size=2)


@given(st.lists(st.tuples(norms, norms, norms), min_size=1, max_size=6), sizes)
def test_tuples_of_floats_fold_exactly_as_arrays_do(steps: list[Any], batch: int) -> None:
    # The per-step path takes tuples of floats without numpy; any other form of the
    # same values goes through the array check and must fold to the same bits.
    fast, checked = (GradientNoiseScale(init_batch_size=4, num_groups=2) for _ in range(2))
    for a, b, c in steps:
        fast.update(tuple(a), tuple(b), 3, batch)
        checked.update(np.array(a), list(b), 3, batch)
        fast.update_differenced(tuple(a), tuple(b), tuple(c), batch)
        checked.update_differenced(np.array(a), np.array(b), list(c), batch)
    assert fast.to_json() == checked.to_json()


@pytest.mark.parametrize("bad", [(-1.0, 1.0), (math.inf, 1.0), (math.nan, 1.0), (1.0,)])
def test_a_bad_tuple_of_floats_is_refused_as_an_array_is(bad: tuple[float, ...]) -> None:
    gns = GradientNoiseScale(init_batch_size=4, num_groups=2)
    with pytest.raises(ValueError, match="local_sqr"):
        gns.update(bad, (1.0, 1.0), 2, 4)


def test_an_overflowing_step_is_refused_and_changes_nothing() -> None:
    gns = GradientNoiseScale(init_batch_size=4)
    gns.update_differenced((1.0,), (2.0,), (1.2,), 4)
    before = gns.to_json()
    # Finite squared norms whose differences overflow the float range.
    with pytest.raises(ValueError, match="overflow"):
        gns.update_differenced((1e308,), (1e308,), (0.0,), 4)
    assert gns.to_json() == before
    assert GradientNoiseScale.from_json(gns.to_json()) == gns


def test_resolved_reads_the_summed_raw_estimate_of_sqr() -> None:
    # Resolved: the whole model's |G|^2 estimated above 0 (the groups' raw sum, before
    # the clamp); no estimate resolves nothing.
    assert not GradientNoiseScale(init_batch_size=4, num_groups=2).resolved
    for groups, resolved in (((2.0, -1.0), True), ((1.0, -2.0), False), ((0.0, 0.0), False)):
        gns = GradientNoiseScale(
            4, num_groups=2, sqr_biased=groups, var_biased=(1.0, 1.0), weight=1.0
        )
        assert gns.resolved is resolved
    # At exactly 0 with no spread, the bound reads |G|^2 as vanishing, not as 0: the
    # decision's growth cap (`GoodputDecision.resolved`) is then what limits growth.
    flat = GradientNoiseScale(
        16,
        sqr_biased=(0.0,),
        var_biased=(1000.0,),
        weight=1.0,
        sqr_diff_biased=0.0,
        var_diff_biased=0.0,
        moment_weight=1.0,
        moment_weight_sq=1e-3,
    )
    bound = flat.grad_params_bound(2.0)
    assert bound is not None and bound.sqr == 1e-300 and bound.var == pytest.approx(1000.0 / 16)
