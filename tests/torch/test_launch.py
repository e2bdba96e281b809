"""torchrun_command: the one torchrun command line of tests, faults, experiments and benchmarks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from adaptdl.torch.launch import torchrun_command

RUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def test_a_script_with_its_arguments() -> None:
    assert torchrun_command(Path("/x/train.py"), 3, args=["--a", "1"]) == [
        *RUN,
        "--nproc-per-node=3",
        "--max-restarts=0",
        "/x/train.py",
        "--a",
        "1",
    ]


def test_a_module_with_restarts_and_a_monitor_interval() -> None:
    command = torchrun_command("pkg.worker", 2, module=True, max_restarts=2, monitor_interval=0.5)
    assert command == [
        *RUN,
        "--nproc-per-node=2",
        "--max-restarts=2",
        "--monitor-interval=0.5",
        "-m",
        "pkg.worker",
    ]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nproc": 0}, "nproc must be >= 1, got 0"),
        ({"nproc": 1, "max_restarts": -1}, "max_restarts must be >= 0, got -1"),
        ({"nproc": 1, "monitor_interval": 0.0}, "monitor_interval must be > 0"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        torchrun_command("t.py", **kwargs)  # type: ignore[arg-type]
