"""End to end: a program in the original's style (adaptdl.env, adaptdl.checkpoint.State,
adaptdl.collective) under torchrun, stopped by SIGTERM at 2 replicas and resumed at 1,
prints the metrics of an uninterrupted run at 2 replicas."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from adaptdl.torch.launch import torchrun_command

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).with_name("train_env_state.py")
RUN_TIMEOUT = 180.0
LINE = re.compile(r"^(ENV|RESTORED|STEP|METRIC|COLLECTIVE) (.*)$")


class Run:
    """One torchrun launch of the program, its output in a log file."""

    def __init__(self, job: Path, name: str, nproc: int, **env: str) -> None:
        self.log = job / f"{name}.log"
        full_env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "ADAPTDL_CHECKPOINT_PATH": str(job / "checkpoints"),
            "ADAPTDL_SHARE_PATH": str(job / "share"),
            "ADAPTDL_JOB_ID": job.name,
            **env,
        }
        (job / "share").mkdir(exist_ok=True)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                torchrun_command(SCRIPT, nproc, monitor_interval=0.5),
                env=full_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def lines(self, kind: str) -> list[dict[str, str]]:
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            match = LINE.match(line.strip())
            if match and match.group(1) == kind:
                rest = match.group(2).split()
                out.append(dict(f.split("=", 1) if "=" in f else ("value", f) for f in rest))
        return out

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"{self.log.name} did not exit:\n{self.output()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    """An uninterrupted run at 2 replicas; another job at 2 replicas, stopped in epoch 1,
    resumed at 1 replica (as restart 1, the way a scheduler says so)."""
    launched: list[Run] = []
    try:
        whole = Run(tmp_path_factory.mktemp("uninterrupted"), "whole", 2)
        launched.append(whole)
        assert whole.wait() == 0, whole.output()

        job = tmp_path_factory.mktemp("stopped")
        first = Run(job, "first", 2)
        launched.append(first)
        deadline = time.monotonic() + RUN_TIMEOUT
        while not any(s["epoch"] == "1" and int(s["index"]) >= 3 for s in first.lines("STEP")):
            if first.proc.poll() is not None:
                pytest.fail(f"the first run ended before it was stopped:\n{first.output()}")
            if time.monotonic() > deadline:
                pytest.fail(f"the first run did not reach epoch 1:\n{first.output()}")
            time.sleep(0.1)
        first.proc.send_signal(signal.SIGTERM)  # torchrun forwards it to the replicas
        assert first.wait() != 0, first.output()

        resumed = Run(job, "resumed", 1, ADAPTDL_NUM_RESTARTS="1")
        launched.append(resumed)
        assert resumed.wait() == 0, resumed.output()
        yield {"whole": whole, "first": first, "resumed": resumed}
    finally:
        for run in launched:
            run.kill()


def test_the_program_reads_its_job_from_adaptdl_env(runs: dict[str, Run]) -> None:
    first, resumed = runs["first"], runs["resumed"]
    job = first.log.parent
    envs = sorted(first.lines("ENV"), key=lambda e: e["rank"])
    assert [e["rank"] for e in envs] == ["0", "1"]
    for e in envs:
        assert (e["replicas"], e["nodes"], e["restarts"]) == ("2", "1", "0")
        assert e["checkpoint_path"] == str(job / "checkpoints")
        assert e["share_path"] == str(job / "share")
        assert e["job_id"] == job.name
    (again,) = resumed.lines("ENV")
    assert (again["rank"], again["replicas"], again["nodes"], again["restarts"]) == (
        "0",
        "1",
        "1",
        "1",
    )


def test_the_state_is_restored_on_resume_only(runs: dict[str, Run]) -> None:
    assert runs["whole"].lines("RESTORED") == [{"value": "False", "steps": "0"}]
    assert runs["first"].lines("RESTORED") == [{"value": "False", "steps": "0"}]
    (restored,) = runs["resumed"].lines("RESTORED")
    assert restored["value"] == "True"
    # Stopped in epoch 1: the counter holds epoch 0's 12 steps and some of epoch 1's (all
    # 12 when the stop was agreed at the epoch's end: these tiny steps agree every k-th
    # boundary, so a stop waits up to two agreements).
    assert 12 < int(restored["steps"]) <= 24


def test_the_stopped_and_resumed_job_prints_the_uninterrupted_metrics(
    runs: dict[str, Run],
) -> None:
    whole = runs["whole"].lines("METRIC")
    pieces = runs["first"].lines("METRIC") + runs["resumed"].lines("METRIC")
    assert [m["epoch"] for m in whole] == ["0", "1", "2", "3"]
    assert [m["epoch"] for m in pieces] == ["0", "1", "2", "3"]
    assert [m["epoch"] for m in runs["first"].lines("METRIC")] == ["0"]
    for expected, got in zip(whole, pieces, strict=True):
        # Counts are exact: every sample once per epoch, summed over replicas by the
        # State's sync, and one optimiser step per batch, through the stop.
        assert (got["samples"], got["steps"]) == (expected["samples"], expected["steps"])
        assert got["samples"] == "96"
        # Same batches, same model: the loss and progress agree up to float rounding
        # (two replicas average their gradients in another order than one does).
        assert float(got["progress"]) == pytest.approx(float(expected["progress"]), rel=1e-6)
        assert float(got["loss"]) == pytest.approx(float(expected["loss"]), rel=1e-4)


def test_the_collectives_reach_every_replica(runs: dict[str, Run]) -> None:
    # Rank 0's value everywhere; lists concatenated in rank order (the original's
    # default reduction); the asynchronous sum of rank + 1.
    whole = sorted(runs["whole"].lines("COLLECTIVE"), key=lambda c: c["rank"])
    assert whole == [
        {"rank": str(r), "broadcast": "from-0", "concatenated": "[0,1]", "sum": "3"}
        for r in (0, 1)
    ]
    assert runs["first"].lines("COLLECTIVE") == []  # stopped before the end
    assert runs["resumed"].lines("COLLECTIVE") == [
        {"rank": "0", "broadcast": "from-0", "concatenated": "[0]", "sum": "1"}
    ]
