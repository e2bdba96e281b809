"""The live scheduler with real replica processes on this machine (``LocalBackend``):
jobs grown and shrunk by pollux rounds, each sample of each pass consumed exactly once
across resizes, graceful stops, failures, and a scheduler restarted mid-run."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tests.sched.live.driving import events, run_until

from adaptdl.sched.local import LocalBackend
from adaptdl.sched.record import JobSpec, Status
from adaptdl.sched.scheduler import Scheduler

JOB = str(Path(__file__).with_name("emulated_job.py"))


@pytest.fixture
def backend() -> Iterator[LocalBackend]:
    b = LocalBackend(gpus=2, cpus=2)
    yield b
    b.close()  # every replica this test started, by its own pid


def _spec(name: str, *args: str, lo: int = 1, hi: int = 2, failures: int = 3) -> JobSpec:
    return JobSpec(
        name=name,
        command=(sys.executable, JOB, *args),
        min_replicas=lo,
        max_replicas=hi,
        cpus_per_replica=0.5,
        max_failures=failures,
    )


def _run(sched: Scheduler, done: Callable[[], bool], timeout: float = 120.0) -> None:
    run_until(sched, done, timeout, poll=0.1)


def _assert_exactly_once(sched: Scheduler, name: str, samples: int, epochs: int) -> None:
    state = json.loads((Path(sched.job(name).checkpoint_path) / "emulated.json").read_text())
    for epoch in range(epochs):
        seen: list[int] = []
        for e, start, end in state["consumed"]:
            if e == epoch:
                seen.extend(range(start, end))
        assert sorted(seen) == list(range(samples)), f"{name} epoch {epoch}"


def test_jobs_are_resized_by_rounds_and_consume_every_sample_once(
    backend: LocalBackend, tmp_path: Path
) -> None:
    sched = Scheduler(backend, tmp_path, interval=1.0, restart_penalty=1.0, policy="pollux")
    sched.submit(_spec("a", "--samples", "1024", "--epochs", "2"))
    _run(sched, lambda: any(e["event"] == "resized" for e in events(sched)))
    sched.submit(_spec("b", "--samples", "512", "--epochs", "2"))
    _run(sched, lambda: all(j.status.done for j in sched.jobs.values()), timeout=240.0)
    assert [j.status for j in sched.jobs.values()] == [Status.SUCCEEDED] * 2
    _assert_exactly_once(sched, "a", 1024, 2)
    _assert_exactly_once(sched, "b", 512, 2)
    a = sched.job("a")
    assert a.restarts >= 1 and a.restart_costs  # measured, fed to later rounds
    # Each cost spans at least its stop and relaunch: from the resize asked to the
    # launch at the new size, and on to the first step there.
    ours = [e for e in events(sched) if e.get("job") == "a"]
    for i, e in enumerate(ours):
        if e["event"] == "resized":
            asked = max(x["time"] for x in ours[:i] if x["event"] == "resize")
            launched = max(x["time"] for x in ours[:i] if x["event"] == "launch")
            assert launched > asked and e["cost"] >= launched - asked
    resizes = [e for e in events(sched) if e["event"] == "resize" and e["job"] == "a"]
    assert {e["after"] for e in resizes} >= {2}


def test_a_failing_job_is_restarted_up_to_its_limit_then_failed(
    backend: LocalBackend, tmp_path: Path
) -> None:
    sched = Scheduler(backend, tmp_path, interval=1.0)
    sched.submit(_spec("bad", "--fail-after", "2", hi=1, failures=2))
    _run(sched, lambda: sched.job("bad").status.done)
    job = sched.job("bad")
    assert job.status is Status.FAILED and job.failures == 3
    assert "failures" in job.message


def test_a_stopped_job_checkpoints_and_is_stopped(backend: LocalBackend, tmp_path: Path) -> None:
    sched = Scheduler(backend, tmp_path, interval=1.0)
    sched.submit(_spec("long", "--samples", "100000", hi=1))
    _run(sched, lambda: sched.job("long").batch_size is not None)
    sched.stop("long")
    _run(sched, lambda: sched.job("long").status.done)
    job = sched.job("long")
    assert job.status is Status.STOPPED and job.failures == 0
    assert (Path(job.checkpoint_path) / "emulated.json").exists()


def test_a_restarted_scheduler_resumes_its_jobs_from_their_checkpoints(
    backend: LocalBackend, tmp_path: Path
) -> None:
    sched = Scheduler(backend, tmp_path, interval=1.0)
    sched.submit(_spec("r", "--samples", "768", hi=1))
    _run(sched, lambda: (sched.job("r").batch_size or 0) > 0)
    backend.close()  # the scheduler's processes die with it
    again = Scheduler(backend, tmp_path, interval=1.0)
    assert again.job("r").status is Status.PENDING and again.job("r").restarts == 1
    _run(again, lambda: again.job("r").status.done)
    assert again.job("r").status is Status.SUCCEEDED
    _assert_exactly_once(again, "r", 768, 2)


def test_bad_submissions_are_refused_naming_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="min_replicas=3 is above max_replicas=2"):
        _spec("x", lo=3, hi=2)
    with pytest.raises(ValueError, match="give a program"):
        JobSpec(name="x", command=())
    with pytest.raises(ValueError, match="job name 'Bad_Name'"):
        JobSpec(name="Bad_Name", command=("true",))
    sched = Scheduler(LocalBackend(gpus=1), tmp_path)
    sched.submit(JobSpec(name="x", command=("true",)))
    with pytest.raises(ValueError, match="'x' is taken"):
        sched.submit(JobSpec(name="x", command=("true",)))
    with pytest.raises(KeyError, match="no job named 'y'"):
        sched.stop("y")


def test_a_job_relaunched_at_a_new_size_keeps_it_until_it_steps_there(
    backend: LocalBackend, tmp_path: Path
) -> None:
    sched = Scheduler(backend, tmp_path, interval=1.0, restart_penalty=1.0, policy="pollux")
    sched.submit(_spec("a", "--samples", "4096", "--epochs", "1"))

    def launches() -> int:
        return sum(1 for e in events(sched) if e["event"] == "launch" and e["job"] == "a")

    _run(sched, lambda: launches() == 2)  # relaunched at 2 replicas, not stepping yet
    assert len(sched.job("a").node_ids) == 2 and "a" in sched._resize_from
    # A newcomer and a round at once: the relaunched job is left alone (a stop now
    # would reach a program still starting), and its GPUs are not the round's.
    sched.submit(_spec("b", "--samples", "64", "--epochs", "1", hi=1))
    sched.run_round()
    assert sched.job("a").stop_requested is None and sched.job("b").node_ids == []
    _run(sched, lambda: "a" not in sched._resize_from)  # it stepped at 2
    _run(sched, lambda: sched.job("b").status.done, timeout=180.0)
    assert sched.job("b").status is Status.SUCCEEDED
    assert sched.job("a").failures == 0


def test_a_relaunch_slower_than_the_stop_timeout_is_charged_what_it_took(
    backend: LocalBackend, tmp_path: Path
) -> None:
    # Each launch of "a" takes 4 s before it can step (still starting), four times the
    # stop timeout: past it, "a" is back in the rounds before it has stepped at its new
    # size. The policy must then see a restart cost of at least the time that resize
    # has taken (not the penalty, since no restart of "a" ever finished), and a resize
    # that overtakes it must keep that time as one of the job's restart costs.
    sched = Scheduler(
        backend, tmp_path, interval=1.0, restart_penalty=1.0, stop_timeout=1.0, policy="pollux"
    )
    sched.submit(_spec("a", "--samples", "4096", "--epochs", "1", "--start-delay", "4"))
    job = sched.job("a")
    _run(sched, lambda: sum(e["event"] == "launch" for e in events(sched)) == 2)
    since = sched._resize_from["a"]
    _run(sched, lambda: time.time() - since > 2.0)
    assert "a" in sched._resize_from and job.restart_costs == []  # not stepped at 2 yet
    now = time.time()
    assert sched._restart_cost(job, now) >= now - since > 2.0
    # A newcomer: the round that starts it takes a GPU from "a" before "a" stepped.
    sched.submit(_spec("b", "--samples", "64", "--epochs", "1", hi=1))
    _run(sched, lambda: any(e["event"] == "resize-unfinished" for e in events(sched)))
    unfinished = next(e for e in events(sched) if e["event"] == "resize-unfinished")
    assert unfinished["job"] == "a" and unfinished["cost"] > 2.0
    assert job.restart_costs == [unfinished["cost"]]
    resize = next(e for e in events(sched) if e["event"] == "resize" and e["after"] == 1)
    assert float(resize["why"].split("restart cost ")[1].split(" s")[0]) >= 2.0  # "%.1f"
    _run(sched, lambda: job.status.done and sched.job("b").status.done, timeout=180.0)
    assert job.status is Status.SUCCEEDED and job.failures == 0
    _assert_exactly_once(sched, "a", 4096, 1)


def test_a_job_killed_by_the_stop_before_its_handler_is_preempted_not_failed(
    backend: LocalBackend, tmp_path: Path
) -> None:
    # A resize's SIGTERM can reach a program before it installs its handler (still
    # importing, on a loaded node): it dies of the signal (-15) having written
    # nothing. That is the stop the scheduler asked for, not a crash: the job resumes
    # from its last checkpoint and no failure is counted.
    sched = Scheduler(backend, tmp_path, interval=1.0, policy="pollux")
    sched.submit(_spec("a", "--samples", "256", "--epochs", "1", "--start-delay", "3", hi=1))
    _run(sched, lambda: sched.job("a").status is Status.RUNNING)
    job = sched.job("a")
    job.target = list(job.node_ids)  # a resize to where it is: the stop is what matters
    sched._request_stop(job, time.time(), "resize")
    _run(sched, lambda: job.stop_requested is None)
    stopped = [e for e in events(sched) if e["event"] in ("failure", "launch")]
    assert job.failures == 0, stopped
    _run(sched, lambda: job.status.done, timeout=120.0)
    assert job.status is Status.SUCCEEDED and job.failures == 0
    _assert_exactly_once(sched, "a", 256, 1)
