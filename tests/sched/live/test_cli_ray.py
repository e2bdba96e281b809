"""The operator's quick start as written: ``adaptdl scheduler start`` (a local Ray head
of its own), submit, ls, logs, wait, and ``scheduler stop``, which stops that head by
its pid. Runs the console as a user would, in subprocesses."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("ray")

JOB = str(Path(__file__).with_name("emulated_job.py"))
ADAPTDL = str(Path(sys.executable).with_name("adaptdl"))


def _cli(storage: Path, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ADAPTDL_STORAGE": str(storage), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run(
        [ADAPTDL, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture
def storage(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    marker = tmp_path / "started-ray.json"
    if marker.exists():  # the test failed before 'scheduler stop': stop the head it started
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(json.loads(marker.read_text())["pid"]), signal.SIGTERM)


@pytest.mark.skipif(
    Path("/tmp/ray/ray_current_cluster").exists()
    and subprocess.run(["pgrep", "-x", "gcs_server"], capture_output=True).returncode == 0,
    reason="a Ray cluster already runs on this machine",
)
def test_the_quick_start_as_written(storage: Path) -> None:
    assert _cli(storage, "ls").returncode == 2  # no scheduler yet: one line, status 2
    started = _cli(storage, "scheduler", "start", "--num-gpus", "2", "--interval", "5")
    assert started.returncode == 0, started.stderr
    try:
        submit = _cli(
            storage, "submit", "--name", "quick", "--max-replicas", "2",
            "--cpus-per-replica", "0.5", "--", sys.executable, JOB, "--samples", "512",
        )  # fmt: skip
        assert submit.returncode == 0 and submit.stdout.strip() == "quick", submit.stderr
        waited = _cli(storage, "wait", "quick", "--timeout", "240")
        assert waited.returncode == 0, waited.stderr
        rows = json.loads(_cli(storage, "ls", "--json").stdout)
        assert [(r["name"], r["status"]) for r in rows] == [("quick", "Succeeded")]
        assert set(rows[0]) == {
            "name", "status", "replicas", "nodes", "batch_size", "speedup", "restarts",
            "submitted", "started", "finished",
        }  # fmt: skip
        assert _cli(storage, "logs", "quick").returncode == 0
        assert _cli(storage, "stop", "nope").returncode == 2
    finally:
        stopped = _cli(storage, "scheduler", "stop")
    assert stopped.returncode == 0, stopped.stderr
    assert not (storage / "started-ray.json").exists()
    assert _cli(storage, "ls").returncode == 2
