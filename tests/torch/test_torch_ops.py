"""What an operator sees (issue 14): lifecycle lines without any logging configuration,
``ADAPTDL_LOG_LEVEL``, and TensorBoard figures whose steps continue across restarts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import TensorDataset

import adaptdl.torch as adl
import torch
from adaptdl.core.loop.boundary import Preempted
from adaptdl.torch import _context

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = textwrap.dedent(
    """
    import logging, sys
    import torch
    from torch.utils.data import TensorDataset
    import adaptdl.torch as adl

    adl.init_process_group("gloo")
    if sys.argv[1] == "configured-later":
        logging.basicConfig(level=logging.WARNING, format="ROOT %(message)s")
    loader = adl.AdaptiveDataLoader(TensorDataset(torch.arange(24)), batch_size=4)
    for epoch in adl.remaining_epochs_until(int(sys.argv[2])):
        for (batch,) in loader:
            pass
    print("steps", adl.global_step())
    """
)


def run_program(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(PROGRAM)
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ADAPTDL_", "RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC_"))
    }
    environ.update(
        ADAPTDL_CHECKPOINT_PATH=str(tmp_path / "ckpt"), ADAPTDL_CHECKPOINT_STEPS="4", **env
    )
    command = [sys.executable, str(script), *args]
    options: dict[str, Any] = {"env": environ, "cwd": ROOT, "capture_output": True, "text": True}
    return subprocess.run(command, timeout=240, **options)


def lifecycle(stderr: str) -> list[str]:
    return [line.split(": ", 1)[1] for line in stderr.splitlines() if " adaptdl INFO: " in line]


def test_a_fresh_program_shows_its_lifecycle_without_configuring_logging(tmp_path: Path) -> None:
    first = run_program(tmp_path, "plain", "1")
    assert first.returncode == 0, first.stderr
    seen = lifecycle(first.stderr)
    assert seen[0] == (
        "adaptdl-dataloader-0 batch size 4 local x 1 micro-batch x 1 replica = 4 per "
        "optimiser step"
    )
    assert any(line.startswith("checkpoint ") and " written in " in line for line in seen)
    assert first.stdout.split() == ["steps", "6"]
    second = run_program(tmp_path, "plain", "2")
    assert second.returncode == 0, second.stderr
    resumed = lifecycle(second.stderr)[0]
    assert resumed.startswith("resumed from checkpoint ") and " at epoch " in resumed
    assert second.stdout.split() == ["steps", "12"]  # continues, not 6 again


def test_the_log_level_variable_hides_the_lines_or_names_a_bad_value(tmp_path: Path) -> None:
    quiet = run_program(tmp_path, "plain", "1", ADAPTDL_LOG_LEVEL="warning")
    assert quiet.returncode == 0, quiet.stderr
    assert lifecycle(quiet.stderr) == [] and "adaptdl" not in quiet.stderr
    bad = run_program(tmp_path, "plain", "1", ADAPTDL_LOG_LEVEL="loud")
    assert bad.returncode != 0
    assert "ADAPTDL_LOG_LEVEL='loud' must be one of DEBUG, INFO, WARNING" in bad.stderr


def test_logging_configured_by_the_program_prints_each_line_once(tmp_path: Path) -> None:
    result = run_program(tmp_path, "configured-later", "1")
    assert result.returncode == 0, result.stderr
    assert lifecycle(result.stderr) == []  # our handler stood aside
    batch_lines = [line for line in result.stderr.splitlines() if "batch size 4 local" in line]
    # Logged before basicConfig: ours printed it; nothing after prints twice.
    assert len(batch_lines) == 1
    assert sum(line.startswith("ROOT checkpoint ") for line in result.stderr.splitlines()) >= 1


def test_tensorboard_gets_job_figures_and_the_step_continues_after_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: Any
) -> None:
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path))
    dataset = TensorDataset(torch.arange(20))

    def run(stop_at: int | None) -> adl.AdaptiveDataLoader:
        adl.init_process_group("gloo")
        loader = adl.AdaptiveDataLoader(dataset, batch_size=2)
        for _ in adl.remaining_epochs_until(1):
            for (batch,) in loader:
                if stop_at is not None and int(batch[0]) == stop_at:
                    _context.current_job().request_stop()
        return loader

    with pytest.raises(Preempted):
        run(stop_at=6)  # stops two steps later, at the boundary after the agreement
    stopped_at = adl.global_step()
    assert 0 < stopped_at < 10
    _context._reset()
    monkeypatch.setenv("ADAPTDL_NUM_RESTARTS", "1")
    loader = run(stop_at=None)
    assert adl.global_step() == 10  # 20 samples at 2 a step, across both runs
    loader.to_tensorboard(writer)
    assert writer.scalars["Job/global_step"] == (10.0, 10)
    assert writer.scalars["Job/replicas"] == (1.0, 10)
    assert writer.scalars["Job/restarts"] == (1.0, 10)
    rate, step = writer.scalars["Job/samples_per_second"]
    assert rate > 0 and step == 10
    assert writer.scalars["Data/total_batch_size"] == (2.0, 10)
    loader.to_tensorboard(writer, 3, "t")  # an explicit step still wins
    assert writer.scalars["t/Job/global_step"] == (10.0, 3)


def test_persistent_workers_start_once_for_all_passes() -> None:
    """persistent_workers=True is honoured: passes reuse the workers (and exactly once holds)."""
    from tests.torch.test_bench_loader import _load_benchmark

    starts = _load_benchmark().WorkerStarts()  # the benchmark's own counter of worker starts
    loader = adl.AdaptiveDataLoader(
        TensorDataset(torch.arange(30)),
        batch_size=4,
        shuffle=True,
        num_workers=2,
        persistent_workers=True,
        worker_init_fn=starts,
    )
    for _ in adl.remaining_epochs_until(3):
        seen = sorted(int(i) for (batch,) in loader for i in batch)
        assert seen == list(range(30))
    assert starts.value == 2
