"""`experiments.outcome.floor_credit`: the floor, its share, the two decisions' scales."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from experiments.outcome import floor_credit, time_to_target
from hypothesis import given, settings
from hypothesis import strategies as st

import torch
from adaptdl.core.gns import GradientNoiseScale


def _efficiency(scale: float, m0: float, batch: float) -> float:
    return (scale + m0) / (scale + batch)


@settings(max_examples=300, deadline=None)
@given(
    st.floats(0.0, 1e5),
    st.floats(1.0, 4096.0),
    st.floats(1.0, 64.0),
    st.floats(0.0, 0.999),
)
def test_the_shared_scale_is_pollux_at_the_floor_shares_time_to_target(
    scale: float, batch: float, m0: float, share: float
) -> None:
    # Time to the target at batch M goes as (1 - f + f E) / (throughput E): the
    # efficiency that multiplies throughput is E / (1 - f + f E), Pollux's at B'.
    e = _efficiency(scale, m0, batch)
    shared = floor_credit.shared_scale(scale, m0, share)
    assert shared >= scale
    expected = e / (1.0 - share + share * e)
    assert _efficiency(shared, m0, batch) == pytest.approx(expected, rel=1e-9)


def test_the_shared_scale_at_share_zero_is_the_scale_and_refuses_a_share_outside() -> None:
    assert floor_credit.shared_scale(100.0, 16.0, 0.0) == 100.0
    assert floor_credit.shared_scale(100.0, 16.0, 0.5) == pytest.approx(216.0)
    for bad in (-0.1, 1.0, math.nan):
        with pytest.raises(ValueError, match="share must be in"):
            floor_credit.shared_scale(100.0, 16.0, bad)


def test_the_floor_level_and_its_refusals() -> None:
    # lr / (1 - momentum) * tr(Sigma) / (4 M): 0.01 / 0.1 * 120 / 64.
    assert floor_credit.floor_level(0.01, 0.9, 120.0, 16.0) == pytest.approx(0.1875)
    assert floor_credit.floor_level(0.01, 0.0, 120.0, 256.0) == pytest.approx(0.01 * 120 / 1024)
    for args in [(-0.1, 0.9, 1.0, 16.0), (0.1, 1.0, 1.0, 16.0), (0.1, 0.9, -1.0, 16.0)]:
        with pytest.raises(ValueError, match="need lr >= 0"):
            floor_credit.floor_level(*args)


def test_the_floor_share_of_the_loss_left_to_the_target() -> None:
    share = floor_credit.floor_share
    # Loss 0.6 at E = 0.5 with floor0 0.2: drift 0.5; left to 0.35 at the initial
    # batch's noise: 0.5 - 0.35 + 0.2 = 0.35, of which the floor 0.2.
    assert share(0.2, 0.6, 0.5, 0.35) == pytest.approx(0.2 / 0.35)
    assert share(0.2, 0.6, 0.5, 0.35, cap=0.5) == 0.5
    # The floor all that is left (or more): the cap.
    assert share(0.2, 0.45, 1.0, 0.3) == 0.9
    # No floor, or a loss not finite: no share.
    assert share(0.0, 0.6, 1.0, 0.35) == 0.0
    assert share(0.2, math.nan, 1.0, 0.35) == 0.0
    with pytest.raises(ValueError, match="cap must be in"):
        share(0.2, 0.6, 1.0, 0.35, cap=1.0)


@settings(max_examples=200, deadline=None)
@given(st.floats(1.0, 1e4), st.floats(17.0, 4096.0), st.floats(0.0, 0.49))
def test_the_credited_scale_matches_the_credited_objectives_slope_at_the_batch(
    scale: float, batch: float, kappa: float
) -> None:
    m0 = 16.0
    e = _efficiency(scale, m0, batch)
    credited = floor_credit.credited_scale(scale, batch, m0, kappa)
    assert credited >= scale
    if 2.0 * kappa * e >= 1.0 - 1e-6:
        return

    # d log(E (1 - kappa E)) / d log M at the batch, against d log E' / d log M there.
    def objective(m: float) -> float:
        em = _efficiency(scale, m0, m)
        return math.log(em * (1.0 - kappa * em))

    h = 1e-6
    slope = (objective(batch * math.exp(h)) - objective(batch * math.exp(-h))) / (2 * h)
    pollux = -batch / (credited + batch)
    assert pollux == pytest.approx(slope, rel=1e-4, abs=1e-9)


def test_the_credited_scale_is_the_scale_without_credit_and_unbounded_past_half() -> None:
    assert floor_credit.credited_scale(100.0, 64.0, 16.0, 0.0) == 100.0
    assert floor_credit.credited_scale(100.0, 64.0, 16.0, math.nan) == 100.0
    # E(16) = 1: 2 kappa E >= 1 at kappa 0.5.
    assert floor_credit.credited_scale(100.0, 16.0, 16.0, 0.5) == floor_credit._HUGE
    with pytest.raises(ValueError, match="need scale >= 0"):
        floor_credit.credited_scale(100.0, 0.0, 16.0, 0.1)


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
    meter = floor_credit.FloorMeter(beta=beta, min_steps=1)
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
    meter = floor_credit.FloorMeter(min_steps=5)
    assert meter.share is None
    with pytest.raises(ValueError, match="beta must be in"):
        floor_credit.FloorMeter(beta=1.0)


def test_the_share_scale_answers_the_decision_at_the_shared_scale_and_keeps_the_gain() -> None:
    est = floor_credit.FloorShareScale(init_batch_size=16)
    core = GradientNoiseScale(init_batch_size=16)
    for sqr_local, total in [(40.0, 15.0), (42.0, 15.5), (38.0, 14.5), (41.0, 15.2)]:
        est.update(sqr_local, total, 2, 8)
        core.update(sqr_local, total, 2, 8)
    assert est.grad_params() == core.grad_params()
    est.share = 0.5
    params, base = est.grad_params(), core.grad_params()
    assert params is not None and base is not None
    assert params.sqr == base.sqr
    scale = base.var * 16 / base.sqr
    assert params.var * 16 / params.sqr == pytest.approx((scale + 8.0) / 0.5)
    bound = est.grad_params_bound(1.0)
    core_bound = core.grad_params_bound(1.0)
    assert bound is not None and core_bound is not None
    assert bound.var * 16 / bound.sqr == pytest.approx(
        floor_credit.shared_scale(core_bound.var * 16 / core_bound.sqr, 16.0, 0.5)
    )
    assert est.gain(4.0) == core.gain(4.0)


def test_check_config_refuses_adam() -> None:
    floor_credit.check_config({"optimizer": "sgd"})
    with pytest.raises(ValueError, match="floor_credit needs an SGD-type optimiser"):
        floor_credit.check_config({"optimizer": "adam"})


def _run(kind: str, seed: int, cpu: float | None, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"init_batch_size": 16}
    if kind == "adaptive":
        cfg["autoscale"] = True
    else:
        cfg.update(local_bsz=int(kind) // 2, accum_steps=0)
    cfg.update(extra)
    reached = None if cpu is None else {"cpu_seconds": cpu, "progress": 100.0, "samples": 10}
    whole = 80.0 if cpu is None else cpu + 1.0
    return {
        "config": cfg,
        "seed": seed,
        "replicas": 2,
        "reached": reached,
        "train_cpu_seconds": whole,
    }


def test_target_table_pairs_each_run_with_its_seeds_best_fixed_size() -> None:
    runs = [
        _run("256", 0, 10.0),
        _run("256", 1, 20.0),
        _run("16", 0, 30.0),
        _run("16", 1, 40.0),
        _run("adaptive", 0, 20.0),
        _run("adaptive", 1, None),
        _run("adaptive", 0, 5.0, floor_target_loss=0.35),
    ]
    text = floor_credit.target_table(runs).splitlines()
    assert text[0].startswith("| run | CPU s (median) | progress | samples | best fixed / run")
    # Seed 1 missed: counted at its whole run's 80 s. Best fixed: 256 (medians 15, 35).
    assert text[2] == "| fixed 256 | 15.0 | 100 | 10 |  |  |  |"
    assert text[4] == "| adaptive | 50.0 | 100 | 10 | fixed 256: 0: 0.50, 1: 0.25 | 0.30 |  |"
    # Core's adaptive run of seed 0 took 20 s: 4x the floor decision's 5.
    assert text[5] == (
        "| adaptive, floor share to loss 0.35 | 5.0 | 100 | 10 | fixed 256: 0: 2.00 | 2.00 "
        "| 0: 4.00 |"
    )
    with pytest.raises(ValueError, match="two 'fixed 256' runs of seed 0"):
        floor_credit.target_table([*runs, _run("256", 0, 1.0)])
    # Pooled, the repeat averages in: fixed 256's seed 0 at (10 + 2) / 2.
    pooled = floor_credit.target_table(floor_credit.pool_repeats([*runs, _run("256", 0, 2.0)]))
    assert pooled.splitlines()[2] == "| fixed 256 | 13.0 | 100 | 10 |  |  |  |"


def test_pool_repeats_averages_each_kind_and_seed_and_keeps_a_miss() -> None:
    runs = [_run("adaptive", 0, 10.0), _run("adaptive", 0, 20.0), _run("adaptive", 1, None)]
    runs.append(_run("adaptive", 1, 40.0))
    pooled = {r["seed"]: r for r in floor_credit.pool_repeats(runs)}
    assert pooled[0]["reached"] == {"cpu_seconds": 15.0, "progress": 100.0, "samples": 10.0}
    # A repeat that missed counts at its whole run (80 s) and leaves the mean unreached.
    assert pooled[1]["reached"] is None and pooled[1]["train_cpu_seconds"] == 60.0
    with pytest.raises(ValueError, match="no fixed-size runs"):
        floor_credit.target_table(runs[4:])


def _fixed_run(size: int, seed: int, loss: float, var: float, level: float = 0.0) -> Any:
    cfg = {
        "init_batch_size": 16,
        "local_bsz": size // 2,
        "accum_steps": 0,
        "progress_epochs": 1,
        "train_size": 1600,  # cap: 100 progress
        "lr": 0.01,
        "momentum": 0.9,
        "noise_match": level or None,
    }
    gain = 2.0
    steps = [[p, size, size // 2, 0, gain, gain, loss, 0.0, 0.0] for p in range(0, 101, 2)]
    noise = [[p, 0.0, 1.0, var, 0.0] for p in range(0, 101, 2)]
    return {"config": cfg, "seed": seed, "replicas": 2, "steps": steps, "noise": noise}


def test_floor_gap_table_sets_each_measured_gap_beside_the_floors_prediction() -> None:
    runs = [
        _fixed_run(16, 0, 0.5, 100.0),
        _fixed_run(256, 0, 0.4, 100.0),
        _fixed_run(256, 0, 0.5, 100.0, level=1.0),
    ]
    text = floor_credit.floor_gap_table(runs, [50.0]).splitlines()
    # At progress 50 (half the cap): base lr 0.005; at 16 with gain 2 (the steps'
    # lr factor) the floor is 0.01 / 0.1 * 100 / 64; at 256 with gain 2, / 1024.
    at16 = floor_credit.floor_level(0.01, 0.9, 100.0, 16.0)
    at256 = floor_credit.floor_level(0.01, 0.9, 100.0, 256.0)
    assert text[2] == f"| fixed 256 | -0.100 / {at256 - at16:+.3f} |"
    # Noise matched at level 1: 16 * gain / level = 32 samples' noise.
    at32 = floor_credit.floor_level(0.01, 0.9, 100.0, 32.0)
    assert text[3] == f"| fixed 256, noise level 1 | +0.000 / {at32 - at16:+.3f} |"
    with pytest.raises(ValueError, match="needs the fixed 16 runs"):
        floor_credit.floor_gap_table(runs[1:], [50.0])


def test_the_floor_options_reach_the_runs_and_are_refused_where_undefined(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    args = argparse.Namespace(
        lr=None,
        progress_epochs=None,
        preconditioned=False,
        smoothing=None,
        signal_memory=None,
        signal_decision_only=False,
        noise_match=None,
        floor_credit=True,
        floor_target_loss=0.35,
    )
    assert time_to_target.run_overrides(args) == {"floor_credit": True, "floor_target_loss": 0.35}
    cases = [
        (["--floor-credit", "--kinds", "adaptive,fixed"], "select adaptive runs to make"),
        (["--floor-target-loss", "0", "--kinds", "fixed"], "select adaptive runs to make"),
        (["--floor-credit", "--floor-target-loss", "0.3", "--kinds", "adaptive"], "one decision"),
        (
            ["--floor-target-loss", "0.3", "--kinds", "adaptive", "--problems", "dyck"],
            "not ['dyck']",
        ),
        (["--floor-credit", "--kinds", "adaptive", "--from-log", str(tmp_path)], "no --from-log"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit):
            time_to_target.main([*argv, "--out", str(tmp_path)])
        assert message in capsys.readouterr().err
