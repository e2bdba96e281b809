"""`experiments.noise_match`: the added noise's weight, the mix, the wiring."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
from experiments.noise_match import study as noise_match
from experiments.time_to_target import study as time_to_target
from hypothesis import given, settings
from hypothesis import strategies as st

import torch


@settings(max_examples=300, deadline=None)
@given(st.floats(1.0, 4096.0), st.floats(0.0, 1.0), st.floats(1e-3, 1.0))
def test_the_weight_gives_the_covariance_of_gain_times_the_small_batch(
    scale: float, where: float, level: float
) -> None:
    gain = 1.0 + where * (scale - 1.0)
    k = noise_match.extra_noise_weight(scale, gain, level)
    assert 0.0 <= k <= 1.0
    # ((1 - k^2) / M + k^2 / m) Sigma with M = scale * m, in units of Sigma / m: the
    # level asked for, or the batch's own where that is already below it.
    if scale > 1.0:
        expected = max(level / gain, 1.0 / scale)
        assert (1.0 - k * k) / scale + k * k == pytest.approx(expected, rel=1e-9)


def test_the_weight_at_the_ends_of_the_gain_range() -> None:
    assert noise_match.extra_noise_weight(16.0, 1.0) == pytest.approx(1.0)
    assert noise_match.extra_noise_weight(16.0, 16.0) == 0.0
    # Outside [1, scale] the gain is clipped to it.
    assert noise_match.extra_noise_weight(16.0, 0.5) == pytest.approx(1.0)
    assert noise_match.extra_noise_weight(16.0, 40.0) == 0.0
    assert noise_match.extra_noise_weight(1.0, 1.0) == 0.0


@pytest.mark.parametrize(
    ("scale", "gain", "level"),
    [
        (0.5, 1.0, 1.0),
        (math.inf, 2.0, 1.0),
        (4.0, math.nan, 1.0),
        (4.0, 2.0, 0.0),
        (4.0, 2.0, 1.5),
    ],
)
def test_the_weight_refuses_a_scale_below_one_a_gain_not_finite_or_a_level_outside(
    scale: float, gain: float, level: float
) -> None:
    with pytest.raises(ValueError, match=r"(scale|gain|level) must be"):
        noise_match.extra_noise_weight(scale, gain, level)


def _linear_problem(samples: int, dim: int, seed: int) -> tuple[Any, Any, torch.Tensor]:
    # Per-sample loss -w . z_i: each sample's gradient is -z_i, whatever w is.
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(samples, dim, generator=gen, dtype=torch.float64) + 0.5
    model = torch.nn.Linear(dim, 1, bias=False).double()

    def batch_loss(net: Any, idx: torch.Tensor) -> torch.Tensor:
        return -net(z[idx]).mean()

    return model, batch_loss, z


def test_the_mix_is_the_large_gradient_moved_toward_the_small_one() -> None:
    model, batch_loss, z = _linear_problem(64, 3, 0)
    idx = torch.randperm(64)[:32]
    (param,) = model.parameters()
    large = -z[idx].mean(0)
    param.grad = large.clone().view_as(param)
    seen: list[torch.Tensor] = []
    param.register_hook(lambda grad: seen.append(grad))
    noise_match.match_noise(model, batch_loss, idx, 8, 0.25)
    small = -z[idx[:8]].mean(0)
    assert torch.allclose(param.grad.view(-1), large + 0.25 * (small - large))
    assert not seen  # the hooks on the parameter (AdaptDL's) never see the small gradient


def test_the_mixed_gradient_carries_the_noise_of_gain_small_batches() -> None:
    # Over many draws of a batch of 64: the mixed gradient's total variance is
    # tr(Sigma) / (gain * 8) where the plain one's is tr(Sigma) / 64.
    model, batch_loss, z = _linear_problem(100_000, 4, 1)
    (param,) = model.parameters()
    gen = torch.Generator().manual_seed(2)
    gain = 3.0
    k = noise_match.extra_noise_weight(8.0, gain)
    mixed = []
    for _ in range(3000):
        idx = torch.randint(0, len(z), (64,), generator=gen)
        param.grad = (-z[idx].mean(0)).view_as(param).clone()
        noise_match.match_noise(model, batch_loss, idx, 8, k)
        mixed.append(param.grad.view(-1).clone())
    total = float(torch.stack(mixed).var(0).sum())
    trace = float(z.var(0).sum())
    assert total == pytest.approx(trace / (gain * 8), rel=0.1)


def test_the_mix_refuses_more_samples_than_the_local_batch() -> None:
    model, batch_loss, _ = _linear_problem(16, 2, 0)
    (param,) = model.parameters()
    param.grad = torch.zeros_like(param)
    with pytest.raises(ValueError, match=r"local_samples must be in \[1, 4\]"):
        noise_match.match_noise(model, batch_loss, torch.arange(4), 5, 0.5)


def _reached_run(size: int, level: float, seed: int, progress: float | None) -> dict[str, Any]:
    cfg = {"local_bsz": size // 2, "accum_steps": 0, "noise_match": level}
    reached = None
    # Gains: 2 before the target, 9 after it (a run that missed counts all its steps).
    steps = [[0, size, size // 2, 0, 2.0]] * 3 + [[0, size, size // 2, 0, 9.0]]
    if progress is not None:
        reached = {"progress": progress, "samples": 16 * progress, "cpu_seconds": 1.0}
        reached["steps"] = 3
    return {"config": cfg, "seed": seed, "reached": reached, "steps": steps}


def test_at_target_groups_runs_by_size_and_level_and_pairs_them_by_seed() -> None:
    rows = noise_match.at_target(
        [
            _reached_run(16, False, 0, 100.0),
            _reached_run(16, False, 1, 200.0),
            _reached_run(256, False, 0, 50.0),
            _reached_run(256, False, 1, 100.0),
            _reached_run(256, True, 0, 90.0),
            _reached_run(256, True, 1, None),
            _reached_run(256, 0.5, 1, 170.0),
        ]
    )
    # True (older logs) is level 1.
    assert [(r["size"], r["level"], r["reached"]) for r in rows] == [
        (16, 0.0, 2),
        (256, 0.0, 2),
        (256, 0.5, 1),
        (256, 1.0, 1),
    ]
    assert rows[0]["progress"] == 150.0 and rows[3]["seeds"] == [0, 1]
    # Paired by seed: seed 0's 90 over seed 0's 100 (and its plain 256's 50); seed 1
    # missed, infinitely late, which the medians count.
    matched = rows[3]
    assert matched["ratios"] == [0.9, math.inf] and matched["over_plain"] == [1.8, math.inf]
    assert matched["progress"] == math.inf and matched["efficiencies"] == [100 / 90, 0.0]
    assert matched["gain"] == pytest.approx((2.0 + 3.75) / 2)  # reached: 2; missed: all 4
    text = noise_match.table(rows).splitlines()
    assert text[2].startswith("| fixed 16 | 0,1 (2) | 150 | 1.00 (1.00, 1.00) | - | 2.00 |")
    half = "| fixed 256, noise at 0.5 | 1 (1) | 170 | 0.85 (0.85) | 1.70 (1.70) |"
    assert text[4].startswith(half)
    assert text[5].startswith("| fixed 256, noise matched | 0,1 (1) | miss | miss (0.90, miss) |")


def test_level_table_reads_each_level_off_the_evaluations_paired_by_seed() -> None:
    def run(size: int, matched: bool, seed: int, accuracies: list[float]) -> dict[str, Any]:
        cfg = {
            "local_bsz": size // 2,
            "accum_steps": 0,
            "noise_match": matched,
            "target_accuracy": 0.8,
            "stop_at_target": False,
        }
        # One evaluation per 100 units of progress: [progress, samples, s, loss, acc, cpu].
        evals = [[100.0 * (i + 1), 0, 0.0, 1.0, a, 0.0] for i, a in enumerate(accuracies)]
        return {"config": cfg, "seed": seed, "reached": None, "evals": evals, "steps": []}

    runs = [
        run(16, False, 0, [0.3, 0.6, 0.7, 0.8]),
        run(16, False, 1, [0.6, 0.7, 0.8, 0.8]),
        run(256, False, 0, [0.6, 0.8, 0.8, 0.8]),
        run(256, False, 1, [0.8, 0.8, 0.8, 0.8]),
        run(256, True, 0, [0.5, 0.5, 0.5, 0.8]),
    ]
    text = noise_match.level_table(runs, [0.6, 0.8]).splitlines()
    assert text[2] == "| fixed 16 | 1.00 | 1.00 |"
    # 0.6: seed 0 at 100 / 200, seed 1 at 100 / 100; 0.8: 200 / 400 and 100 / 300.
    assert text[3] == "| fixed 256 | 0.75 | 0.42 |"
    assert text[4] == "| fixed 256, noise matched | 2.00 | 1.00 |"


def test_noise_match_is_refused_for_an_adaptive_run(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        time_to_target.main(["--problems", "shapes", "--noise-match", "--out", str(tmp_path)])
    assert "--noise-match applies to fixed sizes" in capsys.readouterr().err


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_the_level_reaches_the_trainer_and_moves_the_training() -> None:
    from experiments.harness.launch import launch

    (cfg,) = time_to_target.configs("shapes", 0, quick=True, kinds="fixed", sizes=[64])
    # Every step measured: under the timing-driven budget the measured steps, and with
    # them the gains and the step count, would differ between the three runs.
    cfg = {**cfg, "stop_at_target": False, "progress_epochs": 1, "measure_share": 1.0}
    results = {
        level: launch("experiments.harness.trainer", 2, {**cfg, "noise_match": level})
        for level in (None, 0.5, 1.0)
    }
    # The same batches' run at each level: its size (64 over 2 replicas, no
    # accumulation) at every step. Each level trains differently, so its gradients, its
    # gains and its progress differ: where the progress cap falls between two steps, one
    # run takes a step more (CI's machine once read 37 steps against 36).
    counts = {level: len(r["steps"]) for level, r in results.items()}
    assert max(counts.values()) - min(counts.values()) <= 1, counts
    for result in results.values():
        assert not result["diverged"]
        assert {tuple(s[1:4]) for s in result["steps"]} == {(64, 32, 0)}
    n = min(len(r["evals"]) for r in results.values())
    losses = {level: [e[3] for e in r["evals"][:n]] for level, r in results.items()}
    assert not np.allclose(losses[0.5], losses[None])
    assert not np.allclose(losses[1.0], losses[0.5])


def test_along_table_bins_each_runs_noise_record_by_progress() -> None:
    def run(matched: bool, seed: int, records: list[list[float]]) -> dict[str, Any]:
        cfg = {"local_bsz": 128, "accum_steps": 0, "noise_match": matched}
        return {"config": cfg, "seed": seed, "noise": records}

    # Records: [progress, samples, |G|^2, tr(Sigma), estimate samples].
    runs = [
        run(False, 0, [[10, 0, 1.0, 10.0, 0], [20, 0, 3.0, 30.0, 0], [150, 0, 1.0, 50.0, 0]]),
        run(False, 1, [[50, 0, 4.0, 40.0, 0]]),
        run(True, 0, [[10, 0, 2.0, 10.0, 0]]),
    ]
    text = noise_match.along_table(runs, [0, 100, 200]).splitlines()
    assert text[0] == "| run: |G|^2 / tr(Sigma) / noise scale, by progress | 0k-0.1k | 0.1k-0.2k |"
    # Seed 0's bin mean (2, 20) and seed 1's (4, 40): medians 3 and 30; one seed in the next.
    assert text[2] == "| fixed 256 | 3.00 / 30 / 10 | 1.00 / 50 / 50 |"
    assert text[3] == "| fixed 256, noise matched | 2.00 / 10 / 5 | - / - / - |"


@pytest.mark.parametrize(
    ("change", "replicas"),
    [({"autoscale": True}, 2), ({"accum_steps": 1}, 2), ({}, 3), ({"local_bsz": 4}, 2)],
)
def test_the_trainer_config_is_refused_where_the_mix_is_not_defined(
    change: dict[str, Any], replicas: int
) -> None:
    cfg = {"init_batch_size": 16, "local_bsz": 64, "accum_steps": 0, **change}
    with pytest.raises(ValueError, match="noise_match needs a fixed size at least"):
        noise_match.check_config(cfg, replicas)
    assert noise_match.check_config({**cfg, **dict.fromkeys(change, None), "local_bsz": 8}, 2) == 8


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_small_gradient_is_averaged_over_the_replicas() -> None:
    from experiments.harness.launch import launch

    result = launch("tests.outcome.match_worker", 2, {"samples": 4, "weight": 0.5})
    assert result["world"] == 2
    # Each replica's first 4 samples, averaged over both: the 8-sample gradient.
    assert np.allclose(result["mixed"], result["expected"])
    assert not np.allclose(result["mixed"], result["large"])


def test_a_noise_match_level_outside_its_range_is_refused(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--problems", "shapes", "--kinds", "fixed", "--noise-match", "1.5"]
    with pytest.raises(SystemExit):
        time_to_target.main([*argv, "--out", str(tmp_path)])
    assert "--noise-match LEVEL must be in (0, 1], got 1.5" in capsys.readouterr().err


def test_run_overrides_carry_every_option_given_and_only_those() -> None:
    import argparse

    args = argparse.Namespace(
        lr=None,
        progress_epochs=8,
        preconditioned=False,
        noise_match=0.5,
        floor_target_loss=None,
    )
    assert time_to_target.run_overrides(args) == {"progress_epochs": 8, "noise_match": 0.5}


def _log(path: Any, runs: list[dict[str, Any]]) -> Any:
    path.write_text("".join(json.dumps(r) + "\n" for r in runs))
    return path


def test_time_to_target_refuses_to_summarise_noise_matched_runs(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    run = {**_reached_run(256, 1.0, 0, 90.0), "problem": "shapes", "label": "fixed 256"}
    log = _log(tmp_path / "log.jsonl", [run])
    with pytest.raises(SystemExit):
        argv = ["--from-log", str(log), "--problems", "shapes"]
        time_to_target.main([*argv, "--out", str(tmp_path)])
    assert "noise-matched runs; summarise them with" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        argv = ["--from-log", str(log), "--noise-match", "--kinds", "fixed"]
        time_to_target.main([*argv, "--out", str(tmp_path)])
    assert "--noise-match selects the runs to make" in capsys.readouterr().err


def test_noise_match_main_summarises_each_problem_and_refuses_a_mix_of_calibrations(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    def run(problem: str, size: int, level: float, epochs: int) -> dict[str, Any]:
        r = _reached_run(size, level, 0, 100.0 if size == 16 else 60.0)
        r["config"].update(progress_epochs=epochs, target_accuracy=0.8)
        return {**r, "problem": problem}

    runs = [run("shapes", 16, 0.0, 12), run("shapes", 256, 1.0, 12), run("dyck", 16, 0.0, 8)]
    rows = noise_match.main([str(_log(tmp_path / "a.jsonl", runs))])
    assert [(r["problem"], r["size"], r["level"]) for r in rows] == [
        ("dyck", 16, 0.0),
        ("shapes", 16, 0.0),
        ("shapes", 256, 1.0),
    ]
    assert "| fixed 256, noise matched | 0 (1) | 60 | 0.60 (0.60) |" in capsys.readouterr().out
    mixed = _log(tmp_path / "b.jsonl", [*runs, run("shapes", 256, 0.0, 8)])
    with pytest.raises(SystemExit):
        noise_match.main([str(mixed)])
    assert "shapes: runs were made on different calibrations" in capsys.readouterr().err


def test_a_noise_matched_sweep_prints_noise_matchs_table_not_the_sweeps(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    made: dict[str, Any] = {}

    def fake_run(problem: str, seeds: Any, **kwargs: Any) -> list[dict[str, Any]]:
        made.update(kwargs)
        return [{**_reached_run(256, 0.5, 0, 60.0), "problem": problem, "label": "fixed 256"}]

    monkeypatch.setattr(time_to_target, "run", fake_run)
    argv = ["--problems", "shapes", "--kinds", "fixed", "--sizes", "256", "--seeds", "1"]
    time_to_target.main([*argv, "--noise-match", "0.5", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert made["overrides"]["noise_match"] == 0.5
    # Named as what it is; the sweep's table (which would call it "fixed 256") is not printed.
    assert "| fixed 256, noise at 0.5 | 0 (1) | 60 |" in out
    assert "Best fixed" not in out


def test_a_fixed_measure_share_replaces_the_budget_and_none_keeps_it() -> None:
    from types import SimpleNamespace

    from experiments.harness.launch import fix_measure_share

    from adaptdl.core.stats.statsbudget import MeasureBudget

    budget = MeasureBudget()
    wrapper = SimpleNamespace(_steps=SimpleNamespace(budget=budget))
    fix_measure_share(wrapper, None)
    assert wrapper._steps.budget is budget
    fix_measure_share(wrapper, 0.25)
    assert wrapper._steps.budget.fixed == 0.25 and wrapper._steps.budget.share == 0.25
    with pytest.raises(ValueError, match="fixed"):
        fix_measure_share(wrapper, 1.5)
