"""End to end: real adaptdl.torch jobs (gloo, CPU) under the live scheduler.

Three tiny training jobs (`torch_job.py`) are submitted to a pollux scheduler on 3
declared GPUs (plain processes, ``LocalBackend``), one after another, so that each
is grown or shrunk as the others arrive and finish. The jobs publish their own
hints and progress (core's jobreport): the scheduler sizes them from those, measures
each resize's cost from them, and each job finishes having consumed every sample
of every pass exactly once (padding aside) across its resizes. The test stops
every replica it started (the backend's, by their pids).
"""

from __future__ import annotations

import collections
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tests.sched.live.driving import events, run_until

from adaptdl.sched.backend import Backend
from adaptdl.sched.local import LocalBackend
from adaptdl.sched.record import JobSpec, Status
from adaptdl.sched.scheduler import Scheduler

JOB = str(Path(__file__).with_name("torch_job.py"))
N = 256
EPOCHS = {"a": 3, "b": 5, "c": 8}  # per job


@pytest.fixture
def backend() -> Iterator[LocalBackend]:
    b = LocalBackend(gpus=3, cpus=2)
    yield b
    b.close()  # every replica this test started, by its own pid


def _spec(name: str, records: Path, epochs: int, env: dict[str, str]) -> JobSpec:
    return JobSpec(
        name=name,
        command=(sys.executable, JOB),
        min_replicas=1,
        max_replicas=3,
        cpus_per_replica=0.5,
        env={
            "OMP_NUM_THREADS": "1",
            "SCHED_E2E_RECORDS": str(records),
            "SCHED_E2E_EPOCHS": str(epochs),
            "ADAPTDL_REPORT_INTERVAL": "1",
            **env,
        },
    )


def _run(sched: Scheduler, done: Callable[[], bool], timeout: float) -> None:
    run_until(sched, done, timeout)


def _resized(sched: Scheduler, name: str) -> int:
    return sum(1 for e in events(sched) if e["event"] == "resized" and e.get("job") == name)


def test_real_torch_jobs_are_resized_by_pollux_and_consume_every_sample_once(
    backend: LocalBackend, tmp_path: Path
) -> None:
    three_jobs_resized_and_consumed_once(backend, tmp_path)


def three_jobs_resized_and_consumed_once(
    backend: Backend, tmp_path: Path, env: dict[str, str] | None = None
) -> None:
    """Three real jobs under pollux on ``backend``, each resized at least once and
    consuming every sample of every pass exactly once; ``env`` added to each job's."""
    records = tmp_path / "records"
    records.mkdir()
    sched = Scheduler(
        backend, tmp_path / "sched", interval=1.0, restart_penalty=1.0, policy="pollux"
    )
    # Each arrives once the one before was resized, and runs longer than it, so that
    # each is grown (or shrunk) at least once: a grows alone and shrinks for the
    # others, b and c grow as those before them finish.
    for name in EPOCHS:
        sched.submit(_spec(name, records, EPOCHS[name], env or {}))
        # It publishes a fitted profile by itself, and pollux resizes it.
        _run(sched, lambda n=name: _resized(sched, n) >= 1 or sched.job(n).status.done, 240.0)
        assert sched.job(name).hints["perf_params"] is not None
    _run(sched, lambda: all(j.status.done for j in sched.jobs.values()), timeout=240.0)
    assert [j.status for j in sched.jobs.values()] == [Status.SUCCEEDED] * 3, sched.rows()
    for name in "abc":
        job = sched.job(name)
        assert _resized(sched, name) >= 1, f"{name} was never resized: {events(sched)}"
        failures = [e for e in events(sched) if e["event"] == "failure" and e["job"] == name]
        assert job.restart_costs and job.failures == 0, failures
        sizes = consumed_once(records, name, EPOCHS[name])
        assert len(sizes) >= 2, f"{name} ran at one size only: {sizes}"


def consumed_once(records: Path, name: str, epochs: int) -> set[int]:
    """Check job ``name``'s records: every sample of every pass consumed once, over
    ``epochs`` epochs, across its launches; returns the replica counts it ran at."""
    consumed: dict[tuple[int, int], collections.Counter[int]] = collections.defaultdict(
        collections.Counter
    )
    sizes = set()
    for path in records.glob(f"{name}-*.jsonl"):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            sizes.add(r["replicas"])
            consumed[r["epoch"], r["pass"]].update(
                i for i, pad in zip(r["indices"], r["padding"], strict=True) if not pad
            )
    assert sorted({e for e, _ in consumed}) == list(range(epochs)), name
    for (epoch, pass_), counts in consumed.items():
        # No sample twice in a pass; every pass but an epoch's last (an adaptive
        # epoch ends at a step boundary after at least one pass) is whole.
        assert max(counts.values()) == 1, f"{name} epoch {epoch} pass {pass_}: {counts}"
        if (epoch, pass_ + 1) in consumed or pass_ == 0:
            assert sorted(counts) == list(range(N)), f"{name} epoch {epoch} pass {pass_}"
    return sizes
