"""A live scheduler's event log replayed by the simulator (`workload_from_events`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adaptdl.sched.policies import make_policy
from adaptdl.sim.apps import ParametricApplication
from adaptdl.sim.cluster import ClusterConfig, simulate
from adaptdl.sim.traces import TraceError
from adaptdl.sim.workload import JobSpec, workload_from_events


def _app(name: str) -> ParametricApplication:
    return ParametricApplication(name, 32, 1024, (8, 128), 2048, 2)


def _write(path: Path, events: list[dict]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def test_arrivals_become_jobs_at_their_offsets(tmp_path: Path) -> None:
    log = _write(
        tmp_path / "events.jsonl",
        [
            {"time": 100.0, "event": "arrival", "job": "b", "max_replicas": 2},
            {"time": 100.5, "event": "launch", "job": "b", "replicas": 1},
            {"time": 103.0, "event": "arrival", "job": "a", "max_replicas": 4},
            {"time": 110.0, "event": "completion", "job": "b", "status": "Succeeded"},
        ],
    )
    apps = {"a": _app("a"), "b": _app("b")}
    jobs = workload_from_events(log, apps)
    assert jobs == [JobSpec("b", 0.0, "b", 2, 32), JobSpec("a", 3.0, "a", 4, 32)]
    result = simulate(
        jobs, apps, make_policy("pollux"), ClusterConfig(num_nodes=1, gpus_per_node=4)
    )
    assert sorted(j.name for j in result.jobs) == ["a", "b"]
    assert all(j.finish is not None for j in result.jobs)


def test_a_bad_log_names_the_line(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    log.write_text('{"time": 1, "event": "arrival", "job": "a", "max_replicas": 1}\n{oops\n')
    with pytest.raises(TraceError, match=r"events\.jsonl:2: not a JSON event"):
        workload_from_events(log, {"a": _app("a")})
    _write(log, [{"time": 1, "event": "arrival", "job": "x", "max_replicas": 1}])
    with pytest.raises(TraceError, match="no application model for job 'x'"):
        workload_from_events(log, {"a": _app("a")})
    _write(log, [{"time": 1, "event": "arrival", "job": "a"}])
    with pytest.raises(TraceError, match=r"events\.jsonl:1: arrival of 'a' has no 'max_replicas'"):
        workload_from_events(log, {"a": _app("a")})
    _write(log, [])
    assert workload_from_events(log, {}) == []
