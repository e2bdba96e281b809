"""Item 3's table (`experiments.autoscale_vs_fixed`): what it prints for a run
that misses its target.

A run that misses its target went on to its end, the progress cap or a divergence:
its row shows the progress it reached there and why it ended, never a progress of 0.
"""

from __future__ import annotations

from typing import Any

from experiments.autoscale_vs_fixed import study as avf
from hypothesis import given
from hypothesis import strategies as st


def result(
    label: str, progress: float, *, reached_at: float | None, diverged: bool = False
) -> dict[str, Any]:
    """A run's result as the trainer writes it, with two optimiser steps."""
    # (progress, batch, local batch, accumulation, gain, lr factor, loss, goodput, seconds)
    steps = [
        [progress / 2, 16, 8, 0, 1.0, 1.0, 1.0, 0.0, 1.0],
        [progress, 64, 32, 0, 3.0, 3.0, 0.5, 0.0, 2.0],
    ]
    reached = None
    if reached_at is not None:
        reached = {
            "seconds": 2.0,
            "cpu_seconds": 1.5,
            "progress": reached_at,
            "samples": 96,
            "steps": 2,
        }
    return {
        "label": label,
        "steps": steps,
        "reached": reached,
        "progress": progress,
        "diverged": diverged,
        "val_acc": 0.9,
        "config": {"stop_at_target": label != "adaptive"},
    }


def adaptive_line(results: list[dict[str, Any]]) -> str:
    text = avf.table(avf.summarise(results), 0.94)
    return next(line for line in text.splitlines() if line.startswith("| adaptive |"))


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip("|").split("|")]


@given(
    progress=st.floats(min_value=1.0, max_value=1e6, allow_nan=False),
    diverged=st.booleans(),
)
def test_a_missed_target_shows_the_progress_reached_and_why_the_run_ended(
    progress: float, diverged: bool
) -> None:
    runs = [
        result("adaptive", progress, reached_at=None, diverged=diverged),
        result("fixed 64", 300.0, reached_at=300.0),
    ]
    row = cells(adaptive_line(runs))
    assert row[1] == "not reached"
    end = "diverged" if diverged else "cap"
    assert row[3] == f"{progress:.0f} at its end ({end})"


def test_a_reached_target_shows_the_progress_at_it() -> None:
    runs = [
        result("adaptive", 5120.0, reached_at=2649.4),
        result("fixed 64", 300.0, reached_at=300.0),
    ]
    assert cells(adaptive_line(runs))[3] == "2649"


def test_summarise_keeps_the_final_progress_and_the_end() -> None:
    runs = [
        result("adaptive", 5140.6, reached_at=None),
        result("fixed 64", 300.0, reached_at=300.0),
    ]
    row = avf.summarise(runs)["rows"][0]
    assert row["progress"] is None
    assert row["final_progress"] == 5140.6
    assert row["ended"] == "cap"
