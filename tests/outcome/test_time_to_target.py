"""Fast versions of item 4: the generated problems, the summary, one short run of each."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from experiments.harness import problems, summaries
from experiments.time_to_target import study as time_to_target
from hypothesis import given, settings
from hypothesis import strategies as st


def test_shapes_are_deterministic_balanced_and_noisy() -> None:
    x, y = problems.shapes(800, seed=3)
    x2, y2 = problems.shapes(800, seed=3)
    assert x.shape == (800, 1, 16, 16) and x.dtype == np.float32
    assert np.array_equal(x, x2) and np.array_equal(y, y2)
    counts = np.bincount(y, minlength=len(problems.SHAPES))
    assert counts.min() > 60
    # Without noise, every class draws some pixels; with it, no image is clean.
    clean, _ = problems.shapes(200, noise=0.0, seed=1)
    assert np.all(np.abs(clean).reshape(200, -1).max(axis=1) > 0.5)
    assert not np.array_equal(problems.shapes(10, seed=4)[0], problems.shapes(10, seed=5)[0])


def test_one_draw_for_every_seed_varies_only_the_order() -> None:
    from experiments.harness.trainer import shapes_data

    cfg = {"train_size": 300, "val_size": 50, "noise": 0.4, "data_seed": 7}
    a, b = (shapes_data({**cfg, "seed": seed}) for seed in (0, 1))
    assert np.array_equal(a[2], b[2]) and np.array_equal(a[3], b[3])  # validation
    assert not np.array_equal(a[0], b[0])  # another order ...
    # ... of the same images, each with its label
    key = [np.lexsort(run[0].reshape(300, -1).T) for run in (a, b)]
    assert np.array_equal(a[0][key[0]], b[0][key[1]])
    assert np.array_equal(a[1][key[0]], b[1][key[1]])
    # A draw per seed: the data differ, and seed 7 draws what data_seed 7 did.
    own = [shapes_data({**cfg, "data_seed": None, "seed": seed}) for seed in (1, 7)]
    assert not np.array_equal(own[0][2], a[2])
    assert np.array_equal(own[1][2], a[2])


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 4), st.integers(1, 8), st.integers(0, 1000))
def test_dyck_sequences_are_well_nested_and_their_floor_is_the_entropy(
    k: int, max_depth: int, seed: int
) -> None:
    tokens, logp = problems.dyck(50, length=24, k=k, max_depth=max_depth, seed=seed)
    assert tokens.shape == (50, 25) and np.all(tokens[:, 0] == 2 * k)
    for row, lp in zip(tokens, logp, strict=True):
        stack: list[int] = []
        for t, token in enumerate(row[1:]):
            depth = len(stack)
            if token < k:
                assert depth < max_depth
                expected = 1.0 / k if depth == 0 else 0.5 / k
                stack.append(int(token))
            else:
                assert stack and stack.pop() == token - k  # closes the innermost bracket
                expected = 1.0 if depth == max_depth else 0.5
            assert lp[t] == pytest.approx(np.log(expected))
    assert problems.dyck_optimal_loss(logp) == pytest.approx(-logp.mean())


def _result(label: str, seed: int, cpu: float | None, total: float = 100.0) -> dict[str, object]:
    reached = None if cpu is None else {"cpu_seconds": cpu, "seconds": 2 * cpu, "samples": 10}
    return {
        "label": label,
        "seed": seed,
        "problem": "dyck",
        "reached": reached,
        "train_cpu_seconds": total,
        "train_seconds": 2 * total,
        "steps": [[0, 16, 8, 0, 1, 1, 1, 1, 0.0]],
    }


def test_summary_takes_medians_and_ratios_over_seeds() -> None:
    results = []
    for seed, (a, f16, f64) in enumerate([(10, 60, 20), (12, 70, 25), (30, 65, 22)]):
        results += [
            _result("adaptive", seed, a),
            _result("fixed 16", seed, f16),
            _result("fixed 64", seed, f64),
        ]
    summary = summaries.summarise(results)
    rows = {row["label"]: row for row in summary["rows"]}
    assert rows["adaptive"]["cpu_median"] == 12
    assert summary["best_fixed"] == "fixed 64"
    assert summary["cpu_ratio_best"] == pytest.approx(22 / 12)
    assert summary["cpu_ratio_initial"] == pytest.approx(65 / 12)
    assert summary["wall_ratio_best"] == pytest.approx(44 / 24)
    assert "12.0 [10.0, 30.0]" in time_to_target.table("dyck", summary)


def test_pairs_by_seed_count_wins_and_bound_the_medians_ratio() -> None:
    adaptive = (10.0, 12.0, 30.0, 11.0, 9.0, 14.0)
    fixed = (20.0, 25.0, 22.0, 21.0, 18.0, 26.0)
    results = [_result("adaptive", k, t) for k, t in enumerate(adaptive)]
    # Another order than the adaptive runs', a seed the adaptive run lacks in the
    # middle (left out), and a size that ran only some seeds (no candidate).
    rows = [_result("fixed 64", k, t) for k, t in enumerate(fixed)]
    results += [*rows[3:], _result("fixed 64", 9, 5.0), *rows[:3]]
    results += [_result("fixed 32", k, 1.0) for k in (0, 1)]
    pair = summaries.paired(results, ["fixed 32", "fixed 64"], "adaptive")
    assert pair is not None and pair["label"] == "fixed 64"
    assert pair["seeds"] == [0, 1, 2, 3, 4, 5]
    assert pair["ratios"] == pytest.approx([f / a for f, a in zip(fixed, adaptive, strict=True)])
    assert pair["wins"] == 5  # seed 2 is the fixed size's
    low, high = pair["interval"]
    assert low <= np.median(fixed) / np.median(adaptive) <= high
    assert low < high
    # The same inputs give the same interval (a seeded resampling).
    again = summaries.paired(results, ["fixed 32", "fixed 64"], "adaptive")
    assert again is not None and again["interval"] == [low, high]
    # Under 3 seeds, no interval; no size that ran every seed, no pairing.
    two = [r for r in results if r["seed"] in (0, 1)]
    assert summaries.paired(two, ["fixed 64"], "adaptive")["interval"] is None  # type: ignore[index]
    assert summaries.paired(results, ["fixed 32"], "adaptive") is None
    # A missed target counts at the run's whole time.
    missed = [*results, _result("adaptive", 7, None, total=40.0), _result("fixed 64", 7, 20.0)]
    pair = summaries.paired(missed, ["fixed 64"], "adaptive")
    assert pair is not None and pair["ratios"][-1] == pytest.approx(0.5)
    # Two runs of one size at one seed are refused, not silently one of them.
    with pytest.raises(ValueError, match="two runs of 'fixed 64' at seed 0"):
        summaries.paired([*results, _result("fixed 64", 0, 3.0)], ["fixed 64"], "adaptive")
    summary = summaries.summarise(results)
    assert summary["paired_best"]["wins"] == 5
    assert summary["paired_initial"] is None  # no fixed 16 here
    text = time_to_target.table("dyck", summary)
    assert "(fixed 64) / adaptive (CPU)" in text
    assert "adaptive faster on 5 of 6; 90% bootstrap interval" in text


def test_the_bootstrap_chooses_the_best_size_again_in_each_resample() -> None:
    # Over 4 seeds, fixed 64 is best in median; fixed 128 wins on the resamples heavy
    # in seeds 2 and 3. The interval is that of the exhaustive resampling (4^4 equally
    # likely draws) with the best chosen in each, to within the Monte Carlo's error.
    adaptive = (10.0, 10.0, 10.0, 10.0)
    f64, f128 = (8.0, 8.0, 14.0, 14.0), (16.0, 16.0, 6.0, 9.0)
    results = [_result("adaptive", k, t) for k, t in enumerate(adaptive)]
    results += [_result("fixed 64", k, t) for k, t in enumerate(f64)]
    results += [_result("fixed 128", k, t) for k, t in enumerate(f128)]
    pair = summaries.paired(results, ["fixed 128", "fixed 64"], "adaptive")
    assert pair is not None and pair["label"] == "fixed 64"
    assert pair["ratios"] == pytest.approx([t / 10.0 for t in f64])
    draws = np.array(np.meshgrid(*[range(4)] * 4)).reshape(4, -1).T
    ratios = [min(np.median(np.array(f64)[d]), np.median(np.array(f128)[d])) / 10.0 for d in draws]
    low, high = pair["interval"]
    assert np.quantile(ratios, 0.03) <= low <= np.quantile(ratios, 0.07)
    assert np.quantile(ratios, 0.93) <= high <= np.quantile(ratios, 0.97)
    # Without choosing again, fixed 64 alone reaches higher.
    alone = summaries.paired(results, ["fixed 64"], "adaptive")
    assert alone is not None and alone["interval"][1] > high


def test_a_missed_target_counts_its_whole_time_and_voids_the_ratio() -> None:
    results = [_result("adaptive", 0, None, total=90.0), _result("fixed 16", 0, 50.0)]
    summary = summaries.summarise(results)
    rows = {row["label"]: row for row in summary["rows"]}
    assert rows["adaptive"]["cpu_median"] == 90.0 and rows["adaptive"]["reached"] == 0
    assert summary["cpu_ratio_best"] is None
    assert "not reached" in time_to_target.table("dyck", summary)


def test_a_range_with_misses_holds_the_median_that_counts_them() -> None:
    # Three of six reach (29.5, 32.0, 33.2); three miss after 35, 36, 37 s of training.
    results = [_result("fixed 256", k, t) for k, t in enumerate((29.5, 32.0, 33.2))]
    results += [_result("fixed 256", 3 + k, None, total=t) for k, t in enumerate((35, 36, 37))]
    summary = summaries.summarise(results)
    row = summary["rows"][0]
    assert row["cpu_median"] == pytest.approx(34.1)
    assert row["cpu_all"] == pytest.approx([29.5, 32.0, 33.2, 35.0, 36.0, 37.0])
    text = time_to_target.table("dyck", summary)
    assert "34.1 [29.5, 37.0] (3 missed, each counted at its whole time: a lower bound)" in text


def _trajectory(stop: bool) -> dict[str, object]:
    # evals: progress, samples, wall s, val loss, val accuracy, CPU s
    evals = [[10, 100, 2.0, 1.30, 0.50, 1.0], [20, 200, 4.0, 1.21, 0.70, 2.0]]
    evals.append([30, 300, 6.0, 1.2005, 0.74, 3.0])
    return {
        "label": "fixed 16",
        "seed": 0,
        "problem": "dyck",
        "config": {
            "optimal_loss": 1.2,
            "target_excess": 0.01,
            "target_accuracy": 0.7,
            "stop_at_target": stop,
        },
        "reached": {"progress": 20, "samples": 200, "seconds": 4.0, "cpu_seconds": 2.0},
        "evals": evals,
        "steps": [[p, 16, 8, 0, 1, 1, 1, 1, 0.0] for p in range(1, 31)],
        "val_loss": 1.2005,
        "val_acc": 0.74,
    }


def test_retarget_reads_the_first_evaluation_at_the_new_target() -> None:
    run = _trajectory(stop=False)
    hit = time_to_target.retarget(run, excess=0.001)["reached"]
    assert hit == {"seconds": 6.0, "cpu_seconds": 3.0, "progress": 30, "samples": 300, "steps": 30}
    assert time_to_target.retarget(run, accuracy=0.6)["reached"]["cpu_seconds"] == 2.0
    assert time_to_target.retarget(run, accuracy=0.9)["reached"] is None
    # A run that stopped at its own target knows nothing stricter.
    with pytest.raises(ValueError, match="excess"):
        time_to_target.retarget(_trajectory(stop=True), excess=0.001)
    with pytest.raises(ValueError, match="accuracy"):
        time_to_target.retarget(_trajectory(stop=True), accuracy=0.72)
    with pytest.raises(ValueError, match="exactly one"):
        time_to_target.retarget(run)


def test_targets_follow_the_stated_rule_from_the_initial_size_alone() -> None:
    dyck = {"optimal_loss": 1.2, "target_excess": 0.01}
    runs = [
        {**_trajectory(stop=False), "config": dyck},
        {**_trajectory(stop=False), "config": dyck, "val_loss": 1.2032},
    ]
    # highest final excess 0.0032 + one grid step 0.0005, rounded up to the grid
    assert time_to_target.choose_targets(runs) == {"target_excess": 0.004}
    shapes = [
        {**r, "config": {"target_accuracy": 0.8}, "val_acc": acc}
        for r, acc in zip(runs, (0.7637, 0.771), strict=True)
    ]
    # lowest final accuracy 76.37% - 1 point, rounded down to half a point
    assert time_to_target.choose_targets(shapes) == {"target_accuracy": 0.75}
    others = [{**r, "label": "fixed 64"} for r in runs]
    with pytest.raises(ValueError, match="fixed-16"):
        time_to_target.choose_targets(others)


def test_runs_summarise_together_only_at_one_target_and_one_calibration() -> None:
    run = _trajectory(stop=True)
    assert time_to_target.own_target([run, run]) == {"target_excess": 0.01, "target_accuracy": 0.7}
    assert time_to_target.own_target([]) is None
    other = {**run, "config": {**run["config"], "target_excess": 0.02}}
    with pytest.raises(ValueError, match="different targets"):
        time_to_target.own_target([run, other])
    time_to_target.check_one_calibration([run, other])
    longer = {**run, "config": {**run["config"], "progress_epochs": 8}}
    with pytest.raises(ValueError, match="different calibrations"):
        time_to_target.check_one_calibration([run, longer])
    # One data draw for every seed is another calibration than a draw per seed; a run
    # logged before `data_seed` existed drew its own (the same as None).
    one_draw = {**run, "config": {**run["config"], "data_seed": 0}}
    per_seed = {**run, "config": {**run["config"], "data_seed": None}}
    time_to_target.check_one_calibration([run, per_seed])
    with pytest.raises(ValueError, match="different calibrations"):
        time_to_target.check_one_calibration([run, one_draw])


def test_from_log_refuses_runs_of_two_calibrations(tmp_path: Path, capsys: Any) -> None:
    run = {**_trajectory(stop=True), "replicas": 2}
    longer = {**run, "config": {**run["config"], "progress_epochs": 8}}
    log = tmp_path / "runs.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in (run, longer)))
    with pytest.raises(SystemExit):
        time_to_target.main(["--from-log", str(log), "--problems", "dyck", "--out", str(tmp_path)])
    assert "different calibrations" in capsys.readouterr().err


def test_progress_epochs_overrides_the_cap_of_every_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[dict[str, Any]] = []

    def fake_run(problem: str, seeds: Any, **kwargs: Any) -> list[dict[str, Any]]:
        seen.append(kwargs["overrides"])
        return []

    monkeypatch.setattr(time_to_target, "run", fake_run)
    monkeypatch.setattr(time_to_target, "plot", lambda *args: None)
    time_to_target.main(["--problems", "shapes", "--progress-epochs", "8", "--out", str(tmp_path)])
    assert seen == [{"progress_epochs": 8}]
    cfg = time_to_target.configs("shapes", 0, kinds="fixed", sizes=[128], overrides=seen[0])[0]
    assert cfg["progress_epochs"] == 8 and cfg["data_seed"] == 0


def test_short_only_selects_what_to_run(tmp_path: Path, capsys: Any) -> None:
    log = tmp_path / "runs.jsonl"
    log.write_text(json.dumps({**_trajectory(stop=True), "replicas": 2}) + "\n")
    with pytest.raises(SystemExit):
        time_to_target.main(["--from-log", str(log), "--short", "--out", str(tmp_path)])
    assert "--short selects the calibration to run" in capsys.readouterr().err


def test_short_is_the_first_calibration() -> None:
    # RESULTS.md's runs up to its sixth follow-up were made on these settings.
    for problem, short in time_to_target.SHORT.items():
        cfg = time_to_target.configs(problem, 0, kinds="fixed", sizes=[16], overrides=short)[0]
        assert cfg["train_size"] == (65536 if problem == "shapes" else 16384)
        if problem == "shapes":
            assert (cfg["noise"], cfg["progress_epochs"], cfg["target_accuracy"]) == (0.5, 3, 0.75)
            assert cfg["data_seed"] is None  # a draw per seed
            assert (cfg["val_size"], cfg["eval_every_samples"]) == (2048, 4096)
        else:
            assert (cfg["progress_epochs"], cfg["target_excess"]) == (8, 0.001)


@pytest.mark.e2e
@pytest.mark.timeout(600)
@pytest.mark.parametrize("problem", ["shapes", "dyck"])
def test_one_quick_adaptive_run_trains_and_reports(problem: str) -> None:
    from experiments.harness.launch import launch

    cfg = time_to_target.configs(problem, 0, quick=True)[0]
    assert cfg["autoscale"]
    cfg = {**cfg, "stop_at_target": False}
    result = launch("experiments.harness.trainer", 2, cfg)
    assert result["smoothing"] == 0.999 and result["estimator"] == "GradientNoiseScale"
    steps = np.asarray(result["steps"])
    assert result["replicas"] == 2 and not result["diverged"]
    assert result["progress"] >= cfg["progress_epochs"] * cfg["train_size"] / 16 - 1e-6
    assert np.all(steps[:, 1] <= cfg["max_batch_size"])
    evals = np.asarray(result["evals"])
    # It learns: the validation loss falls.
    assert evals[-1, 3] < evals[0, 3]
    # Each decision carries the job's progress, which places it on the trajectory.
    progress = [d["progress"] for d in result["decisions"]]
    assert progress and progress == sorted(progress)
    assert progress[-1] <= result["progress"]


def test_configs_run_only_the_fixed_sizes_asked_for() -> None:
    def totals(runs: list[dict[str, object]]) -> list[object]:
        return [r.get("local_bsz", "adaptive") for r in runs]

    every = time_to_target.configs("dyck", 0)
    assert len(every) == 1 + len(time_to_target.SWEEP)
    some = time_to_target.configs("dyck", 0, sizes=[16, 256])
    assert totals(some) == ["adaptive", 8, 128]  # 2 replicas x 8, 2 x 128
    with pytest.raises(ValueError, match="1000"):
        time_to_target.configs("dyck", 0, sizes=[1000])


def test_decision_paths_read_totals_and_noise_scales_off_the_log() -> None:
    run = {
        "label": "adaptive",
        "seed": 1,
        "replicas": 2,
        "reached": {"cpu_seconds": 24.4},
        "decisions": [
            {"cpu_seconds": 0.5, "choice": [8, 0]},
            {"cpu_seconds": 1.0, "choice": [12, 0], "gns": [0.0, 5.0, 99], "bound": [0.5, 11.0]},
            {"cpu_seconds": 2.0, "choice": [32, 1], "gns": [2.0, 60.0, 99], "bound": [3.0, 60.0]},
        ],
    }
    fixed = {
        "label": "fixed 64",
        "seed": 1,
        "decisions": [{"cpu_seconds": 1.0, "choice": [32, 0]}],
    }
    text = summaries.decision_paths([run, fixed])
    assert text.splitlines() == [
        "seed 1: reached in 24.4 CPU s",
        "    0.5: 16 (-/-), 1.0: 24 (inf/22), 2.0: 128 (30/20)",
    ]


def test_phase_table_reads_samples_to_each_level_and_the_implied_noise_scale() -> None:
    def run(label: str, seed: int, accs: list[float]) -> dict[str, object]:
        # evals: [progress, samples, seconds, val_loss, val_acc, cpu]
        evals = [[0.0, 1000 * (i + 1), 0.0, 1.0, a, 0.0] for i, a in enumerate(accs)]
        return {"label": label, "seed": seed, "evals": evals}

    runs = [
        run("fixed 16", 0, [0.2, 0.6, 0.8]),  # 60% at 2k, 80% at 3k
        run("fixed 16", 1, [0.6, 0.6, 0.8]),  # at 1k, 3k: medians 1.5k and 3k
        run("fixed 64", 0, [0.1, 0.2, 0.6, 0.6, 0.6, 0.8]),  # 3k and 6k: efficiency 0.5
        run("adaptive", 0, [0.6, 0.7]),  # never 80%
    ]
    text = summaries.phase_table(runs, [0.6, 0.8]).splitlines()
    assert text[1] == "| run | 60% | 80% |"
    assert text[3] == "| adaptive | 1 | - |"
    assert text[4] == "| fixed 16 | 2 | 3 |"
    # 60%: 1.5k / 3k = 0.5, B = (16 - 32) / (0.5 - 1) = 32; 80%: 3k / 6k, the same.
    assert text[5] == "| fixed 64 | 3 (0.50 / 32) | 6 (0.50 / 32) |"


def test_preconditioned_is_refused_for_a_problem_without_adamscale(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        time_to_target.main(["--problems", "shapes", "--preconditioned", "--out", str(tmp_path)])
    assert "not ['shapes']" in capsys.readouterr().err


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_evaluations_shared_over_replicas_are_the_whole_sets() -> None:
    """Each replica evaluates its share and the sums are all-reduced: the figures every
    replica gets are the whole validation set's, also when the shares are unequal."""
    from experiments.harness.launch import launch

    result = launch("tests.outcome.eval_worker", 2, {"images": 1001, "sequences": 301})
    assert result["world"] == 2
    for model in ("cnn", "lm"):
        assert result["shared"][model] == pytest.approx(result["whole"][model], rel=1e-5)


def test_the_decision_at_target_is_the_last_one_before_it() -> None:
    def decision(seconds: float, local: int, progress: float | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"seconds": seconds, "choice": [local, 0], "candidates": [[16, 1, 1]]}
        if progress is not None:
            d["progress"] = progress
        return d

    # Evaluations put the decision clock ahead of the training clock: decisions at
    # clock 6.5 and 8.0 came before the target, reached at 5.5 s of training.
    reached = {"seconds": 5.5, "progress": 55.0, "steps": 55, "samples": 3000}
    run = {
        "label": "adaptive",
        "config": {"stop_at_target": True},
        "samples": 3000,
        "reached": reached,
        "decisions": [decision(1.0, 8), decision(6.5, 32), decision(8.0, 32)],
    }
    # It stopped there: every decision came before.
    assert summaries.decision_at_target(run) is run["decisions"][-1]
    # Read at another target than it stopped at, the clock places them (maybe early).
    onward = {**run, "samples": 9000}
    assert summaries.decision_at_target(onward) is run["decisions"][0]
    # With the progress logged, it places them: the one at clock 8.0 and progress 52
    # came before the target, the one at progress 56 after.
    logged = [decision(1.0, 8, 0.0), decision(6.5, 32, 49.0), decision(8.0, 32, 52.0)]
    logged.append(decision(8.1, 64, 56.0))
    for r in (run, onward):
        assert summaries.decision_at_target({**r, "decisions": logged}) is logged[2]
    # A run that missed: its last decision; none logged: None.
    assert summaries.decision_at_target({**run, "reached": None}) is run["decisions"][-1]
    assert summaries.decision_at_target({**run, "decisions": []}) is None


def test_parameters_finite_sees_a_nan_or_inf_in_any_parameter() -> None:
    from experiments.harness.trainer import parameters_finite

    import torch

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    assert parameters_finite(model)
    with torch.no_grad():
        model[1].bias[1] = float("nan")
    assert not parameters_finite(model)
    with torch.no_grad():
        model[1].bias[1] = 0.0
        model[0].weight[2, 0] = float("-inf")
    assert not parameters_finite(model)
