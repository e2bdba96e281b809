"""Real adaptdl.torch jobs (gloo, CPU) under the live scheduler on a local Ray cluster.

The Ray side of `test_torch_jobs.py`: replicas placed by placement groups on two
simulated nodes (declared GPUs), launched by the Ray backend's detached actors with
the environment torchrun would give them. Three jobs are each resized by the
scheduler at least once and consume every sample of every pass exactly once across
their resizes (the same scenario as on the local backend); a job that crashes is
restarted from its checkpoint up to its failure limit, then failed. The cluster
fixture (conftest's) stops every Ray process it started.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray")
from tests.sched.live.driving import ray_backend, run_until
from tests.sched.live.test_torch_jobs import JOB, three_jobs_resized_and_consumed_once

from adaptdl.sched.record import JobSpec, Status
from adaptdl.sched.scheduler import Scheduler


def _spec(name: str, records: Path, *, hi: int, failures: int = 3, **env: str) -> JobSpec:
    return JobSpec(
        name=name,
        command=(sys.executable, JOB),
        min_replicas=1,
        max_replicas=hi,
        cpus_per_replica=0.5,
        max_failures=failures,
        env={
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(sys.path),
            "SCHED_E2E_RECORDS": str(records),
            "ADAPTDL_REPORT_INTERVAL": "1",
            **env,
        },
    )


def test_real_torch_jobs_are_resized_on_ray_and_consume_every_sample_once(
    cluster: Any, tmp_path: Path
) -> None:
    # The replicas are started by Ray's workers: they find the tests' modules (the
    # records' writer) through PYTHONPATH.
    three_jobs_resized_and_consumed_once(
        ray_backend(), tmp_path, {"PYTHONPATH": os.pathsep.join(sys.path)}
    )


def test_a_real_job_that_crashes_is_restarted_then_failed_on_ray(
    cluster: Any, tmp_path: Path
) -> None:
    records = tmp_path / "records"
    records.mkdir()
    sched = Scheduler(ray_backend(), tmp_path / "sched", interval=1.0)
    sched.submit(_spec("bad", records, hi=1, failures=1, SCHED_E2E_FAIL_AFTER="3"))
    run_until(sched, lambda: sched.job("bad").status.done, 240.0, poll=0.2)
    job = sched.job("bad")
    assert job.status is Status.FAILED and job.failures == 2, sched.rows()
    assert "failures" in job.message
