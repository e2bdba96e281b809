"""The live scheduler: jobs submitted, rounds of the shared policy code, replicas
stopped and relaunched through a :class:`~adaptdl.sched.backend.Backend`.

Engine-free and single-threaded: its owner (the Ray actor of ``adaptdl.sched.ray``,
or a test) calls :meth:`Scheduler.tick` every second or so. A tick reads every
running job's replica statuses, hints and progress, finishes the stops it is waiting
for, and runs a round every ``interval`` seconds or at once after an event (a
submission, a job ending or failing, a node joining or leaving, new hints).

Its state is JSON under ``storage`` (``scheduler.json``, rewritten atomically on
every change), so that a restarted scheduler picks up its jobs without restarting
them; its decisions go to an event log (``events.jsonl``), one JSON object a line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from adaptdl.core.decide.hints import hints as make_hints
from adaptdl.core.stats.profiler import Profiler
from adaptdl.core.validate import check_float
from adaptdl.sched.backend import LOST, PREEMPTED, Backend, Launch, LaunchError, Node, by_rank
from adaptdl.sched.policies import DEFAULT_POLICY, LIVE_POLICIES, make_policy
from adaptdl.sched.progress import HINTS_FILE, read_job_hints, read_progress
from adaptdl.sched.record import JobRecord, JobSpec, Status, node_indices
from adaptdl.sched.round import ChangeKind, allocation_round
from adaptdl.sched.view import ClusterState

logger = logging.getLogger("adaptdl.sched")

STATE_FILE = "scheduler.json"
EVENTS_FILE = "events.jsonl"
STATE_SCHEMA = "adaptdl.scheduler/1"

#: The hints of a job that published none: one replica's worth, nothing profiled, a
#: fixed batch size; a goodput policy then gives it its minimum replicas.
NO_HINTS = make_hints(Profiler(), None, 1)


@attrs.frozen
class LiveView:
    """One job for a round: ``adaptdl.sched.view.JobView`` filled from its record."""

    name: str
    submit: float
    started: float | None
    hints: Mapping[str, Any]
    nodes: tuple[int, ...]
    min_replicas: int
    max_replicas: int
    requested_replicas: int
    restart_cost: float
    attained_service: float
    run_time: float
    remaining_progress: float | None = None


class UnknownJobError(KeyError):
    """No job of that name."""

    def __str__(self) -> str:
        return f"no job named {self.args[0]!r}"


class Scheduler:
    """Runs jobs on a backend's nodes, allocating GPUs with a policy (one per replica)."""

    def __init__(
        self,
        backend: Backend,
        storage: str | os.PathLike[str],
        *,
        policy: str = DEFAULT_POLICY,
        interval: float = 60.0,
        restart_penalty: float = 30.0,
        stop_timeout: float = 120.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if policy not in LIVE_POLICIES:
            raise ValueError(
                f"policy {policy!r}: a live scheduler runs one of {list(LIVE_POLICIES)}"
            )
        check_float("interval", interval, min=0.0, min_exclusive=True)
        check_float("restart_penalty", restart_penalty, min=0.0)
        check_float("stop_timeout", stop_timeout, min=0.0, min_exclusive=True)
        self.backend = backend
        self.storage = Path(storage).resolve()
        self.storage.mkdir(parents=True, exist_ok=True)
        self.policy_name = policy
        self.policy = make_policy(policy)
        self.interval = interval
        self.restart_penalty = restart_penalty
        self.stop_timeout = stop_timeout
        self.clock = clock
        self.jobs: dict[str, JobRecord] = {}
        self.rounds = 0
        self._due = True
        self._last_round = -float("inf")
        #: Set by :meth:`drain`: no more rounds, running jobs stop and stay queued.
        self.draining = False
        self._nodes: tuple[str, ...] = ()
        #: Per job: when its resize was asked, waiting for its first step at the new size.
        self._resize_from: dict[str, float] = {}
        #: Per job: the mtime of the hints file last read.
        self._hints_mtime: dict[str, float] = {}
        self._load()

    # -- persisted state ---------------------------------------------------------

    @property
    def state_path(self) -> Path:
        return self.storage / STATE_FILE

    @property
    def events_path(self) -> Path:
        return self.storage / EVENTS_FILE

    def _load(self) -> None:
        path = self.state_path
        if not path.exists():
            return
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("schema") != STATE_SCHEMA:
            raise ValueError(f"{path}: not a scheduler state (schema {STATE_SCHEMA!r})")
        for item in data["jobs"]:
            record = JobRecord.from_dict(item)
            self.jobs[record.name] = record
        self._resize_from = {k: float(v) for k, v in data.get("resize_from", {}).items()}
        now = self.clock()
        # Running jobs were left running by the scheduler before: find their replicas.
        for job in self.jobs.values():
            if job.status in (Status.RUNNING, Status.RESIZING) and job.node_ids:
                if self.backend.attach(job.name, job.launch, len(job.node_ids)):
                    self._event("reattached", job, launch=job.launch)
                else:
                    self.backend.release(job.name)
                    self._requeue(job, now, "its replicas were gone when the scheduler restarted")
        self._save()

    def _save(self) -> None:
        data = {
            "schema": STATE_SCHEMA,
            "policy": self.policy_name,
            "jobs": [j.to_dict() for j in self.jobs.values()],
            "resize_from": self._resize_from,
        }
        text = json.dumps(data, indent=1, allow_nan=False)
        fd, tmp = tempfile.mkstemp(prefix=".scheduler-", suffix=".tmp", dir=self.storage)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, self.state_path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _event(self, event: str, job: JobRecord | None = None, **fields: Any) -> None:
        record: dict[str, Any] = {"time": self.clock(), "event": event}
        if job is not None:
            record["job"] = job.name
        record.update(fields)
        with self.events_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, allow_nan=False) + "\n")

    # -- operator's verbs --------------------------------------------------------

    def submit(self, spec: JobSpec) -> str:
        """Queue a job; return its name. Raises ValueError if the name is taken."""
        if spec.name in self.jobs:
            raise ValueError(f"job name {spec.name!r} is taken")
        root = self.storage / "jobs" / spec.name
        paths = {k: root / k for k in ("checkpoint", "share", "logs")}
        for p in paths.values():
            p.mkdir(parents=True, exist_ok=True)
        job = JobRecord(
            spec=spec,
            submit=self.clock(),
            checkpoint_path=str(paths["checkpoint"]),
            share_path=str(paths["share"]),
            log_dir=str(paths["logs"]),
        )
        self.jobs[spec.name] = job
        self._event(
            "arrival",
            job,
            min_replicas=spec.min_replicas,
            max_replicas=spec.max_replicas,
            command=list(spec.command),
        )
        self._due = True
        self._save()
        return spec.name

    def job(self, name: str) -> JobRecord:
        """The job named ``name``; raises :class:`UnknownJobError`."""
        try:
            return self.jobs[name]
        except KeyError:
            raise UnknownJobError(name) from None

    def stop(self, name: str) -> None:
        """Stop a job gracefully: its replicas checkpoint and exit, then it is Stopped."""
        job = self.job(name)
        if job.status.done:
            return
        now = self.clock()
        if job.status is Status.PENDING:
            self._finish(job, Status.STOPPED, now)
        elif job.stop_reason != "stop":
            self._request_stop(job, now, "stop")
        self._save()

    def drain(self) -> list[str]:
        """Ask every running job to checkpoint and stop, to be relaunched by a later
        scheduler (no round runs once called); return the jobs still stopping."""
        self.draining = True
        now = self.clock()
        for job in self.jobs.values():
            if job.status is Status.RUNNING and job.stop_reason is None:
                self._request_stop(job, now, "drain")
        self.tick()
        self._save()
        return [j.name for j in self.jobs.values() if j.stop_reason is not None]

    def rows(self) -> list[dict[str, Any]]:
        """``adaptdl ls --json``: every job, in submission order."""
        return [j.row() for j in sorted(self.jobs.values(), key=lambda j: (j.submit, j.name))]

    # -- the loop ----------------------------------------------------------------

    def tick(self) -> None:
        """Observe every job and the nodes; run a round if one is due."""
        now = self.clock()
        nodes = self.backend.nodes()
        ids = tuple(sorted(n.node_id for n in nodes))
        if ids != self._nodes:
            if self._nodes:
                self._event("nodes", nodes=list(ids))
            self._nodes = ids
            self._due = True
        changed = False
        for job in list(self.jobs.values()):
            if job.status in (Status.RUNNING, Status.RESIZING):
                changed |= self._observe(job, now)
        if changed:
            self._save()
        waiting = any(j.stop_reason == "resize" for j in self.jobs.values())
        due = self._due or now - self._last_round >= self.interval
        if due and not waiting and not self.draining:
            self.run_round(nodes, now)
            self._save()

    def _observe(self, job: JobRecord, now: float) -> bool:
        job.account(now)
        self._read_job_files(job, now)
        codes = self.backend.poll(job.name)
        if job.stop_requested is not None:
            if all(c is not None for c in codes):
                self._stopped(job, codes, now)
                return True
            if now - job.stop_requested > self.stop_timeout:
                # It did not stop in time: kill it; it resumes from its last checkpoint.
                self._event("stop-timeout", job, waited=now - job.stop_requested)
                self.backend.release(job.name)
                self._stopped(job, [LOST if c is None else c for c in codes], now)
                return True
            return False
        if all(c is None for c in codes):
            return False
        if all(c == 0 for c in codes):
            self.backend.release(job.name)
            self._finish(job, Status.SUCCEEDED, now)
            return True
        if LOST in codes:
            self.backend.release(job.name)
            self._event("lost", job, codes=codes)
            self._requeue(job, now, "a replica's node or process was lost")
            return True
        crashed = [c for c in codes if c not in (None, 0, PREEMPTED)]
        if crashed:
            self.backend.release(job.name)
            self._fail(job, now, codes)
            return True
        if PREEMPTED in codes:
            # Stopped from outside (its node drained, someone's SIGTERM): let the
            # others checkpoint and stop too, then queue it again.
            self._request_stop(job, now, "preempted")
            return True
        return False  # some exited 0, the others are finishing

    def _read_job_files(self, job: JobRecord, now: float) -> None:
        hints_file = Path(job.share_path) / HINTS_FILE
        try:
            mtime = hints_file.stat().st_mtime
        except OSError:
            mtime = None
        if mtime is not None and mtime != self._hints_mtime.get(job.name):
            self._hints_mtime[job.name] = mtime
            hints = read_job_hints(job.share_path)
            if hints is not None and hints != job.hints:
                job.hints = hints
                self._due = True  # new hints: an event
        progress = read_progress(job.share_path)
        if progress is None or job.launched is None or progress["time"] < job.launched:
            return
        job.batch_size = progress["batch_size"]
        since = self._resize_from.get(job.name)
        # While it stops, what it reports is the old placement's last steps.
        stepping = job.status is Status.RUNNING and job.stop_requested is None
        if since is not None and stepping and progress["replicas"] == len(job.node_ids):
            cost = max(progress["time"] - since, 0.0)
            job.restart_costs.append(cost)
            del self._resize_from[job.name]
            self._event("resized", job, replicas=len(job.node_ids), cost=cost)
            logger.info(
                "%s: stepping at %d replicas, %.1f s after the stop",
                job.name,
                len(job.node_ids),
                cost,
            )

    # -- transitions -------------------------------------------------------------

    def _request_stop(self, job: JobRecord, now: float, reason: str) -> None:
        job.stop_requested = now
        job.stop_reason = reason
        if reason == "resize":
            job.status = Status.RESIZING
        self.backend.terminate(job.name)
        self._event("stop-requested", job, reason=reason)

    def _stopped(self, job: JobRecord, codes: list[int | None], now: float) -> None:
        """Every replica of a job asked to stop has exited."""
        self.backend.release(job.name)
        reason = job.stop_reason
        job.stop_requested = None
        job.stop_reason = None
        if all(c == 0 for c in codes):
            self._finish(job, Status.SUCCEEDED, now)
            return
        # A replica that died of the SIGTERM sent here had not installed its handler
        # yet (still starting: importing, loading): it wrote nothing and resumes from
        # the last checkpoint, as a stop asks. Not a crash.
        crashed = [c for c in codes if c not in (0, PREEMPTED, LOST, -signal.SIGTERM)]
        if reason == "stop":
            self._finish(job, Status.STOPPED, now)
            return
        if crashed:
            self._fail(job, now, codes)
            return
        target = job.target or []
        job.target = None
        job.node_ids = []
        job.restarts += 1
        if target and not self.draining:
            self._launch(job, target, now)
        else:
            job.status = Status.PENDING
            self._resize_from.pop(job.name, None)  # suspended: no resize to time
            self._due = True

    def _requeue(self, job: JobRecord, now: float, why: str) -> None:
        job.account(now)
        job.node_ids = []
        job.target = None
        job.stop_requested = None
        job.stop_reason = None
        job.status = Status.PENDING
        job.restarts += 1
        job.message = why
        self._resize_from.pop(job.name, None)
        self._due = True

    def _fail(self, job: JobRecord, now: float, codes: list[int | None]) -> None:
        job.failures += 1
        self._event("failure", job, codes=codes, failures=job.failures)
        if job.failures > job.spec.max_failures:
            job.message = f"replica exit statuses {codes}; {job.failures} failures"
            self._finish(job, Status.FAILED, now)
        else:
            self._requeue(
                job, now, f"replica exit statuses {codes}: restarting from its checkpoint"
            )

    def _finish(self, job: JobRecord, status: Status, now: float) -> None:
        job.account(now)
        job.status = status
        job.finished = now
        job.node_ids = []
        job.target = None
        job.stop_requested = None
        job.stop_reason = None
        self._resize_from.pop(job.name, None)
        self._due = True
        self._event("completion", job, status=status.value)
        logger.info("%s: %s", job.name, status.value)

    def _launch(self, job: JobRecord, node_ids: list[str], now: float) -> None:
        job.launch += 1
        env = dict(job.spec.env)
        env.update(
            {
                "ADAPTDL_JOB_ID": job.name,
                "ADAPTDL_CHECKPOINT_PATH": job.checkpoint_path,
                "ADAPTDL_SHARE_PATH": job.share_path,
                "ADAPTDL_NUM_RESTARTS": str(job.restarts),
                "PYTHONUNBUFFERED": "1",
            }
        )
        launch = Launch(
            job=job.name,
            number=job.launch,
            node_ids=tuple(node_ids),
            command=job.spec.command,
            cpus_per_replica=job.spec.cpus_per_replica,
            env=env,
            log_dir=job.log_dir,
        )
        try:
            placed = list(self.backend.launch(launch))
        except LaunchError as exc:
            job.status = Status.PENDING
            job.node_ids = []
            job.message = f"launch failed: {exc}"
            self._event("launch-failed", job, error=str(exc))
            return
        job.status = Status.RUNNING
        job.node_ids = placed
        job.launched = now
        job.accounted = now
        job.message = ""
        if job.started is None:
            job.started = now
        self._event("launch", job, replicas=len(node_ids), nodes=len(set(node_ids)))

    # -- the round ---------------------------------------------------------------

    def run_round(self, nodes: list[Node] | None = None, now: float | None = None) -> None:
        """One allocation round: the policy's answer, applied."""
        now = self.clock() if now is None else now
        nodes = self.backend.nodes() if nodes is None else nodes
        self._due = False
        self._last_round = now
        self.rounds += 1
        # A job relaunched at a new size keeps it until it steps there (or the stop
        # timeout passes): its resize's cost is still being measured, and a stop
        # before the program installed its handlers would kill it as a crash.
        settling = {
            name for name, since in self._resize_from.items() if now - since < self.stop_timeout
        }
        active = sorted(
            (
                j
                for j in self.jobs.values()
                if not j.status.done and j.stop_reason is None and j.name not in settling
            ),
            key=lambda j: (j.submit, j.name),
        )
        nodes = sorted(nodes, key=lambda n: n.node_id)
        if not active or not nodes:
            return
        order = [n.node_id for n in nodes]
        # GPUs still held by jobs that are stopping or settling are not the round's to give.
        held = {n.node_id: 0 for n in nodes}
        for job in self.jobs.values():
            if job.stop_reason is not None or (job.name in settling and not job.status.done):
                for n in job.node_ids:
                    if n in held:
                        held[n] += 1
        views = []
        for job in active:
            idx = node_indices(job.node_ids, order)
            if -1 in idx:
                # Its node left between the poll and now: the next tick requeues it.
                continue
            views.append(
                LiveView(
                    name=job.name,
                    submit=job.submit,
                    started=job.started,
                    hints=job.hints or NO_HINTS,
                    nodes=tuple(idx),
                    min_replicas=job.spec.min_replicas,
                    max_replicas=job.spec.max_replicas,
                    requested_replicas=job.spec.max_replicas,
                    restart_cost=self._restart_cost(job, now),
                    attained_service=job.attained_service,
                    run_time=job.run_time,
                )
            )
        state = ClusterState(
            time=now,
            num_nodes=len(nodes),
            gpus_per_node=max(1, max(n.gpus for n in nodes)),
            up=(True,) * len(nodes),
            jobs=tuple(views),
            interval=self.interval,
            restart_penalty=self.restart_penalty,
            node_gpus=tuple(max(n.gpus - held[n.node_id], 0) for n in nodes),
        )
        decided = allocation_round(self.policy, state)
        speedups = self._predicted(state, decided.allocation)
        for view in views:
            job = self.jobs[view.name]
            job.speedup = speedups.get(view.name)
        self._event(
            "allocation",
            round=self.rounds,
            allocation={k: len(v) for k, v in decided.allocation.items()},
            speedup=speedups,
        )
        for change in decided.changes:
            job = self.jobs[change.job]
            target = list(by_rank([order[i] for i in change.after]))
            why = (
                f"{len(change.before)} -> {len(change.after)} GPUs "
                f"(predicted speedup {speedups.get(job.name)}, restart cost "
                f"{self._restart_cost(job, now):.1f} s)"
            )
            logger.info("round %d: %s %s: %s", self.rounds, change.kind.value, job.name, why)
            if change.kind in (ChangeKind.START, ChangeKind.RESUME):
                self._launch(job, target, now)
            else:
                job.target = target
                unfinished = self._resize_from.get(job.name)
                if unfinished is not None:
                    # Resized again before it stepped at its last size (a relaunch
                    # slower than the stop timeout): that restart took at least this
                    # long, and without this it would never count at all.
                    cost = now - unfinished
                    job.restart_costs.append(cost)
                    self._event("resize-unfinished", job, cost=cost)
                self._resize_from[job.name] = now
                self._event(
                    "resize",
                    job,
                    change=change.kind.value,
                    before=len(change.before),
                    after=len(change.after),
                    why=why,
                )
                self._request_stop(job, now, "resize")

    def _restart_cost(self, job: JobRecord, now: float) -> float:
        """What the policy charges ``job`` for a restart: the median of its measured
        restart costs (the penalty before any), and at least the time its resize under
        way has taken so far (a relaunch slower than the stop timeout is back in the
        rounds before it has stepped, and its cost is already that high)."""
        cost = job.measured_restart_cost(self.restart_penalty)
        since = self._resize_from.get(job.name)
        return cost if since is None else max(cost, now - since)

    def _predicted(
        self, state: ClusterState, allocation: Mapping[str, tuple[int, ...]]
    ) -> dict[str, float]:
        """Each job's predicted speedup over one GPU at its new allocation (pollux)."""
        speedup = getattr(self.policy, "speedup", None)
        cap = getattr(self.policy, "gpu_cap", None)
        if speedup is None or cap is None:
            return {}
        out = {}
        for view in state.jobs:
            k = len(allocation.get(view.name, ()))
            values, _ = speedup(view, cap(view, state), state.gpus_per_node)
            if 0 < k < len(values):
                out[view.name] = round(float(values[k]), 3)
        return out
