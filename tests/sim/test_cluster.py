"""Cluster simulation: determinism, metrics, workloads, and the measured traces."""

from __future__ import annotations

from pathlib import Path

import pytest

from adaptdl.sched.policies import make_policy
from adaptdl.sim.apps import builtin_applications
from adaptdl.sim.cluster import ClusterConfig, simulate
from adaptdl.sim.traces import TraceError
from adaptdl.sim.workload import JobSpec, read_workload, synthetic_workload

APPS = builtin_applications()


def _run(policy: str, seed: int, mtbf: float = 0.0) -> dict:
    jobs = synthetic_workload(APPS, 8, duration=1800.0, seed=seed, max_replicas=8)
    config = ClusterConfig(num_nodes=4, node_mtbf=mtbf, seed=seed)
    out = simulate(jobs, APPS, make_policy(policy), config).to_json(history=True)
    # The policy's CPU time per round is measured, not simulated: it varies run to run.
    del out["max_round_seconds"], out["mean_round_seconds"]
    return out


@pytest.mark.parametrize("policy", ["pollux", "tiresias", "adaptdl"])
def test_same_seed_same_result(policy: str) -> None:
    assert _run(policy, 3, mtbf=4000.0) == _run(policy, 3, mtbf=4000.0)


def test_different_failure_seed_changes_the_result() -> None:
    assert _run("fifo", 3, mtbf=2000.0) != _run("fifo", 4, mtbf=2000.0)


def test_result_json_has_the_documented_top_level() -> None:
    out = _run("fifo", 0)
    for key in ("policy", "avg_jct", "p50_jct", "p99_jct", "makespan", "jobs"):
        assert key in out
    job = out["jobs"][0]
    for key in ("name", "submit", "finish", "jct", "restarts"):
        assert key in job
    assert job["jct"] == pytest.approx(job["finish"] - job["submit"])


def test_completion_matches_the_analytic_time_of_a_lone_job() -> None:
    app = APPS["resnet-small"]
    spec = JobSpec("solo", 0.0, app.name, 4, 256)
    result = simulate([spec], APPS, make_policy("fifo"), ClusterConfig(num_nodes=1))
    # Fixed job: 4 GPUs, local 64, starts at round 0 after the 30 s restart.
    step, _ = app.iteration_time((4,), 64, 0)
    expected = 30.0 + sum(
        (app.epoch_progress[e] - (app.epoch_progress[e - 1] if e else 0.0))
        / (app.gain(256, e) / step)
        for e in range(app.num_epochs)
    )
    assert result.jobs[0].finish == pytest.approx(expected, rel=1e-9)


def test_failures_cost_restarts_and_lose_progress() -> None:
    calm = _run("fifo", 5)
    stormy = _run("fifo", 5, mtbf=1500.0)
    assert sum(j["failures"] for j in stormy["jobs"]) > 0
    assert stormy["avg_jct"] > calm["avg_jct"]


def test_max_time_leaves_jobs_unfinished() -> None:
    jobs = synthetic_workload(APPS, 6, seed=1)
    result = simulate(jobs, APPS, make_policy("fifo"), ClusterConfig(max_time=600.0))
    assert result.unfinished > 0


def test_workload_unknown_application_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "w.csv"
    path.write_text(
        "name,time,application,num_replicas,batch_size\na,0,resnet-small,1,128\nb,5,mnist,1,128\n"
    )
    with pytest.raises(TraceError, match=r"w\.csv:3: unknown application 'mnist'"):
        read_workload(path, APPS)


def test_workload_bad_number_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "w.csv"
    path.write_text("name,time,application,num_replicas,batch_size\na,soon,resnet-small,1,128\n")
    with pytest.raises(TraceError, match=r"w\.csv:2: column 'time': bad number 'soon'"):
        read_workload(path, APPS)


def test_workload_missing_column_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "w.csv"
    path.write_text("name,time,application,batch_size\na,0,resnet-small,128\n")
    with pytest.raises(TraceError, match=r"w\.csv:1: missing column.*num_replicas"):
        read_workload(path, APPS)


def test_measured_workload_runs_under_every_policy(pollux_dir: Path, trace_apps: dict) -> None:
    jobs = read_workload(pollux_dir / "workloads" / "workload-1.csv", trace_apps)
    assert len(jobs) == 160
    early = [j for j in jobs if j.submit < 1200]
    results = {p: simulate(early, trace_apps, make_policy(p)) for p in ("pollux", "tiresias")}
    for r in results.values():
        assert r.unfinished == 0
    # Goodput-driven scheduling beats least-attained-service on these jobs.
    assert results["pollux"].avg_jct < results["tiresias"].avg_jct
