"""`experiments.outcome.noise_floor`: the per-step credit (the floor and its share are
core's: tests/core/test_floor.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from experiments.outcome import noise_floor
from hypothesis import given, settings
from hypothesis import strategies as st

import torch
from adaptdl.core.stats.gns import GradientNoiseScale


def _efficiency(scale: float, m0: float, batch: float) -> float:
    return (scale + m0) / (scale + max(batch, m0))


@settings(max_examples=200, deadline=None)
@given(st.floats(0.0, 1e5), st.floats(1.0, 64.0), st.floats(0.5, 8192.0))
def test_efficiency_at_is_cores_efficiency_of_the_scale(
    scale: float, m0: float, batch: float
) -> None:
    assert noise_floor.efficiency_at(scale, m0, batch) == pytest.approx(
        _efficiency(scale, m0, batch), rel=1e-12
    )


@settings(max_examples=200, deadline=None)
@given(st.floats(1.0, 1e4), st.floats(17.0, 4096.0), st.floats(0.0, 0.45))
def test_the_credited_scale_matches_the_credited_objectives_slope_at_the_batch(
    scale: float, batch: float, share: float
) -> None:
    m0 = 16.0
    credited = noise_floor.credited_scale(scale, batch, share)
    assert credited >= scale * (1.0 - 1e-12)
    # The objective E (1 - kappa E) with kappa E(batch) = share: d log / d log M at the
    # batch against Pollux's d log E' / d log M there.
    kappa = share / _efficiency(scale, m0, batch)

    def objective(m: float) -> float:
        em = _efficiency(scale, m0, m)
        return math.log(em * (1.0 - kappa * em))

    h = 1e-6
    slope = (objective(batch * math.exp(h)) - objective(batch * math.exp(-h))) / (2 * h)
    assert -batch / (credited + batch) == pytest.approx(slope, rel=1e-4, abs=1e-9)


def test_the_credited_scale_without_credit_past_half_and_its_refusal() -> None:
    assert noise_floor.credited_scale(100.0, 64.0, 0.0) == 100.0
    assert noise_floor.credited_scale(100.0, 64.0, -0.2) == 100.0
    assert noise_floor.credited_scale(100.0, 64.0, math.nan) == 100.0
    assert noise_floor.credited_scale(100.0, 64.0, 0.5) == noise_floor._HUGE
    with pytest.raises(ValueError, match="need scale >= 0 and batch > 0"):
        noise_floor.credited_scale(100.0, 0.0, 0.1)


def _quadratic_run(
    noise: float, steps: int, seed: int, beta: float
) -> tuple[float | None, float, float]:
    """SGD on 1/2 x' H x with gradient noise of covariance noise^2 I / M (M = 8),
    measured by a FloorMeter; also the closed form of the share along the same path,
    weighted as the meter weighs its pairs."""
    gen = np.random.default_rng(seed)
    h = np.array([0.5, 1.0, 2.0, 4.0])
    lr, m = 0.05, 8.0
    var = noise * noise * len(h)  # tr(Sigma) per sample
    x = torch.tensor([3.0, -2.0, 1.0, 0.5], dtype=torch.float64, requires_grad=True)
    meter = noise_floor.FloorMeter(beta=beta, min_steps=1)
    pairs: list[tuple[float, float]] = []
    for _ in range(steps):
        g = h * x.detach().numpy()
        x.grad = torch.as_tensor(g + gen.normal(0.0, noise / math.sqrt(m), len(h)))
        meter.before_step([x])
        # E over the noise of the pair's cost and gain, at this step's x (the meter
        # pairs this step's update with the next step's gradient).
        cost = 0.5 * lr * lr * (float(g @ (h * g)) + float(h.sum()) * noise * noise / m)
        gain = lr * float(g @ g)
        with torch.no_grad():
            x -= lr * x.grad
        meter.after_step([x], lr, var, m)
        pairs.append((cost, gain))
    num = den = 0.0
    for cost, gain in pairs[:-1]:  # the last step's update meets no later gradient
        num, den = beta * num + (1 - beta) * cost, beta * den + (1 - beta) * gain
    return meter.share, num / den, meter.pairs


def test_the_meter_reads_the_curvatures_share_of_a_noiseless_step_exactly() -> None:
    share, expected, pairs = _quadratic_run(0.0, 60, 0, 0.9)
    assert pairs == 59
    assert share == pytest.approx(expected, rel=1e-9)


def test_the_meter_removes_the_updates_own_noise_from_its_first_order_gain() -> None:
    # Without the w tr(Sigma) / M correction the gain would read lr |g|^2 with the
    # noise's square in it and the share would come out far lower.
    shares = []
    for seed in range(4):
        share, expected, _ = _quadratic_run(2.0, 3000, seed, 0.999)
        assert share is not None
        shares.append(share / expected)
    assert float(np.median(shares)) == pytest.approx(1.0, abs=0.15)


def test_the_meter_waits_for_its_minimum_and_refuses_a_memory_outside() -> None:
    meter = noise_floor.FloorMeter(min_steps=5)
    x = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    for _ in range(6):  # the first step pairs nothing: 5 pairs after 6 steps
        x.grad = torch.tensor([1.0, 2.0], dtype=torch.float64)
        meter.before_step([x])
        with torch.no_grad():
            x -= 0.1 * x.grad
        meter.after_step([x], 0.1, 0.0, 4.0)
        assert (meter.share is None) == (meter.pairs < 5)
    assert meter.pairs == 5 and meter.share is not None
    with pytest.raises(ValueError, match="beta must be in"):
        noise_floor.FloorMeter(beta=1.0)


def _estimates(est: GradientNoiseScale, steps: int = 4) -> None:
    for sqr_local, total in [(40.0, 15.0), (42.0, 15.5), (38.0, 14.5), (41.0, 15.2)][:steps]:
        est.update(sqr_local, total, 2, 8)


def test_the_credit_scale_reads_the_meters_share_at_its_batch() -> None:
    meter = noise_floor.FloorMeter()
    est = noise_floor.FloorCreditScale(init_batch_size=16, meter=meter)
    core = GradientNoiseScale(init_batch_size=16)
    _estimates(est)
    _estimates(core)
    assert est.grad_params() == core.grad_params()  # the meter is immature
    meter.pairs, meter.batch = 100, 64.0
    meter._gain_sum, meter._cost_sum = 1.0, 0.25
    base = core.grad_params()
    params = est.grad_params()
    assert base is not None and params is not None
    scale = base.var * 16 / base.sqr
    assert params.var * 16 / params.sqr == pytest.approx(
        noise_floor.credited_scale(scale, 64.0, 0.25)
    )
    meter._cost_sum = 0.6  # lambda 0.6: unbounded, yet not for a bound without noise
    params = est.grad_params()
    assert params is not None and params.var * 16 / params.sqr == pytest.approx(noise_floor._HUGE)


def test_check_config_refuses_adam() -> None:
    noise_floor.check_config({"optimizer": "sgd"})
    with pytest.raises(ValueError, match="the noise floor needs an SGD-type optimiser"):
        noise_floor.check_config({"optimizer": "adam"})
