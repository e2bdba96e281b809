"""`experiments.loss_floor`: the tables, the options' refusals, the wiring."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from experiments.loss_floor import study as floor_credit
from experiments.time_to_target import study as time_to_target

from adaptdl.core.stats.floor import floor_level, sgd_rate


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
        "label": time_to_target.label_of(cfg),
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
    # Without fixed runs: the medians only.
    alone = floor_credit.target_table(runs[4:]).splitlines()
    assert alone[2] == "| adaptive | 50.0 | 100 | 10 |  |  |  |"
    credit = floor_credit.target_table([*runs, _run("adaptive", 0, 10.0, floor_credit=True)])
    assert "| adaptive, per-step credit | 10.0 |" in credit


def test_pool_repeats_averages_each_kind_and_seed_and_keeps_a_miss() -> None:
    runs = [_run("adaptive", 0, 10.0), _run("adaptive", 0, 20.0), _run("adaptive", 1, None)]
    runs.append(_run("adaptive", 1, 40.0))
    pooled = {r["seed"]: r for r in floor_credit.pool_repeats(runs)}
    assert pooled[0]["reached"] == {"cpu_seconds": 15.0, "progress": 100.0, "samples": 10.0}
    # A repeat that missed counts at its whole run (80 s) and leaves the mean unreached.
    assert pooled[1]["reached"] is None and pooled[1]["train_cpu_seconds"] == 60.0


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
    at16 = floor_level(sgd_rate(0.01, 0.9), 100.0, 16.0)
    at256 = floor_level(sgd_rate(0.01, 0.9), 100.0, 256.0)
    assert text[2] == f"| fixed 256 | -0.100 / {at256 - at16:+.3f} |"
    # Noise matched at level 1: 16 * gain / level = 32 samples' noise.
    at32 = floor_level(sgd_rate(0.01, 0.9), 100.0, 32.0)
    assert text[3] == f"| fixed 256, noise matched | +0.000 / {at32 - at16:+.3f} |"
    assert text[0].startswith("| run: training loss over fixed 16's, measured / predicted |")
    with pytest.raises(ValueError, match="needs the fixed 16 runs"):
        floor_credit.floor_gap_table(runs[1:], [50.0])
    with pytest.raises(ValueError, match="needs fixed-size runs"):
        floor_credit.floor_gap_table([], [50.0])


def test_the_floor_options_reach_the_runs_and_are_refused_where_undefined(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    args = argparse.Namespace(
        lr=None,
        progress_epochs=None,
        preconditioned=False,
        noise_match=None,
        floor_target_loss=0.35,
    )
    assert time_to_target.run_overrides(args) == {"floor_target_loss": 0.35}
    zero = argparse.Namespace(**{**vars(args), "floor_target_loss": 0.0})
    assert time_to_target.run_overrides(zero) == {"floor_target_loss": 0.0}
    adaptive = ["--kinds", "adaptive", "--problems", "shapes"]
    cases = [
        (["--floor-target-loss", "0", "--kinds", "fixed"], "applies to adaptive runs"),
        (["--floor-target-loss", "0.3", "--noise-match", *adaptive], "not allowed with argument"),
        (["--floor-target-loss", "0.3", "--kinds", "adaptive", "--problems", "dyck"], "dyck"),
        (["--floor-target-loss", "0.3", "--from-log", str(tmp_path), *adaptive], "runs to make"),
        (["--floor-target-loss", "nan", *adaptive], "--floor-target-loss must be finite"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit):
            time_to_target.main([*argv, "--out", str(tmp_path)])
        assert message in capsys.readouterr().err


def test_time_to_target_refuses_to_summarise_floor_runs_and_floor_credit_does(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = [
        {**_run("adaptive", 0, 5.0, floor_target_loss=0.0), "problem": "shapes"},
        {**_run("256", 0, 10.0), "problem": "shapes"},
        {**_run("adaptive", 0, 20.0), "problem": "shapes"},
    ]
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in runs))
    with pytest.raises(SystemExit):
        time_to_target.main(
            ["--from-log", str(log), "--problems", "shapes", "--out", str(tmp_path)]
        )
    assert "the logs hold floor-share runs; summarise them with" in capsys.readouterr().err
    floor_credit.main([str(log)])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "shapes:"
    assert out[3].startswith("| adaptive, floor share to loss 0 | 5.0 |")
    # A mix of targets in one problem is refused, as the sweep's summaries refuse it.
    other = {**runs[1], "seed": 1, "config": {**runs[1]["config"], "target_accuracy": 0.5}}
    log.write_text("".join(json.dumps(r) + "\n" for r in [*runs, other]))
    with pytest.raises(SystemExit):
        floor_credit.main([str(log)])
    assert "shapes: runs were made to different targets" in capsys.readouterr().err


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_the_share_reaches_the_decision_of_an_adaptive_run_under_torchrun() -> None:
    from experiments.harness.launch import launch

    (cfg,) = time_to_target.configs("shapes", 0, quick=True, kinds="adaptive")
    # The share is set from the 100th loss on and sampled every 8th step where the
    # estimate resolves the gradient (about half the steps here). The decision is made
    # on measured step times: on a loaded machine it took batches of 128-256 (a gain
    # of 8-16 a step) and ended the 512 steps' progress in 109-121 steps, leaving one
    # or two samples, often unresolved: no rows. A largest batch of 32 (a gain of at
    # most 2) keeps the decision adaptive (16 or 32) and makes at least 256 steps.
    cfg = {
        **cfg,
        "stop_at_target": False,
        "progress_epochs": 4,
        "floor_target_loss": 0.0,
        "max_batch_size": 32,
    }
    result = launch("experiments.harness.trainer", 2, cfg)
    # Core's estimator: the share is core's (adaptdl.core.stats.floor), through report_loss.
    assert result["estimator"] == "GradientNoiseScale" and not result["diverged"]
    # A gain of at most max / initial batch: at least epochs * train_size / max steps.
    least = cfg["progress_epochs"] * cfg["train_size"] // cfg["max_batch_size"]
    assert len(result["steps"]) >= least > 100 + 8 * 10, len(result["steps"])
    floor = np.array(result["floor"])
    # Rows once the share is set (from step 100 on): (progress, the training loss's
    # average, the initial batch's floor, the share), the share the floor over the loss
    # left (target 0).
    assert len(floor) and np.all(floor[:, 2] > 0.0)
    assert np.all((floor[:, 3] > 0.0) & (floor[:, 3] <= 0.9))
    # With the efficiency E in (0, 1]: F0 / (loss + F0) <= f <= F0 / loss (or the cap).
    loss, floor0, share = floor[:, 1], floor[:, 2], floor[:, 3]
    assert np.all(share <= np.minimum(floor0 / loss, 0.9) + 1e-12)
    assert np.all(share >= np.minimum(floor0 / (loss + floor0), 0.9) - 1e-12)
