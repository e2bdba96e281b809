"""The live scheduler on a local Ray cluster of simulated nodes (declared GPUs, no
dashboard): jobs placed by placement groups, resized, picked up by a restarted
scheduler without restarting, and moved off a removed node. Each test stops every
Ray process it started (the cluster's own, by their handles)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402
from tests.sched.live.driving import events, run_until  # noqa: E402

from adaptdl.sched.record import JobSpec, Status  # noqa: E402
from adaptdl.sched.scheduler import Scheduler  # noqa: E402

JOB = str(Path(__file__).with_name("emulated_job.py"))


NODES = 2


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """One cluster for the module: a head and `NODES` simulated nodes (starting one
    takes most of a test's time). Each test leaves it as it found it (`cluster`)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_USAGE_STATS_ENABLED", "0")
        c = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "num_gpus": 0, "include_dashboard": False},
        )
        try:
            for _ in range(NODES):
                c.add_node(num_cpus=2, num_gpus=2)
            c.wait_for_nodes()
            ray.init(address=c.address, namespace="adaptdl", log_to_driver=False)
            yield c
        finally:
            ray.shutdown()
            c.shutdown()  # every process the cluster started, by its handle


@pytest.fixture
def cluster(ray_cluster: Any) -> Iterator[Any]:
    """The module's cluster, idle, with `NODES` nodes; a node a test removed is
    replaced after it, and nothing a test placed outlives it."""
    yield ray_cluster
    while len(ray_cluster.worker_nodes) < NODES:
        ray_cluster.add_node(num_cpus=2, num_gpus=2)
    ray_cluster.wait_for_nodes()
    # Every job of the test ended (its placement groups removed, which the GCS may
    # finish a moment later): the next test sees the whole cluster free.
    from ray.util import placement_group_table

    deadline = time.monotonic() + 30.0
    while live := [g for g in placement_group_table().values() if g["state"] != "REMOVED"]:
        assert time.monotonic() < deadline, live
        time.sleep(0.2)


def _backend() -> Any:
    from adaptdl.sched.rayengine import RayBackend

    return RayBackend(launch_timeout=60.0)


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


def test_jobs_run_resize_and_finish_on_ray(cluster: Any, tmp_path: Path) -> None:
    sched = Scheduler(_backend(), tmp_path, interval=1.0, restart_penalty=1.0)
    sched.submit(_spec("a", "--samples", "1024", hi=4))
    _run(sched, lambda: any(e["event"] == "resized" for e in events(sched)))
    sched.submit(_spec("b", "--samples", "512"))
    _run(sched, lambda: all(j.status.done for j in sched.jobs.values()), timeout=300.0)
    assert {j.status for j in sched.jobs.values()} == {Status.SUCCEEDED}
    _exactly_once(sched, "a", 1024)
    _exactly_once(sched, "b", 512)
    assert sched.job("a").restart_costs


def test_a_restarted_scheduler_keeps_its_running_jobs(cluster: Any, tmp_path: Path) -> None:
    first: Scheduler | None = Scheduler(_backend(), tmp_path, interval=1.0)
    assert first is not None
    first.submit(_spec("keep", "--samples", "768", hi=1))
    _run(first, lambda: (first.job("keep").batch_size or 0) > 0)
    launch = first.job("keep").launch
    first = None  # killed: its replicas, detached, run on
    again = Scheduler(_backend(), tmp_path, interval=1.0)
    job = again.job("keep")
    assert job.status is Status.RUNNING and job.launch == launch and job.restarts == 0
    _run(again, lambda: again.job("keep").status.done)
    assert again.job("keep").status is Status.SUCCEEDED and again.job("keep").restarts == 0
    _exactly_once(again, "keep", 768)


def test_a_job_on_a_removed_node_restarts_elsewhere(cluster: Any, tmp_path: Path) -> None:
    sched = Scheduler(_backend(), tmp_path, interval=1.0)
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
