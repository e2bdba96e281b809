"""Pollux (Qiao et al., OSDI 2021): co-adaptive, goodput-driven scheduling.

Each job's speedup function (goodput with k GPUs over goodput with one, each at the
batch size its own goodput engine would choose) comes from the scheduling hints the
job publishes, as a real scheduler reads them: core's ``goodput_fn_from_hints``
rebuilds the goodput model the job fitted to the step times it experienced, and the
hints bound the batch sizes the job may use. GPUs go to maximise the p-mean of the
jobs' speedups (``fairness`` p; -1, the published default, favours the slowest jobs;
1 is the plain sum), greedily by best gain per GPU; a job with no GPUs counts as a
very small speedup, so every job gets one GPU (in submission order) before any gets
a second.

A change of a job's allocation scales its speedup by ``1 - restart_cost / H``:
``restart_cost`` is the job's own (``JobView.restart_cost``: measured by the live
scheduler, the cluster's constant in the simulator), H the job's estimate of its
remaining time (remaining progress over its goodput where known, else unbounded; or
``restart_horizon`` if given), at most ``max_horizon``. A change pays off only if the
speedup ratio beats ``H / (H - restart_cost)``, so a marginal gain, or any gain near
the end of a job, does not pay for a restart.

A job may grow to at most ``explore_factor`` (4) times the most GPUs its profile
covers (its model is untested beyond), never beyond its ``max_replicas``, and holds
no fewer than its ``min_replicas`` when it holds any. Multi-node jobs do not share
their partial nodes with other multi-node jobs where avoidable, and the batch size
is chosen by each job at its new allocation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from adaptdl.core.decide.hints import goodput_fn_from_hints
from adaptdl.core.validate import check_float, check_int
from adaptdl.sched.policies.base import Allocation, greedy_allocate, pack
from adaptdl.sched.view import ClusterState, JobView

# Speedup a job with no GPUs counts as (finite, so that the p-mean stays finite).
_NO_GPU_SPEEDUP = 1e-3

FloatArray = npt.NDArray[np.float64]


def hints_speedup(
    hints: Mapping[str, Any], max_gpus: int, gpus_per_node: int, *, optimistic: bool = False
) -> tuple[FloatArray, float]:
    """A job's speedup over one GPU for 0..max_gpus GPUs packed onto the fewest nodes,
    and its goodput on one GPU, from its scheduling hints.

    Each count of GPUs is valued at the batch size the job would choose there (core's
    optimiser within the hints' bounds). Before the hints carry a model, one GPU is
    the only speedup known (1) and the goodput is 0. ``optimistic``: the model's
    synchronisation time is held flat past the counts the job was profiled on
    (`goodput_fn_from_hints`).
    """
    out = np.zeros(max_gpus + 1)
    fn = goodput_fn_from_hints(hints, optimistic=optimistic)
    if max_gpus < 1:
        return out, 0.0
    out[1] = 1.0
    if fn is None:
        return out, 0.0
    k = np.arange(1, max_gpus + 1)
    bounds = hints["local_bsz_bounds"]
    goodput, _, _ = fn.optimize(
        -(-k // gpus_per_node),
        k,
        max_batch_size=hints["max_batch_size"],
        atomic_bsz_range=None if bounds is None else (bounds[0], bounds[1]),
        accumulation=hints["gradient_accumulation"],
    )
    base = float(goodput[0])
    out[1:] = goodput / base if base > 0 else 0.0
    out[1] = 1.0
    return out, base


def batch_gpu_cap(hints: Mapping[str, Any]) -> int:
    """Most GPUs the job's largest batch can spread over: every replica needs at least
    the smallest local batch (at least 1)."""
    bounds = hints["local_bsz_bounds"]
    lo: int = bounds[0] if bounds is not None and bounds[0] is not None else 1
    top: int = hints["max_batch_size"] or hints["init_batch_size"]
    return max(1, top // lo)


class SpeedupCache:
    """:func:`hints_speedup` per job, kept while its hints and the GPU range stay the
    same (a round asks again for every job; most jobs' hints did not change)."""

    def __init__(self, *, optimistic: bool = False) -> None:
        self.optimistic = optimistic
        self._cached: dict[
            str, tuple[tuple[int, int], Mapping[str, Any], tuple[FloatArray, float]]
        ] = {}

    def __call__(
        self, job: JobView, max_gpus: int, gpus_per_node: int
    ) -> tuple[FloatArray, float]:
        key = (max_gpus, gpus_per_node)
        hints = job.hints
        cached = self._cached.get(job.name)
        if cached is not None and cached[0] == key and cached[1] == hints:
            return cached[2]
        value = hints_speedup(hints, max_gpus, gpus_per_node, optimistic=self.optimistic)
        self._cached[job.name] = (key, hints, value)
        return value


class PolluxPolicy:
    """Goodput-optimising allocation with restart-cost weighting."""

    name = "pollux"
    adaptive = True

    def __init__(
        self,
        *,
        restart_horizon: float | None = None,
        explore_factor: int = 4,
        max_gpus_per_job: int | None = None,
        fairness: float = -1.0,
        max_horizon: float | None = 1800.0,
        min_gain: float = 0.01,
    ) -> None:
        check_float("min_gain", min_gain, min=0.0)
        self.min_gain = min_gain
        if max_horizon is not None:
            check_float("max_horizon", max_horizon, min=0.0, min_exclusive=True)
        self.max_horizon = max_horizon
        check_float("fairness", fairness, min=-10.0, max=1.0)
        if fairness == 0.0:
            raise ValueError("fairness must be non-zero (p-mean exponent in [-10, 1])")
        self.fairness = fairness
        if restart_horizon is not None:
            check_float("restart_horizon", restart_horizon, min=0.0, min_exclusive=True)
        check_int("explore_factor", explore_factor, min=1)
        if max_gpus_per_job is not None:
            check_int("max_gpus_per_job", max_gpus_per_job, min=1)
        self.restart_horizon = restart_horizon
        self.explore_factor = explore_factor
        self.max_gpus_per_job = max_gpus_per_job
        self._speedups = SpeedupCache()

    def gpu_cap(self, job: JobView, state: ClusterState) -> int:
        """Most GPUs the job may receive this round (from its hints)."""
        hints = job.hints
        cap = state.total_gpus
        if self.max_gpus_per_job is not None:
            cap = min(cap, self.max_gpus_per_job)
        cap = min(cap, job.max_replicas)
        profiled: int = hints["max_profiled_replicas"]
        cap = min(cap, max(1, self.explore_factor * profiled))
        return max(1, job.min_replicas, min(cap, batch_gpu_cap(hints)))

    def speedup(self, job: JobView, max_gpus: int, gpus_per_node: int) -> tuple[FloatArray, float]:
        """:func:`hints_speedup` of the job's hints, kept while the hints stay the same."""
        return self._speedups(job, max_gpus, gpus_per_node)

    def utility(self, job: JobView, state: ClusterState) -> np.ndarray:
        """The job's value with 0..cap GPUs: its speedup, discounted where it restarts."""
        speedup, base_goodput = self.speedup(job, self.gpu_cap(job, state), state.gpus_per_node)
        cur = len(job.nodes)
        s = speedup.copy()
        if 0 < cur < len(s):
            horizon = self.restart_horizon
            if horizon is None:
                # Progress per second = goodput / initial batch size.
                rate = speedup[cur] * base_goodput / job.hints["init_batch_size"]
                remaining = job.remaining_progress
                # Unknown for a live job: unbounded, then max_horizon bounds it.
                horizon = np.inf if remaining is None or rate <= 0 else remaining / rate
                if self.max_horizon is not None:
                    # Churn hurts the other jobs too: however long this one has left,
                    # a change must pay for itself within max_horizon.
                    horizon = min(horizon, self.max_horizon)
            discount = max(0.0, 1.0 - job.restart_cost / max(horizon, 1e-9))
            s *= discount
            s[cur] = speedup[cur]
        p = self.fairness
        # Maximising the p-mean is maximising sum(s^p) for p > 0, -sum(s^p) for p < 0.
        s = np.maximum(s, _NO_GPU_SPEEDUP)
        out: np.ndarray = np.power(s, p) if p > 0 else -np.power(s, p)
        # Fewer GPUs than the job's minimum are not an option: the greedy search,
        # which jumps to any larger count, then goes from none straight to the minimum.
        out[1 : min(job.min_replicas, len(out))] = -np.inf
        return out

    def allocate(self, state: ClusterState) -> Allocation:
        utilities = [self.utility(job, state) for job in state.jobs]
        alloc = greedy_allocate(utilities, state.total_gpus)
        # The current allocation, topped up with the free GPUs, is a candidate too: a
        # reshuffle restarts jobs, so it must beat keeping things by ``min_gain``.
        current = [len(j.nodes) if all(state.up[n] for n in j.nodes) else 0 for j in state.jobs]
        if sum(current) <= state.total_gpus:
            kept = greedy_allocate(utilities, state.total_gpus, start=current)
            value_new = sum(float(u[a]) for u, a in zip(utilities, alloc, strict=True))
            value_kept = sum(float(u[a]) for u, a in zip(utilities, kept, strict=True))
            if value_new <= value_kept + self.min_gain * abs(value_kept):
                alloc = kept
        counts = {j.name: a for j, a in zip(state.jobs, alloc, strict=True) if a > 0}
        return pack(state, counts)
