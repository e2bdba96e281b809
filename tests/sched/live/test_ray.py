"""The live scheduler on a local Ray cluster of simulated nodes (declared GPUs, no
dashboard): emulated jobs placed by placement groups, picked up by a restarted
scheduler without restarting, and moved off a removed node (resizes of real jobs on
Ray: `test_torch_jobs_ray.py`). The module's one cluster
(conftest) stops every Ray process it started, by their handles."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
from tests.sched.live.driving import events, ray_backend, run_until  # noqa: E402

from adaptdl.sched.record import JobSpec, Status  # noqa: E402
from adaptdl.sched.scheduler import Scheduler  # noqa: E402

JOB = str(Path(__file__).with_name("emulated_job.py"))


def _spec(name: str, *args: str, hi: int = 2) -> JobSpec:
    return JobSpec(
        name=name,
        command=(sys.executable, JOB, *args),
        min_replicas=1,
        max_replicas=hi,
        cpus_per_replica=0.5,
        env={"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)},
    )


def _run(sched: Scheduler, done: Callable[[], bool], timeout: float = 180.0) -> None:
    run_until(sched, done, timeout, poll=0.2)


def _exactly_once(sched: Scheduler, name: str, samples: int, epochs: int = 2) -> None:
    state = json.loads((Path(sched.job(name).checkpoint_path) / "emulated.json").read_text())
    for epoch in range(epochs):
        seen = [i for e, a, b in state["consumed"] if e == epoch for i in range(a, b)]
        assert sorted(seen) == list(range(samples)), f"{name} epoch {epoch}"


def test_a_restarted_scheduler_keeps_its_running_jobs(cluster: Any, tmp_path: Path) -> None:
    first: Scheduler | None = Scheduler(ray_backend(), tmp_path, interval=1.0)
    assert first is not None
    first.submit(_spec("keep", "--samples", "768", hi=1))
    _run(first, lambda: (first.job("keep").batch_size or 0) > 0)
    launch = first.job("keep").launch
    first = None  # killed: its replicas, detached, run on
    again = Scheduler(ray_backend(), tmp_path, interval=1.0)
    job = again.job("keep")
    assert job.status is Status.RUNNING and job.launch == launch and job.restarts == 0
    _run(again, lambda: again.job("keep").status.done)
    assert again.job("keep").status is Status.SUCCEEDED and again.job("keep").restarts == 0
    _exactly_once(again, "keep", 768)


def test_a_job_on_a_removed_node_restarts_elsewhere(cluster: Any, tmp_path: Path) -> None:
    sched = Scheduler(ray_backend(), tmp_path, interval=1.0)
    sched.submit(_spec("moved", "--samples", "768", hi=1))
    _run(sched, lambda: (sched.job("moved").batch_size or 0) > 0)
    node_id = sched.job("moved").node_ids[0]
    node = next(n for n in cluster.worker_nodes if n.node_id == node_id)
    cluster.remove_node(node)
    _run(sched, lambda: sched.job("moved").status.done, timeout=240.0)
    job = sched.job("moved")
    assert job.status is Status.SUCCEEDED and job.restarts >= 1 and job.failures == 0
    assert any(e["event"] == "lost" for e in events(sched))
    _exactly_once(sched, "moved", 768)
