"""The prepared accelerator check stays runnable on machines without a GPU.

Its --cpu mode runs the very code a GPU machine runs, with gloo and 2 processes: an
adaptive job stopped by SIGTERM after a few steps resumes with a fitted model and a
young noise estimate, and re-decides a batch size at the dataset's size (512
samples); no epoch may lose a sample across the restart (this found a real fault).
The same job runs again with the model sharded by FSDP2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "accel_check.py"


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_without_cuda_the_check_skips_cleanly() -> None:
    done = _run(timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        "accelerator check skipped: no CUDA device (torch.cuda.is_available() is False)"
    )


@pytest.mark.e2e
def test_cpu_mode_runs_the_same_checks_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    done = _run("--cpu", "--quick", f"--out={out}", timeout=700)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["processes"] == 2
    assert figures["elastic"]["samples_lost"] == 0
    assert figures["elastic"]["replicas"] == 2
    # The same with the model sharded by FSDP2, checkpointed as DCP shards.
    assert figures["elastic_fsdp"]["samples_lost"] == 0
    assert figures["elastic_fsdp"]["model"] == "FSDP2"
    speed = figures["speed"]
    assert speed["adp_over_ddp_step_time_best"] > 0
    assert speed["loader_throughput_ratio_best"] > 0
