"""Trace parsing: the application models read from the Pollux layout."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from adaptdl.sim.apps import builtin_applications
from adaptdl.sim.traces import TARGET_EPOCHS, TraceApplication, TraceError, load_traces


def _copy_app(pollux_dir: Path, tmp_path: Path, app: str = "cifar10") -> Path:
    dst = tmp_path / app
    shutil.copytree(pollux_dir / "traces" / app, dst)
    return dst


def test_every_application_trains_for_its_published_epochs(trace_apps: dict) -> None:
    for name, epochs in TARGET_EPOCHS.items():
        assert trace_apps[name].num_epochs == epochs


def test_epoch_progress_is_the_smallest_progress_any_batch_size_reached(
    pollux_dir: Path, trace_apps: dict
) -> None:
    app = trace_apps["cifar10"]
    folder = pollux_dir / "traces" / "cifar10"
    per_bsz = [
        np.loadtxt(p, delimiter=",", skiprows=1, usecols=0)
        for p in sorted(folder.glob("validation-*.csv"))
    ]
    expected = np.min(np.stack(per_bsz), axis=0)
    np.testing.assert_allclose(app.epoch_progress, expected)
    assert np.all(np.diff(app.epoch_progress) > 0)


def test_batch_size_range_and_yolov3_local_limit(trace_apps: dict) -> None:
    assert trace_apps["cifar10"].init_batch_size == 128
    assert trace_apps["cifar10"].max_batch_size == 4096
    assert trace_apps["yolov3"].local_bsz_bounds[1] == 8


def test_step_time_matches_a_measured_placement(trace_apps: dict) -> None:
    # 4,32,0.05821514129638672,0.01432212142944336 in cifar10/placements.csv
    step, sync = trace_apps["cifar10"].step_time((4,), 32)
    assert step == pytest.approx(0.05821514129638672)
    assert sync == pytest.approx(0.01432212142944336)


def test_step_time_interpolates_between_batch_sizes_and_spreads(trace_apps: dict) -> None:
    app = trace_apps["cifar10"]
    lo, hi = app.step_time((4,), 32)[0], app.step_time((4,), 45)[0]
    mid = app.step_time((4,), 38)[0]
    assert min(lo, hi) <= mid <= max(lo, hi)
    # 7 nodes lies between the measured 6 and 8 node spreads.
    a = app.step_time((2,) * 6, 128)[0]
    b = app.step_time((2,) * 8, 128)[0]
    c = app.step_time((2,) * 7, 128)[0]
    assert min(a, b) - 1e-12 <= c <= max(a, b) + 1e-12


def test_step_time_is_positive_everywhere(trace_apps: dict) -> None:
    for app in trace_apps.values():
        lo, hi = app.local_bsz_bounds
        for placement in [(1,), (3,), (4, 4), (4, 2, 1), (4,) * 16, (1,) * 9]:
            for bsz in (1, lo, (lo + hi) / 2, hi, 4 * hi):
                step, sync = app.step_time(placement, bsz)
                assert step > 0 and sync >= 0


def test_grad_stats_interpolate_between_the_nearest_batch_sizes(trace_apps: dict) -> None:
    app = trace_apps["cifar10"]
    s128, v128 = app.grad_stats(128, 3)
    s256, v256 = app.grad_stats(256, 3)
    s192, v192 = app.grad_stats(192, 3)
    assert s192 == pytest.approx((s128 + s256) / 2)
    assert v192 == pytest.approx((v128 + v256) / 2)
    # Progress-dependent: the statistics change from epoch to epoch.
    assert app.grad_stats(128, 0) != app.grad_stats(128, 50)


def test_missing_column_names_file_and_line(pollux_dir: Path, tmp_path: Path) -> None:
    folder = _copy_app(pollux_dir, tmp_path)
    path = folder / "placements.csv"
    lines = path.read_text().splitlines()
    lines[0] = "placement,local_bsz,step_time"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match=r"placements\.csv:1: missing column.*sync_time"):
        TraceApplication(folder)


def test_bad_number_names_file_and_line(pollux_dir: Path, tmp_path: Path) -> None:
    folder = _copy_app(pollux_dir, tmp_path)
    path = folder / "scalability.csv"
    lines = path.read_text().splitlines()
    lines[4] = lines[4].replace(lines[4].split(",")[3], "fast")
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match=r"scalability\.csv:5: column 'step_time': bad number"):
        TraceApplication(folder)


def test_bad_validation_number_names_file_and_line(pollux_dir: Path, tmp_path: Path) -> None:
    folder = _copy_app(pollux_dir, tmp_path)
    path = folder / "validation-256.csv"
    lines = path.read_text().splitlines()
    fields = lines[2].split(",")
    fields[4] = "-1"
    lines[2] = ",".join(fields)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match=r"validation-256\.csv:3: column 'grad_var'"):
        TraceApplication(folder)


def test_unknown_application_is_named(pollux_dir: Path) -> None:
    with pytest.raises(TraceError, match="unknown application 'mnist'"):
        load_traces(pollux_dir / "traces", ["cifar10", "mnist"])


def test_too_few_epochs_is_an_error(pollux_dir: Path, tmp_path: Path) -> None:
    folder = _copy_app(pollux_dir, tmp_path, "bert")
    path = folder / "validation-24.csv"
    path.write_text("\n".join(path.read_text().splitlines()[:2]) + "\n")
    with pytest.raises(TraceError, match=r"validation-24\.csv: 1 epochs measured"):
        TraceApplication(folder)


def test_missing_folder_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="not found"):
        load_traces(tmp_path / "nowhere")


def test_builtin_applications_need_no_data() -> None:
    apps = builtin_applications()
    assert len(apps) >= 3
    for app in apps.values():
        one = app.step_time((1,), app.local_bsz_bounds[0])[0]
        spread = app.step_time((4, 4), app.local_bsz_bounds[0])
        assert one > 0 and spread[0] >= one and spread[1] > 0
        assert app.gain(app.init_batch_size, 0) == pytest.approx(1.0)
        big = app.gain(app.max_batch_size, 0)
        assert 1.0 <= big <= app.max_batch_size / app.init_batch_size
        assert app.epoch_at(0.0) == 0
        assert app.epoch_at(app.target_progress) == app.num_epochs - 1


def test_builtin_application_rejects_bad_numbers() -> None:
    from adaptdl.sim.apps import ParametricApplication

    with pytest.raises(ValueError, match="max_batch_size"):
        ParametricApplication(
            name="x",
            init_batch_size=64,
            max_batch_size=32,
            local_bsz_bounds=(8, 64),
            dataset_size=1000,
            epochs=2,
        )
    with pytest.raises(ValueError, match="gamma"):
        ParametricApplication(
            name="x",
            init_batch_size=64,
            max_batch_size=128,
            local_bsz_bounds=(8, 64),
            dataset_size=1000,
            epochs=2,
            gamma=0.5,
        )
