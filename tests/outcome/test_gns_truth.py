"""The exact statistics of `experiments.gns_truth`, against numpy on least squares."""

from __future__ import annotations

import numpy as np
import pytest
from experiments.gns_truth import study as gns_truth

import torch


def test_exact_statistics_match_least_squares_in_closed_form() -> None:
    # Loss 1/2 (x . w - y)^2: per-sample gradient x (x . w - y), Hessian mean x x^T.
    gen = np.random.default_rng(3)
    n, d, b = 96, 5, 4
    x = gen.standard_normal((n, d))
    y = gen.standard_normal(n)
    w0 = gen.standard_normal(d)
    w = torch.tensor(w0, requires_grad=True)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)

    def loss_fn(idx: torch.Tensor) -> torch.Tensor:
        return 0.5 * ((xt[idx] @ w - yt[idx]) ** 2).mean()

    probe = torch.tensor([5, 17, 2, 40, 41, 90, 33, 8, 64, 11, 70, 3])
    hessian = torch.tensor([1, 4, 9, 16, 25, 36, 49, 64, 81])
    got = gns_truth.exact_statistics(loss_fn, [w], n, b, probe, hessian, curvature_draws=2)

    per_sample = x * (x @ w0 - y)[:, None]
    full = per_sample.mean(0)
    h = x[hessian.numpy()].T @ x[hessian.numpy()] / len(hessian)
    devs = [per_sample[probe.numpy()[i : i + b]].mean(0) - full for i in range(0, len(probe), b)]
    assert got["sqr"] == pytest.approx(full @ full, rel=1e-9)
    assert got["var"] == pytest.approx(b * np.mean([v @ v for v in devs]), rel=1e-9)
    assert got["gHg"] == pytest.approx(full @ h @ full, rel=1e-9)
    assert got["trHS"] == pytest.approx(b * np.mean([v @ h @ v for v in devs[:2]]), rel=1e-9)
    # Without a Hessian sample, the first two alone.
    plain = gns_truth.exact_statistics(loss_fn, [w], n, b, probe, None, curvature_draws=0)
    assert plain == pytest.approx({"sqr": got["sqr"], "var": got["var"]}, rel=1e-12)


def test_summary_takes_ratios_of_means_per_phase() -> None:
    def point(samples: int, sqr: float, var: float, est: tuple[float, float]) -> dict:
        return {
            "samples": samples,
            "sqr": sqr,
            "var": var,
            "gHg": sqr,
            "trHS": var / 2,
            "estimates": [list(est)],
        }

    runs = [
        {
            "config": {"smoothings": [0.999]},
            "checkpoints": [
                point(0, 9.0, 9.0, (0.0, 0.0)),  # before training: left out
                point(10, 1.0, 10.0, (2.0, 10.0)),
                point(20, 3.0, 50.0, (2.0, 30.0)),
            ],
        }
    ]
    rows = gns_truth.summarise(runs, phases=1)
    assert len(rows) == 1
    row = rows[0]
    assert row["samples"] == (10, 20) and row["points"] == 2
    assert row["simple"] == pytest.approx(60.0 / 4.0)  # not the mean of 10 and 16.7
    assert row["curvature"] == pytest.approx(30.0 / 4.0)
    assert row["est 0.999"] == pytest.approx((2.0, 20.0, 10.0))
    assert "fresh" not in row  # not recorded
    assert "| 10-20 | 2 |" in gns_truth.table(rows)
    for c in runs[0]["checkpoints"]:
        c["fresh_sqr"], c["fresh_var"] = 2.0 * c["sqr"], c["var"]
    fresh = gns_truth.summarise(runs, phases=1)[0]["fresh"]
    assert fresh == pytest.approx((4.0, 30.0, 60.0 / 8.0))
    assert "exact on a fresh draw" in gns_truth.table(gns_truth.summarise(runs, phases=1))


@pytest.mark.timeout(300)
def test_a_short_run_records_what_replay_reproduces() -> None:
    # A few steps of the real CNN: the recorded estimates are what replaying the
    # recorded steps through a fresh estimator gives, at either smoothing.
    cfg = {"train_size": 512, "samples": 96, "every": 32, "probe": 32, "hessian": 16}
    cfg["curvature_draws"] = 2
    cfg["window"] = (32, 2)  # the exact |G|^2 at the steps from samples 32 and 48
    result = gns_truth.run(0, cfg)
    window = result["window"]
    assert [s for s, _ in window] == [32, 48]
    # At sample 32 the window's value and the checkpoint's are at the same parameters.
    assert window[0][1] == pytest.approx(result["checkpoints"][1]["sqr"], rel=1e-9)
    summary = gns_truth.window_summary(result)
    assert summary is not None and summary["steps"] == 2
    per_step = [(2 * t - lo / 2) for s, lo, t in result["steps"] if s in (32, 48)]
    assert summary["estimate_mean"] == pytest.approx(np.mean(per_step))
    diffs = [e - x for e, (_, x) in zip(per_step, window, strict=True)]
    assert summary["difference_mean"] == pytest.approx(np.mean(diffs))
    assert [c["samples"] for c in result["checkpoints"]] == [0, 32, 64, 96]
    assert len(result["steps"]) == 96 // 16
    for c in result["checkpoints"]:
        assert c["var"] > 0.0 and c["fresh_var"] > 0.0 and c["sqr"] >= 0.0
    again = gns_truth.replay(result, result["config"]["smoothings"])
    for mine, theirs in zip(again["checkpoints"], result["checkpoints"], strict=True):
        assert mine["estimates"] == theirs["estimates"]
    # The window's exact gradients leave the training as it was.
    plain = gns_truth.run(0, {**cfg, "window": None})
    assert plain["steps"] == result["steps"] and plain["window"] == []
    with pytest.raises(ValueError, match="multiple of 16"):
        gns_truth.run(0, {**cfg, "window": (40, 2)})
    with pytest.raises(ValueError, match="end by samples=96"):
        gns_truth.run(0, {**cfg, "window": (64, 4)})
    with pytest.raises(ValueError, match="no per-step record"):
        gns_truth.replay({**result, "steps": []}, [0.9])
    other = gns_truth.replay(result, [0.9])
    assert other["config"]["smoothings"] == [0.9]
    assert other["checkpoints"][-1]["estimates"][0] != result["checkpoints"][-1]["estimates"][0]


def test_bad_probes_and_mixed_smoothings_are_refused() -> None:
    w = torch.zeros(2, requires_grad=True)

    def loss_fn(idx: torch.Tensor) -> torch.Tensor:
        return (w * idx.double().mean()).sum()

    with pytest.raises(ValueError, match="not a multiple of 4"):
        gns_truth.exact_statistics(loss_fn, [w], 16, 4, torch.arange(10), None, 0)
    with pytest.raises(ValueError, match="curvature_draws must be >= 1"):
        gns_truth.exact_statistics(loss_fn, [w], 16, 4, torch.arange(8), torch.arange(4), 0)
    run = {"config": {"smoothings": [0.999]}, "checkpoints": []}
    with pytest.raises(ValueError, match="different smoothings"):
        gns_truth.summarise([run, {**run, "config": {"smoothings": [0.99]}}])


def test_estimates_against_exact_carry_bootstrap_intervals() -> None:
    # The estimator reads |G|^2 at exactly twice the truth at every point, tr(Sigma)
    # right: the noise scale is half, whatever the resample.
    gen = np.random.default_rng(1)
    points = [
        {"sqr": s, "var": v, "estimates": [[2.0 * s, v]]}
        for s, v in zip(gen.uniform(0.1, 5.0, 12), gen.uniform(50, 150, 12), strict=True)
    ]
    resamples = np.random.default_rng(0).integers(0, 12, (200, 12))
    got = gns_truth._against_exact(points, 0, resamples)
    assert got["noise_scale"] == pytest.approx((0.5, 0.5, 0.5))
    assert got["sqr"] == pytest.approx((2.0, 2.0, 2.0))
    # Noisy readings: the interval is the percentiles of the resampled ratios.
    for p in points:
        p["estimates"] = [[p["sqr"] * gen.uniform(0.5, 2.0), p["var"] * gen.uniform(0.8, 1.2)]]
    got = gns_truth._against_exact(points, 0, resamples)
    est = np.array([p["estimates"][0] for p in points])
    exact = np.array([[p["sqr"], p["var"]] for p in points])
    sqr_ratios = [est[i, 0].sum() / exact[i, 0].sum() for i in resamples]
    scale_ratios = [
        (est[i, 1].sum() / est[i, 0].sum()) / (exact[i, 1].sum() / exact[i, 0].sum())
        for i in resamples
    ]
    assert got["sqr"][1:] == pytest.approx(tuple(np.percentile(sqr_ratios, [2.5, 97.5])))
    assert got["noise_scale"][1:] == pytest.approx(tuple(np.percentile(scale_ratios, [2.5, 97.5])))
    assert got["sqr"][0] == pytest.approx(est[:, 0].sum() / exact[:, 0].sum())


def test_time_average_reads_the_per_step_estimates_around_a_checkpoint() -> None:
    # Steps (samples, sum of micro-batch norms, norm of the mean) whose estimate
    # 2 * total - local / 2 is the step's index; the average spans +-4096 samples.
    steps = [(16 * k, 0.0, k / 2.0) for k in range(1024)]
    result = {"config": {"micro_batches": 2, "micro_batch": 8}, "steps": steps}
    per_step = gns_truth.step_sqr(result)
    assert per_step[:, 1] == pytest.approx(np.arange(1024.0))
    got = gns_truth._time_average(per_step, 8192)
    near = [k for k in range(1024) if abs(16 * k - 8192) < 4096]
    assert got == pytest.approx(np.mean(near))
    empty = gns_truth.step_sqr({**result, "steps": []})
    assert empty.shape == (0, 2) and gns_truth._time_average(empty, 8192) is None
