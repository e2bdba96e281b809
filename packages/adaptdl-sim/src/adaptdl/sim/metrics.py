"""Results of a cluster simulation: job completion times, makespan, utilisation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

if TYPE_CHECKING:
    from adaptdl.sim.apps import ApplicationModel
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
    #: Seconds the job would take alone on the cluster (:func:`alone_seconds`).
    alone: float | None = None

    @property
    def slowdown(self) -> float | None:
        """JCT over the time alone (>= 1 up to the oracle's grid); None if unfinished."""
        jct = self.jct
        if jct is None or not self.alone:
            return None
        return jct / self.alone

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
            "slowdown": self.slowdown,
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
    def max_slowdown(self) -> float:
        """The worst finished job's JCT over its time alone on the cluster."""
        values = [j.slowdown for j in self.jobs if j.slowdown is not None]
        return max(values) if values else float("nan")

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
            "max_slowdown": _num(self.max_slowdown),
            "unfinished": self.unfinished,
            "rounds": self.rounds,
            "max_round_seconds": _num(self.max_round_seconds),
            "mean_round_seconds": _num(self.mean_round_seconds),
            "jobs": [j.to_json(history=history) for j in self.jobs],
            "utilization": [list(u) for u in self.utilization] if history else None,
        }


def _num(x: float) -> float | None:
    return None if np.isnan(x) else float(x)


def alone_seconds(app: ApplicationModel, total_gpus: int, gpus_per_node: int) -> float:
    """Seconds a job of ``app`` needs alone on the cluster: every epoch at the best of
    a grid of configurations (GPU counts 1, 2, 4, ... and whole nodes, on the fewest
    nodes; local batch sizes on a geometric grid within the bounds, total batch size
    at most the maximum), without restarts or profiling. An oracle from the
    application model, for the slowdown of a job against running alone."""
    lo, hi = app.local_bsz_bounds
    counts = sorted(
        {2**i for i in range(total_gpus.bit_length()) if 2**i <= total_gpus}
        | set(range(gpus_per_node, total_gpus + 1, gpus_per_node))
    )
    atomics = sorted({round(float(b)) for b in np.geomspace(lo, hi, 12)})
    configs = []
    for k in counts:
        full, rem = divmod(k, gpus_per_node)
        placement = [gpus_per_node] * full + ([rem] if rem else [])
        for atomic in atomics:
            batch = k * atomic
            if batch > app.max_batch_size and atomic > lo:
                continue
            configs.append((batch, app.step_time(placement, atomic)[0]))
    total = 0.0
    before = 0.0
    for epoch, target in enumerate(app.epoch_progress):
        best = max(app.gain(batch, epoch) / step for batch, step in configs)
        total += (float(target) - before) / best
        before = float(target)
    return total


def summarize(sim: ClusterSimulation) -> SimResult:
    """Collect the metrics of a finished simulation."""
    cfg = sim.config
    alone = {
        name: alone_seconds(app, cfg.total_gpus, cfg.gpus_per_node)
        for name, app in sim.applications.items()
        if any(j.spec.application == name for j in sim.jobs.values())
    }
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
            alone=alone[j.spec.application],
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
