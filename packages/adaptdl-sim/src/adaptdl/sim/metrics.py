"""Results of a cluster simulation: job completion times, makespan, utilisation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

if TYPE_CHECKING:
    from adaptdl.sim.cluster import ClusterSimulation


@attrs.frozen
class JobResult:
    """One job's outcome (times in seconds from the start of the workload)."""

    name: str
    application: str
    submit: float
    finish: float | None
    restarts: int
    failures: int
    gpu_seconds: float
    restart_seconds: float
    #: (time, GPUs, total batch size, accumulation steps) at every change.
    history: tuple[tuple[float, int, int, int], ...]

    @property
    def jct(self) -> float | None:
        """Job completion time: submission to completion (None if unfinished)."""
        return None if self.finish is None else self.finish - self.submit

    def to_json(self, *, history: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "application": self.application,
            "submit": self.submit,
            "finish": self.finish,
            "jct": self.jct,
            "restarts": self.restarts,
            "failures": self.failures,
            "gpu_seconds": round(self.gpu_seconds, 3),
            "restart_seconds": self.restart_seconds,
        }
        if history:
            out["history"] = [list(h) for h in self.history]
        return out


@attrs.frozen
class SimResult:
    """Metrics of one run of a workload under a policy."""

    policy: str
    jobs: tuple[JobResult, ...]
    #: (time, GPUs allocated) at every scheduling round.
    utilization: tuple[tuple[float, int], ...]
    total_gpus: int
    end_time: float
    rounds: int
    #: CPU seconds the policy took per round.
    policy_seconds: tuple[float, ...] = ()

    @property
    def max_round_seconds(self) -> float:
        """The longest CPU time the policy took to decide one round."""
        return max(self.policy_seconds, default=float("nan"))

    @property
    def mean_round_seconds(self) -> float:
        """The mean CPU time the policy took to decide one round."""
        return float(np.mean(self.policy_seconds)) if self.policy_seconds else float("nan")

    @property
    def jcts(self) -> np.ndarray:
        return np.array([j.jct for j in self.jobs if j.jct is not None], dtype=np.float64)

    @property
    def avg_jct(self) -> float:
        v = self.jcts
        return float(v.mean()) if len(v) else float("nan")

    @property
    def p50_jct(self) -> float:
        v = self.jcts
        return float(np.percentile(v, 50)) if len(v) else float("nan")

    @property
    def p99_jct(self) -> float:
        v = self.jcts
        return float(np.percentile(v, 99)) if len(v) else float("nan")

    @property
    def makespan(self) -> float:
        """Time from the first submission to the last completion."""
        finished = [j.finish for j in self.jobs if j.finish is not None]
        if not finished:
            return float("nan")
        return float(max(finished) - min(j.submit for j in self.jobs))

    @property
    def unfinished(self) -> int:
        return sum(j.finish is None for j in self.jobs)

    @property
    def avg_utilization(self) -> float:
        """Time-weighted share of the cluster's GPUs allocated, over the rounds."""
        if len(self.utilization) < 2 or self.total_gpus == 0:
            return float("nan")
        t = np.array([u[0] for u in self.utilization])
        g = np.array([u[1] for u in self.utilization], dtype=np.float64)
        dt = np.diff(t)
        return float((g[:-1] * dt).sum() / (dt.sum() * self.total_gpus))

    @property
    def avg_restarts(self) -> float:
        return float(np.mean([j.restarts for j in self.jobs])) if self.jobs else 0.0

    def to_json(self, *, history: bool = False) -> dict[str, Any]:
        """A JSON-ready mapping; times in seconds."""
        return {
            "policy": self.policy,
            "avg_jct": _num(self.avg_jct),
            "p50_jct": _num(self.p50_jct),
            "p99_jct": _num(self.p99_jct),
            "makespan": _num(self.makespan),
            "avg_utilization": _num(self.avg_utilization),
            "avg_restarts": self.avg_restarts,
            "unfinished": self.unfinished,
            "rounds": self.rounds,
            "max_round_seconds": _num(self.max_round_seconds),
            "mean_round_seconds": _num(self.mean_round_seconds),
            "jobs": [j.to_json(history=history) for j in self.jobs],
            "utilization": [list(u) for u in self.utilization] if history else None,
        }


def _num(x: float) -> float | None:
    return None if np.isnan(x) else float(x)


def summarize(sim: ClusterSimulation) -> SimResult:
    """Collect the metrics of a finished simulation."""
    jobs = tuple(
        JobResult(
            name=j.name,
            application=j.spec.application,
            submit=j.submit,
            finish=j.finish,
            restarts=j.restarts,
            failures=j.failures,
            gpu_seconds=j.attained_service,
            restart_seconds=j.restart_time,
            history=tuple(j.history),
        )
        for j in sorted(sim.jobs.values(), key=lambda j: (j.submit, j.name))
    )
    # Jobs never submitted before max_time count as unfinished too.
    missing = [s for s in sim.specs if s.name not in sim.jobs]
    jobs += tuple(
        JobResult(
            name=s.name,
            application=s.application,
            submit=s.submit,
            finish=None,
            restarts=0,
            failures=0,
            gpu_seconds=0.0,
            restart_seconds=0.0,
            history=(),
        )
        for s in missing
    )
    return SimResult(
        policy=sim.policy.name,
        jobs=jobs,
        utilization=tuple(sim.utilization),
        total_gpus=sim.config.total_gpus,
        end_time=sim.now,
        rounds=sim.rounds,
        policy_seconds=tuple(sim.policy_seconds),
    )
