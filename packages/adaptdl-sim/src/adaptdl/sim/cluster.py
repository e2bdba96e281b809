"""The cluster simulation: jobs arrive, a policy allocates GPUs each round, jobs train.

Jobs advance analytically between events (no per-step loop), so a workload of
hundreds of jobs over days of simulated time runs in seconds.
"""

from __future__ import annotations

import math
import time as _time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from adaptdl.core.validate import check_float, check_int
from adaptdl.sched.policies import Policy
from adaptdl.sched.round import allocation_round
from adaptdl.sched.view import ClusterState
from adaptdl.sim.apps import ApplicationModel
from adaptdl.sim.engine import EventKind, EventQueue
from adaptdl.sim.jobs import SimJob
from adaptdl.sim.metrics import SimResult, summarize
from adaptdl.sim.workload import JobSpec


def _checked(check: Callable[..., Any], **limits: Any) -> Callable[[Any, Any, Any], None]:
    """An attrs validator: ``check(field name, value, **limits)`` (check_int, check_float)."""

    def validate(instance: Any, attribute: Any, value: Any) -> None:
        check(attribute.name, value, **limits)

    return validate


def _optional_positive(instance: Any, attribute: Any, value: Any) -> None:
    if value is not None:
        check_float(attribute.name, value, min=0.0, min_exclusive=True)


@attrs.frozen
class ClusterConfig:
    """The simulated cluster and its rules (times in seconds).

    ``node_mtbf``: mean time between failures of one node (0: nodes never fail);
    ``repair_time``: how long a failed node stays down; ``max_time``: stop the
    simulation then even if jobs remain (None: run to completion).
    """

    num_nodes: int = attrs.field(default=16, validator=_checked(check_int, min=1))
    gpus_per_node: int = attrs.field(default=4, validator=_checked(check_int, min=1))
    interval: float = attrs.field(
        default=60.0, validator=_checked(check_float, min=0.0, min_exclusive=True)
    )
    restart_penalty: float = attrs.field(default=30.0, validator=_checked(check_float, min=0.0))
    node_mtbf: float = attrs.field(default=0.0, validator=_checked(check_float, min=0.0))
    repair_time: float = attrs.field(default=600.0, validator=_checked(check_float, min=0.0))
    seed: int = attrs.field(default=0, validator=_checked(check_int, min=0))
    max_time: float | None = attrs.field(default=None, validator=_optional_positive)

    @property
    def total_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node


class ClusterSimulation:
    """One run of a workload under a policy. Call :meth:`run` once."""

    def __init__(
        self,
        jobs: Sequence[JobSpec],
        applications: Mapping[str, ApplicationModel],
        policy: Policy,
        config: ClusterConfig | None = None,
    ) -> None:
        self.config = config or ClusterConfig()
        self.policy = policy
        self.specs = sorted(jobs, key=lambda j: (j.submit, j.name))
        for spec in self.specs:
            if spec.application not in applications:
                raise ValueError(
                    f"job {spec.name!r}: unknown application {spec.application!r}; "
                    f"known: {sorted(applications)}"
                )
        self.applications = applications
        self.on_progress: Callable[[int, int], None] | None = None
        self.rng = np.random.default_rng(self.config.seed)
        self.queue = EventQueue()
        self.jobs: dict[str, SimJob] = {}
        self.active: dict[str, SimJob] = {}
        self.up = [True] * self.config.num_nodes
        self.utilization: list[tuple[float, int]] = []  # (time, GPUs allocated) per round
        self.rounds = 0
        #: CPU seconds the policy took to decide, per round.
        self.policy_seconds: list[float] = []
        self.now = 0.0
        self._arrived = 0
        self._finished = 0

    # -- main loop ---------------------------------------------------------------

    def run(self, on_progress: Callable[[int, int], None] | None = None) -> SimResult:
        """Simulate until every job completes (or ``max_time``); return the metrics.

        ``on_progress(finished, total)`` is called after every round and completion.
        """
        cfg = self.config
        self.on_progress = on_progress
        for i, spec in enumerate(self.specs):
            self.queue.push(spec.submit, EventKind.ARRIVAL, job=spec.name, version=i)
        if self.specs:
            self.queue.push(self._round_at(self.specs[0].submit), EventKind.SCHEDULE)
        if cfg.node_mtbf > 0:
            for node in range(cfg.num_nodes):
                t = float(self.rng.exponential(cfg.node_mtbf))
                self.queue.push(t, EventKind.FAILURE, node=node)
        while self.queue:
            event = self.queue.pop()
            if cfg.max_time is not None and event.time > cfg.max_time:
                self.now = cfg.max_time
                break
            self.now = event.time
            kind = event.kind
            if kind == EventKind.ARRIVAL:
                self._arrive(self.specs[event.version])
            elif kind == EventKind.SCHEDULE:
                self._schedule()
            elif kind in (EventKind.EPOCH, EventKind.COMPLETION):
                job = self.active.get(event.job)
                if job is not None and job.version == event.version:
                    self._boundary(job)
            elif kind == EventKind.FAILURE:
                self._fail(event.node)
            elif kind == EventKind.REPAIR:
                self.up[event.node] = True
                t = self.now + float(self.rng.exponential(cfg.node_mtbf))
                self.queue.push(t, EventKind.FAILURE, node=event.node)
            # RESTART_DONE needs no action: a job's rate already starts at restart_until.
            if self._finished == len(self.specs):
                break
        for job in self.active.values():
            job.advance(self.now)
        return summarize(self)

    def _round_at(self, time: float) -> float:
        interval = self.config.interval
        return math.ceil(time / interval - 1e-9) * interval

    # -- handlers ----------------------------------------------------------------

    def _arrive(self, spec: JobSpec) -> None:
        app = self.applications[spec.application]
        cfg = self.config
        job = SimJob(
            spec,
            app,
            adaptive=self.policy.adaptive,
            max_replicas=cfg.total_gpus,
            restart_cost=cfg.restart_penalty,
        )
        self.jobs[spec.name] = job
        self.active[spec.name] = job
        self._arrived += 1

    def _schedule(self) -> None:
        cfg = self.config
        self.rounds += 1
        jobs = tuple(sorted(self.active.values(), key=lambda j: (j.submit, j.name)))
        for job in jobs:
            job.advance(self.now)
        if jobs:
            state = ClusterState(
                time=self.now,
                num_nodes=cfg.num_nodes,
                gpus_per_node=cfg.gpus_per_node,
                up=tuple(self.up),
                jobs=jobs,
                interval=cfg.interval,
                restart_penalty=cfg.restart_penalty,
            )
            # Checked: a policy's answer over the cluster raises AllocationError.
            started = _time.process_time()
            decided = allocation_round(self.policy, state)
            self.policy_seconds.append(_time.process_time() - started)
            for job in jobs:
                nodes = list(decided.nodes(job.name))
                if job.set_allocation(self.now, nodes, cfg.restart_penalty):
                    if nodes:
                        self.queue.push(
                            job.restart_until, EventKind.RESTART_DONE, job.name, job.version
                        )
                    self._push_boundary(job)
                elif job.maybe_reconfigure(self.now):
                    self._push_boundary(job)
        used = sum(j.num_gpus for j in self.active.values())
        self.utilization.append((self.now, used))
        if self.on_progress is not None:
            self.on_progress(self._finished, len(self.specs))
        # Next round: one interval on while jobs are active, else at the next arrival.
        if self.active:
            self.queue.push(self.now + cfg.interval, EventKind.SCHEDULE)
        elif self._arrived < len(self.specs):
            nxt = self.specs[self._arrived].submit
            self.queue.push(max(self._round_at(nxt), self.now + cfg.interval), EventKind.SCHEDULE)

    def _push_boundary(self, job: SimJob) -> None:
        nxt = job.next_boundary()
        if nxt is None:
            return
        time, last = nxt
        kind = EventKind.COMPLETION if last else EventKind.EPOCH
        self.queue.push(max(time, self.now), kind, job.name, job.version)

    def _boundary(self, job: SimJob) -> None:
        if job.cross_boundary(self.now):
            del self.active[job.name]
            job.nodes = []
            self._finished += 1
            if self.on_progress is not None:
                self.on_progress(self._finished, len(self.specs))
        else:
            self._push_boundary(job)

    def _fail(self, node: int) -> None:
        self.up[node] = False
        for job in list(self.active.values()):
            if node in job.nodes:
                job.lose_allocation(self.now)
        self.queue.push(self.now + self.config.repair_time, EventKind.REPAIR, node=node)


def simulate(
    jobs: Sequence[JobSpec],
    applications: Mapping[str, ApplicationModel],
    policy: Policy,
    config: ClusterConfig | None = None,
    *,
    on_progress: Callable[[int, int], None] | None = None,
) -> SimResult:
    """Run ``jobs`` under ``policy`` on the cluster of ``config``; return the metrics."""
    return ClusterSimulation(jobs, applications, policy, config).run(on_progress)
