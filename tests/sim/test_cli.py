"""The adaptdl-sim command line."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from adaptdl.sim import cli
from adaptdl.sim.cli import main


def test_replay_default_scenario_needs_no_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["scenario"] == "elastic" and out["exactly_once"] is True
    assert out["epochs"] and out["timeline"]


def _tiny_scenario(tmp_path: Path) -> str:
    path = tmp_path / "tiny.json"
    path.write_text(
        json.dumps(
            {
                "name": "tiny",
                "application": "replay-small",
                "epochs": 2,
                "dataset_size": 300,
                "init_batch_size": 16,
                "max_batch_size": 128,
                "local_bsz_bounds": [4, 64],
                "replicas": 2,
                "timeline": [{"time": 3.0, "kind": "crash"}],
                "restart_penalty": 5.0,
                "checkpoint_interval": 1.0,
            }
        )
    )
    return str(path)


def test_replay_prints_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", _tiny_scenario(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "exactly once" in out and "tiny" in out


def test_cluster_json_top_level(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cluster", "--policy", "fifo", "--jobs", "6", "--nodes", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "fifo" and len(out["jobs"]) == 6
    assert {"avg_jct", "p50_jct", "p99_jct", "makespan"} <= set(out)


def test_native_output_while_simulating_keeps_the_json_clean(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # HiGHS (the adaptdl policy's integer program) now and then prints a line of its
    # own to the process's standard output, past Python: it once landed inside
    # `cluster --json`'s document (realistic workloads 3 and 4).
    real = cli.simulate

    def noisy(*args: Any, **kwargs: Any) -> Any:
        os.write(1, b"HighsMipSolverData::transformNewIntegerFeasibleSolution\n")
        return real(*args, **kwargs)

    monkeypatch.setattr(cli, "simulate", noisy)
    assert main(["cluster", "--policy", "fifo", "--jobs", "4", "--nodes", "1", "--json"]) == 0
    out, err = capfd.readouterr()
    assert json.loads(out)["policy"] == "fifo"
    assert "HighsMipSolverData" in err
    # Standard output is back where it was.
    os.write(1, b"after\n")
    assert capfd.readouterr().out == "after\n"


def test_compare_prints_every_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "--jobs", "6", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    for policy in ("pollux", "tiresias", "optimus", "fifo"):
        assert policy in out


def test_compare_several_workloads_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for i in (1, 2):
        (tmp_path / f"w{i}.csv").write_text(
            "name,time,application,num_replicas,batch_size\n"
            f"a,0,resnet-small,{i},256\nb,30,speech,2,40\n"
        )
    argv = ["compare", str(tmp_path / "w1.csv"), str(tmp_path / "w2.csv"), "--json"]
    assert main([*argv, "--policies", "fifo,pollux"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["workloads"]) == {"w1", "w2"} and set(out["mean"]) == {"fifo", "pollux"}


def test_plots_are_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    argv = ["cluster", "--policy", "fifo", "--jobs", "3", "--nodes", "2", "--plot", str(tmp_path)]
    assert main(argv) == 0
    names = {p.name for p in tmp_path.iterdir()}
    assert {"jct_cdf.png", "fifo_gpus.png", "fifo_batch_size.png"} <= names
    assert main(["replay", _tiny_scenario(tmp_path), "--plot", str(tmp_path)]) == 0
    assert (tmp_path / "replay_tiny.png").is_file()


def test_errors_exit_2_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "nowhere"]) == 2
    assert "neither built in" in capsys.readouterr().err
    bad = tmp_path / "w.csv"
    bad.write_text("name,time,application,num_replicas,batch_size\na,0,bert,1,12\n")
    assert main(["cluster", str(bad)]) == 2
    assert "pass --traces" in capsys.readouterr().err


def test_help_exits_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "replay" in capsys.readouterr().out


def test_version_prints_the_installed_distribution_version(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import importlib.metadata

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == (
        f"adaptdl-sim {importlib.metadata.version('adaptdl-sim')}"
    )


def _no_simulation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any simulation fail the test: --plot must be checked before one starts."""

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("simulated although --plot cannot work")

    monkeypatch.setattr("adaptdl.sim.cli.simulate", forbidden)
    monkeypatch.setattr("adaptdl.sim.cli.run_replay", forbidden)


@pytest.mark.parametrize("command", [["replay"], ["cluster", "--jobs", "3"], ["compare"]])
def test_plot_without_matplotlib_fails_before_simulating(
    command: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _no_simulation(monkeypatch)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    folder = tmp_path / "plots"
    assert main([*command, "--plot", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("adaptdl-sim: error: --plot: matplotlib is not installed")
    assert "pip install 'adaptdl-sim[plots]'" in err


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("file", "{folder!r} exists and is not a directory"),
        ("file/sub", "cannot write into directory {folder!r}: Not a directory"),
    ],
)
def test_plot_into_an_unusable_directory_fails_before_simulating(
    where: str,
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _no_simulation(monkeypatch)
    (tmp_path / "file").write_text("in the way")
    folder = str(tmp_path / where)
    assert main(["cluster", "--plot", folder]) == 2
    err = capsys.readouterr().err
    assert err == f"adaptdl-sim: error: --plot: {message.format(folder=folder)}\n"


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root may write anywhere"
)
def test_plot_into_a_read_only_directory_fails_before_simulating(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _no_simulation(monkeypatch)
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        assert main(["replay", "--plot", str(folder)]) == 2
    finally:
        folder.chmod(0o700)
    assert "Permission denied" in capsys.readouterr().err


def test_plot_check_creates_the_folder_and_leaves_nothing_in_it(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from adaptdl.sim.plots import check_plot_folder

    folder = tmp_path / "a" / "b"
    assert check_plot_folder(folder) == folder
    assert folder.is_dir() and not list(folder.iterdir())


def test_plot_into_a_folder_that_refuses_files_fails_before_simulating(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a read-only folder does, also where the tests run as root."""
    _no_simulation(monkeypatch)

    def refuse(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("adaptdl.sim.plots.tempfile.NamedTemporaryFile", refuse)
    folder = str(tmp_path)
    assert main(["compare", "--plot", folder]) == 2
    assert capsys.readouterr().err == (
        f"adaptdl-sim: error: --plot: cannot write into directory {folder!r}: Permission denied\n"
    )
