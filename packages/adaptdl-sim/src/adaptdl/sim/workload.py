"""Workloads: the jobs submitted to a simulated cluster, read from CSV, from a live
scheduler's event log, or generated."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs
import numpy as np

from adaptdl.core.validate import check_float, check_int
from adaptdl.sim.apps import ApplicationModel
from adaptdl.sim.traces import TraceError, parse_float, parse_int, read_table

WORKLOAD_COLUMNS = ("name", "time", "application", "num_replicas", "batch_size")


@attrs.frozen
class JobSpec:
    """One submitted job: what its user asked for (what non-adaptive policies give it)."""

    name: str
    submit: float
    application: str
    num_replicas: int
    batch_size: int

    def __attrs_post_init__(self) -> None:
        if not self.name:
            raise ValueError("job name must not be empty")
        check_float("submit", self.submit, min=0.0)
        check_int("num_replicas", self.num_replicas, min=1)
        check_int("batch_size", self.batch_size, min=1)


def read_workload(path: Path | str, applications: Mapping[str, ApplicationModel]) -> list[JobSpec]:
    """Read a Pollux workload CSV (``name,time,application,num_replicas,batch_size``).

    Raises :class:`TraceError` naming the file and line for a missing column, a bad
    number, a duplicate name or an application not in ``applications``.
    """
    path = Path(path)
    jobs: list[JobSpec] = []
    seen: set[str] = set()
    for line, row in read_table(path, WORKLOAD_COLUMNS):
        name = row["name"]
        if not name or name in seen:
            raise TraceError(path, line, f"job name {name!r} is empty or repeated")
        seen.add(name)
        app = row["application"]
        if app not in applications:
            raise TraceError(
                path, line, f"unknown application {app!r}; known: {sorted(applications)}"
            )
        jobs.append(
            JobSpec(
                name=name,
                submit=parse_float(path, line, "time", row["time"]),
                application=app,
                num_replicas=parse_int(path, line, "num_replicas", row["num_replicas"], min=1),
                batch_size=parse_int(path, line, "batch_size", row["batch_size"], min=1),
            )
        )
    return sorted(jobs, key=lambda j: (j.submit, j.name))


def workload_from_events(
    path: Path | str, applications: Mapping[str, ApplicationModel]
) -> list[JobSpec]:
    """The jobs of a live scheduler's event log (``events.jsonl``), to replay them here.

    Each ``arrival`` event is a job submitted at its offset from the first arrival,
    asking for its ``max_replicas`` (what a non-adaptive policy gives it) at its
    application's initial batch size; ``applications`` names each job's model, by
    job name. Raises :class:`TraceError` naming the file and line for a line that
    is not JSON, an arrival without its fields, or a job with no application.
    """
    path = Path(path)
    arrivals: list[tuple[int, dict[str, object]]] = []
    for line, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not text.strip():
            continue
        try:
            event = json.loads(text)
        except ValueError as exc:
            raise TraceError(path, line, f"not a JSON event: {exc}") from None
        if isinstance(event, dict) and event.get("event") == "arrival":
            arrivals.append((line, event))
    if not arrivals:
        return []
    jobs = []
    times = [t for _, e in arrivals if isinstance(t := e.get("time"), (int, float))]
    start = float(min(times)) if times else 0.0
    for line, event in arrivals:
        name, at, replicas = event.get("job"), event.get("time"), event.get("max_replicas")
        if not isinstance(name, str) or not isinstance(at, (int, float)):
            raise TraceError(path, line, "an arrival needs its 'job' and 'time'")
        if not isinstance(replicas, int):
            raise TraceError(path, line, f"arrival of {name!r} has no 'max_replicas'")
        app = applications.get(name)
        if app is None:
            raise TraceError(path, line, f"no application model for job {name!r}")
        jobs.append(JobSpec(name, float(at) - start, name, replicas, app.init_batch_size))
    return sorted(jobs, key=lambda j: (j.submit, j.name))


def synthetic_workload(
    applications: Mapping[str, ApplicationModel],
    num_jobs: int = 40,
    *,
    duration: float = 4 * 3600.0,
    seed: int = 0,
    max_replicas: int = 16,
) -> list[JobSpec]:
    """Generate ``num_jobs`` jobs arriving uniformly over ``duration`` seconds.

    Each job draws an application, a GPU request (a power of two up to
    ``max_replicas``) and a batch size between the application's initial and
    maximum, deterministically for ``seed``.
    """
    check_int("num_jobs", num_jobs, min=1)
    check_float("duration", duration, min=0.0)
    check_int("max_replicas", max_replicas, min=1)
    if not applications:
        raise ValueError("applications must not be empty")
    rng = np.random.default_rng(seed)
    names: Sequence[str] = sorted(applications)
    times = np.sort(rng.uniform(0.0, duration, size=num_jobs))
    jobs = []
    for i, t in enumerate(times):
        app = applications[names[int(rng.integers(len(names)))]]
        exp = int(rng.integers(0, int(np.log2(max_replicas)) + 1))
        replicas = 2**exp
        lo, hi = app.init_batch_size, app.max_batch_size
        bsz = int(np.clip(lo * 2 ** rng.integers(0, 4), lo, hi))
        bsz = max(bsz, min(hi, replicas * app.local_bsz_bounds[0]))
        jobs.append(JobSpec(f"{app.name}-{i}", float(round(t)), app.name, replicas, bsz))
    return sorted(jobs, key=lambda j: (j.submit, j.name))
