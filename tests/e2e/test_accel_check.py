"""The prepared accelerator check's elastic part in its --cpu mode (gloo, 2 processes).

An adaptive job stopped by SIGTERM after a few steps resumes with a fitted model
and a young noise estimate, and re-decides a batch size at the dataset's size
(512 samples): no epoch may lose a sample across the restart.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "accel_check.py"


def test_accel_check_elastic_loses_no_sample_across_a_restart(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("accel_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    accel_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(accel_check)
    try:
        figures = accel_check.check_elastic(2, True, tmp_path)
    except SystemExit as exc:  # the check's verdict on a failure
        pytest.fail(str(exc))
    assert figures["samples_lost"] == 0
    assert figures["replicas"] == 2
