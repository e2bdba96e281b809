"""The trace-replay study (`experiments.trace_replay`): its targets, its fixed
configurations, the metric rule for the adaptive run, and its command end to end.

Most tests build a small trace in the Pollux layout in a temporary folder; those
marked by the ``pollux_traces`` fixture read the real traces and skip where
``../shared/pollux`` is absent.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from experiments.trace_replay import __main__ as cli
from experiments.trace_replay.curves import Curves, read_curves
from experiments.trace_replay.replay import (
    compare,
    fixed_config,
    fixed_row,
    model_check,
    placement,
    run_adaptive,
    simulate_all_fixed,
    step_seconds,
)
from hypothesis import given
from hypothesis import strategies as st

from adaptdl.sim.traces import TraceApplication, TraceError

POLLUX = Path(__file__).resolve().parents[2] / ".." / "shared" / "pollux" / "traces"

#: The small trace: batch sizes, metric (higher is better) and optimiser steps per epoch.
SIZES = (8, 16, 32)
METRIC = {8: (0.5, 0.7, 0.80), 16: (0.5, 0.75, 0.78), 32: (0.4, 0.6, 0.76)}


def write_trace(folder: Path, name: str = "toy") -> Path:
    """A trace folder of three batch sizes, three epochs of 1,000 initial-batch steps."""
    app = folder / name
    app.mkdir(parents=True)
    lines = ["placement,local_bsz,step_time,sync_time"]
    for key, sync in (("1", 0.0), ("4", 0.002), ("4444", 0.02)):
        for local in (2, 4, 8):
            lines.append(f"{key},{local},{0.01 + 0.001 * local + sync},{sync}")
    (app / "placements.csv").write_text("\n".join(lines) + "\n")
    scal = ["num_nodes,num_replicas,local_bsz,step_time,sync_time"]
    scal += [f"2,8,{b},{0.03 + 0.001 * b},0.01" for b in (2, 4, 8)]
    (app / "scalability.csv").write_text("\n".join(scal) + "\n")
    for b in SIZES:
        rows = ["progress,iteration,metric,grad_sqr,grad_var"]
        for e, m in enumerate(METRIC[b]):
            # Each step at b advances the progress by its gain (b/8 at best).
            gain = 1.0 + 0.8 * (b / 8 - 1)
            rows.append(f"{1000.0 * (e + 1)},{round(1000 * (e + 1) / gain)},{m},1.0,20.0")
        (app / f"validation-{b}.csv").write_text("\n".join(rows) + "\n")
    return app


@pytest.fixture
def toy(tmp_path: Path) -> tuple[TraceApplication, Curves]:
    folder = write_trace(tmp_path)
    return TraceApplication(folder, num_epochs=3), read_curves(folder, epochs=3)


@pytest.fixture(scope="module")
def pollux_traces() -> Path:
    if not POLLUX.is_dir():
        pytest.skip(f"measured Pollux data not found at {POLLUX}")
    return POLLUX.resolve()


def test_targets_follow_the_metric_direction(toy: tuple[TraceApplication, Curves]) -> None:
    _, curves = toy
    assert curves.target("common") == 0.76  # the worst final metric, higher is better
    assert curves.target("initial") == 0.80
    lower = Curves("y", curves.batch_sizes, curves.metric, curves.iterations, True)
    assert lower.target("common") == 0.80  # the worst is the largest when lower is better
    assert lower.first_epoch([0.9, 0.79, 0.7], 0.8) == 1
    with pytest.raises(ValueError, match="target kind must be one of"):
        curves.target("best")


def test_every_measured_size_reaches_the_common_target(
    toy: tuple[TraceApplication, Curves],
) -> None:
    _, curves = toy
    target = curves.target("common")
    assert all(curves.first_epoch(m, target) is not None for m in curves.metric)


@given(epoch=st.integers(0, 2), size=st.sampled_from(SIZES))
def test_the_metric_rule_gives_a_measured_size_its_own_curve(epoch: int, size: int) -> None:
    curves = Curves(
        "toy",
        SIZES,
        np.array([METRIC[b] for b in SIZES]),
        np.ones((3, 3), dtype=np.int64),
        False,
    )
    assert curves.metric_at(size, epoch) == METRIC[size][epoch]


@given(size=st.floats(1.0, 1e4), epoch=st.integers(0, 2))
def test_the_metric_rule_stays_between_the_measured_sizes_around_it(
    size: float, epoch: int
) -> None:
    curves = Curves(
        "toy", SIZES, np.array([METRIC[b] for b in SIZES]), np.ones((3, 3), np.int64), False
    )
    value = curves.metric_at(size, epoch)
    column = [METRIC[b][epoch] for b in SIZES]
    i = int(np.searchsorted(SIZES, size))
    around = column[max(i - 1, 0) : i + 1] or column[-1:]
    assert min(around) - 1e-12 <= value <= max(around) + 1e-12


@given(
    batch_size=st.integers(1, 5000),
    gpus=st.sampled_from((1, 4, 16)),
    hi=st.integers(1, 512),
)
def test_a_fixed_size_uses_the_fewest_micro_batches_that_fit_or_is_excluded(
    batch_size: int, gpus: int, hi: int
) -> None:
    class App:
        local_bsz_bounds = (min(4, hi), hi)

    config = fixed_config(App(), batch_size, gpus)  # type: ignore[arg-type]
    micro = max(1, math.ceil(batch_size / (gpus * hi)))
    if batch_size % (gpus * micro) or batch_size < gpus:
        assert config is None
        return
    assert config is not None
    assert config.local_bsz * gpus * (config.accum_steps + 1) == batch_size
    assert config.local_bsz <= hi
    # One micro-batch fewer would not fit the largest local batch.
    assert config.accum_steps == 0 or batch_size / (gpus * config.accum_steps) > hi
    assert config.extrapolated == (config.local_bsz < App.local_bsz_bounds[0])


def test_a_fixed_size_takes_its_measured_steps_at_the_traced_step_time(
    toy: tuple[TraceApplication, Curves],
) -> None:
    app, curves = toy
    row = fixed_row(app, curves, 32, 1, curves.target("common"))
    # 32 on one GPU: local 8 (the largest measured), 3 accumulation micro-batches.
    assert (row["local_bsz"], row["accum_steps"]) == (8, 3)
    assert row["epoch"] == 2 and row["steps"] == curves.iterations[2, 2]
    step, sync = app.step_time((1,), 8)
    assert row["seconds"] == pytest.approx(row["steps"] * (3 * (step - sync) + step))
    assert fixed_row(app, curves, 8, 16, 0.7)["runs"] is False  # 8 samples on 16 GPUs


def test_the_adaptive_run_is_judged_by_the_metric_at_its_batch_size(
    toy: tuple[TraceApplication, Curves],
) -> None:
    app, curves = toy
    run = run_adaptive(app, 4)
    result = compare(app, curves, 4, curves.target("common"), run)
    adaptive = result["adaptive"]
    assert adaptive["seconds"] is not None
    assert adaptive["epoch"] == curves.first_epoch(adaptive["metric_at_epochs"], 0.76)
    assert len(adaptive["metric_at_epochs"]) == 3
    # The best fixed size is the fastest of those that reach the target.
    times = {r["label"]: r["seconds"] for r in result["fixed"] if r["seconds"] is not None}
    assert result["best_fixed"] == min(times, key=times.__getitem__)
    assert result["best_fixed_over_adaptive"] == pytest.approx(
        times[result["best_fixed"]] / adaptive["seconds"]
    )


def test_both_simulated_times_the_fixed_sizes_by_the_simulator(
    toy: tuple[TraceApplication, Curves],
) -> None:
    app, curves = toy
    run = run_adaptive(app, 4)
    sims = simulate_all_fixed(app, curves, 4)
    target = curves.target("common")
    result = compare(app, curves, 4, target, run, sims)
    for row in result["fixed"]:
        assert row["simulated_seconds"] == sims[row["batch_size"]].seconds_at[row["epoch"]]
    best = min(r["simulated_seconds"] for r in result["fixed"])
    assert result["both_simulated"] == pytest.approx(best / result["adaptive"]["seconds"])
    assert compare(app, curves, 4, target, run)["both_simulated"] is None
    check = model_check(curves, sims)
    assert [r["batch_size"] for r in check] == list(SIZES)
    assert all(r["ratio"] == r["simulated_steps"] / r["measured_steps"] for r in check)


def test_missing_validation_rows_name_the_file(tmp_path: Path) -> None:
    folder = write_trace(tmp_path)
    with pytest.raises(TraceError, match=r"validation-8\.csv.*3 epochs measured, toy needs 5"):
        read_curves(folder, epochs=5)


def test_placements_pack_four_gpus_per_node() -> None:
    assert placement(1) == (1,) and placement(4) == (4,) and placement(16) == (4, 4, 4, 4)
    with pytest.raises(ValueError, match="gpus must be >= 1"):
        placement(0)


def test_the_command_writes_the_issue_schema(tmp_path: Path) -> None:
    write_trace(tmp_path / "traces", "toy")
    # The toy has no published epoch count: its files' three epochs are used.
    rows = cli.main(["--traces", str(tmp_path / "traces"), "--out", str(tmp_path / "out")])
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary == rows and len(rows) == 3
    for row in rows:
        assert set(row) >= {
            "problem",
            "kind",
            "best_fixed_over_adaptive",
            "interval",
            "per_seed_median",
            "initial_over_adaptive",
            "seeds",
            "commit",
        }
        assert row["kind"] == "trace" and row["interval"] is None and row["seeds"] == 1
        assert row["per_seed_median"] == row["best_fixed_over_adaptive"]


def test_ncf_on_the_real_trace(pollux_traces: Path, tmp_path: Path) -> None:
    rows = cli.main(
        ["--traces", str(pollux_traces), "--out", str(tmp_path), "--apps", "ncf", "--gpus", "4"]
    )
    (row,) = rows
    assert row["problem"] == "pollux/ncf @ 4 GPUs"
    assert row["best_fixed_over_adaptive"] is not None
    data = json.loads((tmp_path / "trace_replay.json").read_text())
    common = data["results"][0]["by_gpus"][0]["common"]
    app = TraceApplication(pollux_traces / "ncf")
    curves = read_curves(pollux_traces / "ncf")
    for r in common["fixed"]:
        config = fixed_config(app, r["batch_size"], 4)
        assert config is not None  # every ncf size splits over 4 GPUs
        i = curves.batch_sizes.index(r["batch_size"])
        assert r["steps"] == curves.iterations[i, r["epoch"]]
        assert r["seconds"] == pytest.approx(r["steps"] * step_seconds(app, config))
