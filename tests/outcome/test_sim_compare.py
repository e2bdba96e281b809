"""Simulated against real (item 4b): the profiled application model and the comparison."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from experiments.sim_compare import measured_profile as mp
from experiments.sim_compare import study as sim_compare
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptdl.core.goodput import PerfParams, compute_time, optim_step_time
from adaptdl.core.stats.scaling import adascale_gain
from adaptdl.sim.profiled import ProfiledApplication, simulate_to_progress
from adaptdl.sim.replay import even_placement

PERF = PerfParams(0.01, 0.0005, 0.02, 0.001, 0.005, 0.001, 1.5)
SIZES = {"init_batch_size": 16, "max_batch_size": 1024, "local_bsz_bounds": (8, 128)}


def app_of(progress: list[float], sqr: list[float], var: list[float], target: float = 4000.0):
    return ProfiledApplication(
        "t", PERF, progress, sqr, var, **SIZES, dataset_size=4096, target_progress=target
    )


def fake_run(
    split: tuple[int, int] | None, ratio: float, to: float, **extra: Any
) -> dict[str, Any]:
    """A result as the trainer writes it, of a run on 2 replicas with constant noise
    ``ratio`` (var / |G|^2) and step times exactly PERF's, stopped at progress ``to``.
    An adaptive run (``split`` None) steps at 16, then 64, then 256."""
    cfg: dict[str, Any] = {
        "problem": "fake",
        "seed": 0,
        "train_size": 4096,
        "init_batch_size": 16,
        "rule": "adascale",
    }
    if split is None:
        cfg.update(autoscale=True, max_batch_size=1024, local_bsz_bounds=[8, 128])
        label = "adaptive"
    else:
        cfg.update(local_bsz=split[0], accum_steps=split[1])
        label = f"fixed {2 * split[0] * (split[1] + 1)}"
    app = app_of([0.0], [1.0], [ratio])
    steps, progress, seconds, noise = [], 0.0, 0.0, []
    while progress < to:
        local, accum = split or (
            (8, 0) if progress < 50 else (32, 0) if progress < 200 else (128, 0)
        )
        total = 2 * local * (accum + 1)
        gain = adascale_gain(1.0, ratio, total / 16) if steps else 1.0
        progress += gain
        seconds += app.iteration_time((2,), local, accum)[0]
        steps.append([progress, total, local, accum, gain, gain, 0.0, 0.0, seconds])
        noise.append([progress, 0, 1.0, ratio * 16, 0])  # one sample's variance
    reached = {"progress": progress, "seconds": seconds, "cpu_seconds": seconds / 2}
    evals = [[progress, 0, seconds, 1.0, 0.9, seconds / 2]]
    result = {
        "config": cfg,
        "replicas": 2,
        "steps": steps,
        "evals": evals,
        "progress": progress,
        "train_seconds": seconds,
        "train_cpu_seconds": seconds / 2,
        "reached": reached,
        "noise": noise,
        "label": label,
        "seed": 0,
        "problem": "fake",
    }
    result.update(extra)
    return result


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 512),
    st.integers(0, 7),
    st.floats(0.001, 0.1),
    st.floats(1e-5, 1e-2),
)
def test_profiled_step_times_are_cores_model_exactly(
    replicas: int, local: int, accum: int, alpha_c: float, beta_c: float
) -> None:
    perf = PerfParams(alpha_c, beta_c, 0.02, 0.001, 0.005, 0.001, 1.5)
    app = ProfiledApplication(
        "t", perf, [0.0], [1.0], [1.0], **SIZES, dataset_size=4096, target_progress=10.0
    )
    compute = compute_time(perf, local)
    optim = compute if replicas == 1 else optim_step_time(perf, 1, replicas, local)
    step, sync = app.step_time((replicas,), local)
    assert step == pytest.approx(optim, rel=1e-12)
    assert sync == pytest.approx(optim - compute, rel=1e-9, abs=1e-15)
    total = app.iteration_time((replicas,), local, accum)[0]
    assert total == pytest.approx(accum * compute + optim, rel=1e-9)


@settings(max_examples=40, deadline=None)
@given(st.floats(0.0, 1e4), st.floats(1.01, 256.0))
def test_ratio_from_gain_inverts_the_adascale_gain(ratio: float, scale: float) -> None:
    gain = adascale_gain(1.0, ratio, scale)
    recovered = mp.ratio_from_gain(gain, scale)
    if gain < scale:
        assert adascale_gain(1.0, recovered, scale) == pytest.approx(gain, rel=1e-9)
    assert mp.ratio_from_gain(scale, scale) == math.inf
    assert mp.ratio_from_gain(1.0, scale) == 0.0


def test_ratio_from_gain_needs_a_scale_above_one() -> None:
    with pytest.raises(ValueError, match="scale must be > 1"):
        mp.ratio_from_gain(1.0, 1.0)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(0.0, 500.0), min_size=1, max_size=8), st.sampled_from([64, 256, 1024]))
def test_model_from_recorded_gains_reproduces_them(ratios: list[float], total: int) -> None:
    """Noise read off the gains of a run gives back each step's gain at its scale."""
    steps, progress = [], 0.0
    for ratio in ratios:
        gain = adascale_gain(1.0, ratio, total / 16)
        progress += gain
        steps.append([progress, total, total // 2, 0, gain, gain, 0.0, 0.0, 0.0])
    run = {"config": {"init_batch_size": 16}, "steps": steps}
    curve = mp.noise_curve(run)
    assert curve is not None and curve.source == "gains"
    app = app_of(list(curve.progress), list(curve.sqr), list(curve.var), progress + 1)
    for step in steps:
        assert app.gain(total, app.epoch_at(step[0])) == pytest.approx(step[4], rel=1e-9)


def test_model_from_estimator_rows_reproduces_the_recorded_gains() -> None:
    """The trainer's noise rows and its steps' gains come from one estimator: the model
    made of the rows gives back each recorded gain (the variance convention holds)."""
    run = fake_run(None, 7.0, 400.0)
    curve = mp.noise_curve(run)
    assert curve is not None and curve.source == "estimator"
    app = app_of(list(curve.progress), list(curve.sqr), list(curve.var), 500.0)
    for progress, total, *_ in run["steps"][1:]:
        gain = app.gain(total, app.epoch_at(progress))
        assert gain == pytest.approx(adascale_gain(1.0, 7.0, total / 16), rel=1e-9)


def test_model_from_estimator_rows_holds_each_point_around_it() -> None:
    # The estimator's variance is one sample's: the model's is at the initial batch size.
    rows = [[10.0, 0, 2.0, 80.0, 0], [30.0, 0, 1.0, 144.0, 0], [30.0, 0, 1.0, 128.0, 0]]
    run = {"config": {"init_batch_size": 16}, "noise": rows}
    curve = mp.noise_curve(run)
    assert curve is not None and curve.source == "estimator"
    app = app_of(list(curve.progress), list(curve.sqr), list(curve.var), 100.0)
    assert app.grad_stats_at(0.0) == (2.0, 5.0) and app.grad_stats_at(19.0) == (2.0, 5.0)
    assert app.grad_stats_at(21.0) == (1.0, 8.0) and app.grad_stats_at(99.0) == (1.0, 8.0)
    assert list(app.epoch_progress) == [20.0, 100.0]


def test_step_time_fit_reproduces_the_measured_step_times() -> None:
    app = app_of([0.0], [1.0], [1.0])
    configs = [(8, 0), (32, 0), (128, 0), (128, 3)]
    times = {c: [app.iteration_time((2,), *c)[0]] * 5 for c in configs}
    perf = mp.fit_step_times(times, replicas=2)
    fitted = ProfiledApplication(
        "fit", perf, [0.0], [1.0], [1.0], **SIZES, dataset_size=4096, target_progress=10.0
    )
    for config in configs:
        measured = times[config][0]
        assert fitted.iteration_time((2,), *config)[0] == pytest.approx(measured, rel=0.05)


@settings(max_examples=15, deadline=None)
@given(st.integers(8, 128), st.integers(0, 3), st.floats(0.5, 300.0), st.floats(0.0, 100.0))
def test_fixed_time_to_progress_is_the_analytic_sum(
    local: int, accum: int, target: float, ratio: float
) -> None:
    app = app_of([0.0], [1.0], [ratio])
    run = simulate_to_progress(app, target, replicas=2, split=(local, accum))
    total = 2 * local * (accum + 1)
    gain = adascale_gain(1.0, ratio, total / 16)
    # The first step has no noise estimate yet: it counts 1; every later one its gain.
    steps = 1 + max(math.ceil((target - 1.0) / gain - 1e-9), 0)
    assert run.steps == steps
    seconds = steps * app.iteration_time((2,), local, accum)[0]
    assert run.seconds == pytest.approx(seconds, rel=1e-9)
    assert run.progress >= target and {t[2] for t in run.trajectory} == {total}


def test_adaptive_simulation_grows_the_batch_on_a_noisy_profile() -> None:
    quiet = simulate_to_progress(app_of([0.0], [1.0], [0.0]), 300.0, replicas=2)
    noisy = simulate_to_progress(app_of([0.0], [1.0], [200.0]), 300.0, replicas=2)
    assert max(t[2] for t in quiet.trajectory) <= 32  # no noise: no gain from a larger batch
    assert max(t[2] for t in noisy.trajectory) >= 128
    assert noisy.steps < quiet.steps


def test_profiled_application_rejects_bad_curves() -> None:
    with pytest.raises(ValueError, match="progress must be strictly increasing"):
        app_of([0.0, 0.0], [1.0, 1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="same length"):
        app_of([0.0, 1.0], [1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="var must hold finite numbers"):
        app_of([0.0], [1.0], [-1.0])
    with pytest.raises(ValueError, match="target_progress"):
        app_of([0.0], [1.0], [1.0], target=0.0)


def test_compare_needs_the_adaptive_run() -> None:
    with pytest.raises(ValueError, match="must include the adaptive run"):
        sim_compare.compare_group([fake_run((8, 0), 3.0, 20.0)])


def test_end_to_end_on_a_tiny_synthetic_profile(tmp_path: Path) -> None:
    runs = [fake_run(None, 20.0, 300.0)]
    runs += [fake_run(split, 20.0, 300.0) for split in [(8, 0), (32, 0), (128, 0)]]
    log = tmp_path / "runs" / "time_to_target.jsonl"
    log.parent.mkdir()
    log.write_text("".join(json.dumps(r) + "\n" for r in runs))
    out = sim_compare.main([str(tmp_path / "runs"), "--out", str(tmp_path / "cmp")])
    group = out["fake"][0]
    assert group["model"] == {
        "profile_run": "adaptive",
        "perf_source": "steps",
        "perf_params": group["model"]["perf_params"],
        "noise_source": "adaptive",
        "noise_recorded_as": ["estimator"],
        "noise_points": len(runs[0]["noise"]),
    }
    # The fake runs' step times are PERF's exactly: the refit model reproduces them...
    for checks in group["profile_check"].values():
        for ratio in checks.values():
            assert ratio == pytest.approx(1.0, rel=0.05)
    rows = {row["label"]: row for row in group["rows"]}
    # ... so the simulated fixed runs take the real runs' time, to the same progress.
    for label in ("fixed 16", "fixed 64", "fixed 256"):
        assert rows[label]["sim_own"] == pytest.approx(rows[label]["real_wall"], rel=0.06)
    assert rows["adaptive"]["sim_batches"][-1] > 16
    real, sim = group["ratios"]["real_wall"], group["ratios"]["sim_own"]
    assert real["best_fixed"] == sim["best_fixed"]
    assert sim["initial"] > 1.0
    saved = json.loads((tmp_path / "cmp" / "sim_compare.json").read_text())
    assert saved["fake"]["0"]["rows"][0]["label"] == "adaptive"
    assert "| fake: run |" in (tmp_path / "cmp" / "sim_compare.md").read_text()


def test_cpu_step_times_scale_each_step_by_its_stretchs_cpu_share() -> None:
    run = fake_run((8, 0), 3.0, 40.0)
    half = run["evals"][0][2] / 2
    # CPU ran at 1/4 of wall time in the first half of training, 3/4 in the second.
    run["evals"] = [[0, 0, half, 1.0, 0.5, half / 4], [0, 0, 2 * half, 1.0, 0.5, half]]
    wall = mp.step_times(run)[(8, 0)]
    cpu = mp.cpu_step_times(run)[(8, 0)]
    shares = [c / w for c, w in zip(cpu, wall, strict=True)]
    assert set(np.round(shares, 12)) == {0.25, 0.75}
    assert shares == sorted(shares)


def test_cpu_profile_puts_the_simulation_in_cpu_seconds(tmp_path: Path) -> None:
    runs = [fake_run(None, 20.0, 120.0)] + [fake_run(s, 20.0, 120.0) for s in [(8, 0), (32, 0)]]
    group = sim_compare.compare_group(runs, sim_compare.Options(perf="cpu"))
    assert group["model"]["perf_source"] == "cpu"
    rows = {row["label"]: row for row in group["rows"]}
    # The fake runs spend half of every wall second on the CPU.
    for label in ("fixed 16", "fixed 64"):
        assert rows[label]["sim_own"] == pytest.approx(rows[label]["real_cpu"], rel=0.06)


def test_statistics_per_batch_size_interpolate_linearly_in_batch_size() -> None:
    app = ProfiledApplication(
        "t",
        PERF,
        [0.0, 10.0],
        [[1.0, 2.0], [3.0, 4.0]],
        [[10.0, 20.0], [50.0, 60.0]],
        **SIZES,
        dataset_size=4096,
        target_progress=20.0,
        batch_sizes=[16, 256],
    )
    assert app.grad_stats_at(0.0, 16) == (1.0, 10.0)
    assert app.grad_stats_at(12.0, 256) == (4.0, 60.0)
    # The trace model's rule: linear in the batch size (64 is 1/5 of the way).
    assert app.grad_stats_at(0.0, 64) == pytest.approx((1.4, 18.0))
    assert app.grad_stats_at(12.0, 8) == (2.0, 20.0)  # the nearest row outside
    assert app.grad_stats_at(12.0, 1024) == (4.0, 60.0)
    with pytest.raises(ValueError, match="batch_sizes must be increasing"):
        ProfiledApplication(
            "t",
            PERF,
            [0.0],
            [1.0, 1.0],
            [1.0, 1.0],
            **SIZES,
            dataset_size=4096,
            target_progress=1.0,
            batch_sizes=[64, 16],
        )


def test_sweep_statistics_give_each_fixed_run_its_own_noise() -> None:
    """With each fixed run's own statistics, its simulation takes its real steps."""
    runs = [fake_run(None, 5.0, 300.0), fake_run((32, 0), 5.0, 300.0)]
    runs.append(fake_run((128, 0), 60.0, 300.0))
    adaptive = sim_compare.compare_group(runs, sim_compare.Options(noise="adaptive"))
    sweep = sim_compare.compare_group(runs, sim_compare.Options(noise="sweep"))
    assert sweep["model"]["noise_source"] == "sweep 64, 256"
    for group in (adaptive, sweep):
        rows = {row["label"]: row for row in group["rows"]}
        assert abs(rows["fixed 64"]["sim_steps"] - rows["fixed 64"]["real_steps"]) <= 1
    rows = {row["label"]: row for row in sweep["rows"]}
    assert abs(rows["fixed 256"]["sim_steps"] - rows["fixed 256"]["real_steps"]) <= 1
    # The adaptive run's statistics (less noise) under-predict fixed 256's progress.
    slow = {row["label"]: row for row in adaptive["rows"]}["fixed 256"]
    assert slow["sim_steps"] > 1.5 * slow["real_steps"]
    with pytest.raises(ValueError, match="needs 2 fixed runs"):
        sim_compare.compare_group(runs[:2], sim_compare.Options(noise="sweep"))


def test_compare_refuses_two_measurements_of_one_run() -> None:
    runs = [fake_run(None, 5.0, 50.0), fake_run((8, 0), 5.0, 50.0), fake_run((8, 0), 5.0, 60.0)]
    with pytest.raises(ValueError, match=r"fake seed 0 \['fixed 16'\] more than once"):
        sim_compare.compare(runs)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(0.0, 100.0), min_size=1, max_size=6, unique=True).map(sorted),
    st.floats(0.1, 120.0),
)
def test_an_epoch_is_kept_exactly_when_its_point_is_reached(
    points: list[float], target: float
) -> None:
    """Point i holds from the midpoint with point i - 1: it is an epoch of the model
    exactly when that midpoint lies before the target (the point nearest the target
    is kept, whichever side of it)."""
    app = app_of(points, [1.0] * len(points), [1.0] * len(points), target)
    reached = [i == 0 or (points[i - 1] + points[i]) / 2 < target for i in range(len(points))]
    assert app.num_epochs == sum(reached)
    assert app.target_progress == target
    assert np.all(np.diff(app.epoch_progress) > 0)


def test_the_point_past_the_target_but_nearest_it_is_kept() -> None:
    app = app_of([0.0, 1.0, 2.0], [1.0, 2.0, 3.0], [1.0, 1.0, 1.0], target=1.8)
    assert list(app.epoch_progress) == [0.5, 1.5, 1.8]
    assert app.grad_stats_at(1.7) == (3.0, 1.0)


@pytest.mark.parametrize(
    ("replicas", "nodes", "placement"), [(4, 3, (2, 1, 1)), (5, 4, (2, 1, 1, 1)), (4, 1, (4,))]
)
def test_simulated_jobs_spread_replicas_over_every_node(
    replicas: int, nodes: int, placement: tuple[int, ...]
) -> None:
    assert even_placement(replicas, nodes) == placement
    app = app_of([0.0], [1.0], [1.0])
    run = simulate_to_progress(app, 3.0, replicas=replicas, nodes=nodes, split=(8, 0))
    assert run.seconds == pytest.approx(run.steps * app.step_time(placement, 8)[0], rel=1e-9)


@settings(max_examples=6, deadline=None)
@given(
    st.lists(st.floats(1.0, 150.0), min_size=2, max_size=3).map(sorted),
    st.sampled_from([None, (16, 1)]),
)
def test_one_run_to_several_targets_times_each_as_its_own_run(
    targets: list[float], split: tuple[int, int] | None
) -> None:
    app = app_of([0.0, 40.0], [1.0, 1.0], [5.0, 40.0], target=200.0)
    both = simulate_to_progress(app, targets, replicas=2, split=split)
    for i, target in enumerate(targets):
        alone = simulate_to_progress(app, target, replicas=2, split=split)
        assert both.seconds_at[i] == alone.seconds and both.steps_at[i] == alone.steps
        assert both.trajectory_until(target) == alone.trajectory


def test_simulate_to_progress_rejects_unsorted_targets() -> None:
    app = app_of([0.0], [1.0], [1.0])
    with pytest.raises(ValueError, match="target_progress must be sorted"):
        simulate_to_progress(app, [5.0, 2.0], replicas=2)
    with pytest.raises(ValueError, match=r"target_progress\[1\]"):
        simulate_to_progress(app, [5.0, 0.0], replicas=2)
    with pytest.raises(ValueError, match="at least one target"):
        simulate_to_progress(app, [], replicas=2)


def test_sweep_refuses_statistics_implied_by_gains() -> None:
    """Gains give only the ratio var / |G|^2 (|G|^2 taken as 1): rows of them beside
    the estimator's absolute statistics would mix two normalisations."""
    runs = [fake_run(None, 5.0, 100.0), fake_run((32, 0), 5.0, 100.0)]
    runs.append(fake_run((128, 0), 60.0, 100.0))
    del runs[2]["noise"]
    with (
        pytest.warns(mp.ProfileFallbackWarning),
        pytest.raises(ValueError, match=r"total batch sizes \[256\] have only gains"),
    ):
        sim_compare.compare_group(runs, sim_compare.Options(noise="sweep"))


def test_cpu_profile_refuses_runs_of_different_replica_counts() -> None:
    runs = [fake_run(None, 20.0, 60.0), fake_run((8, 0), 20.0, 60.0, replicas=4)]
    with pytest.raises(ValueError, match=r"one replica count; got replicas \[2, 4\]"):
        sim_compare.compare_group(runs, sim_compare.Options(perf="cpu"))


def test_profile_fallbacks_warn_naming_what_they_used() -> None:
    run = fake_run((32, 0), 5.0, 30.0)
    with pytest.warns(mp.ProfileFallbackWarning, match="'fixed 64' has no 'decisions'"):
        assert mp.profiler_params(run) is None
    run["decisions"] = [{"perf": PERF.to_dict()}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mp.profiler_params(run) == PERF
        assert mp.noise_curve(run) is not None
    del run["noise"]
    with pytest.warns(mp.ProfileFallbackWarning, match="no 'noise' rows.*recorded AdaScale gains"):
        curve = mp.noise_curve(run)
    assert curve is not None and curve.source == "gains"
