"""Pollux (Qiao et al., OSDI 2021): co-adaptive, goodput-driven scheduling.

Each job's speedup function (goodput with k GPUs over goodput with one, each at the
batch size its own goodput engine would choose) comes from the job's core
``GoodputFunction``, fitted to the step times that job has experienced. GPUs go to
maximise the p-mean of the jobs' speedups (``fairness`` p; -1, the published
default, favours the slowest jobs; 1 is the plain sum), greedily by best gain per
GPU; a job with no GPUs counts as a very small speedup, so every job gets one GPU
(in submission order) before any gets a second. A change of a job's
allocation scales its speedup by ``1 - restart_penalty / H``, H the job's own
estimate of its remaining time (remaining epochs' progress over its goodput; or
``restart_horizon`` if given): a change pays off only if the speedup ratio beats
``H / (H - restart_penalty)``, so a marginal gain, or any gain near the end of a
job, does not pay for a restart. A job may grow to at most ``explore_factor`` (4) times the most
GPUs it has run on (its model is untested beyond), multi-node jobs do not share
their partial nodes with other multi-node jobs where avoidable, and the batch size
is chosen by each job at its new allocation.
"""

from __future__ import annotations

import numpy as np

from adaptdl.core._validate import check_float, check_int
from adaptdl.sim.jobs import SimJob
from adaptdl.sim.policies.base import Allocation, ClusterState, greedy_allocate, pack

# Speedup a job with no GPUs counts as (finite, so that the p-mean stays finite).
_NO_GPU_SPEEDUP = 1e-3


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

    def gpu_cap(self, job: SimJob, state: ClusterState) -> int:
        """Most GPUs the job may receive this round."""
        cap = state.total_gpus
        if self.max_gpus_per_job is not None:
            cap = min(cap, self.max_gpus_per_job)
        cap = min(cap, max(1, self.explore_factor * job.max_gpus_seen))
        # Every replica needs at least the smallest local batch of the largest batch.
        lo = job.app.local_bsz_bounds[0]
        return max(1, min(cap, job.app.max_batch_size // lo))

    def utility(self, job: SimJob, state: ClusterState) -> np.ndarray:
        """The job's value with 0..cap GPUs: its speedup, discounted where it restarts."""
        speedup = job.goodput.speedup(self.gpu_cap(job, state), state.gpus_per_node)
        cur = job.num_gpus
        s = speedup.copy()
        if 0 < cur < len(s):
            horizon = self.restart_horizon
            if horizon is None:
                # Progress per second = goodput / initial batch size.
                rate = speedup[cur] * job.goodput.base_goodput / job.app.init_batch_size
                horizon = job.remaining_progress / rate if rate > 0 else np.inf
                if self.max_horizon is not None:
                    # Churn hurts the other jobs too: however long this one has left,
                    # a change must pay for itself within max_horizon.
                    horizon = min(horizon, self.max_horizon)
            discount = max(0.0, 1.0 - state.restart_penalty / max(horizon, 1e-9))
            s *= discount
            s[cur] = speedup[cur]
        p = self.fairness
        # Maximising the p-mean is maximising sum(s^p) for p > 0, -sum(s^p) for p < 0.
        s = np.maximum(s, _NO_GPU_SPEEDUP)
        out: np.ndarray = np.power(s, p) if p > 0 else -np.power(s, p)
        return out

    def allocate(self, state: ClusterState) -> Allocation:
        utilities = [self.utility(job, state) for job in state.jobs]
        alloc = greedy_allocate(utilities, state.total_gpus)
        # The current allocation, topped up with the free GPUs, is a candidate too: a
        # reshuffle restarts jobs, so it must beat keeping things by ``min_gain``.
        current = [j.num_gpus if all(state.up[n] for n in j.nodes) else 0 for j in state.jobs]
        if sum(current) <= state.total_gpus:
            kept = greedy_allocate(utilities, state.total_gpus, start=current)
            value_new = sum(float(u[a]) for u, a in zip(utilities, alloc, strict=True))
            value_kept = sum(float(u[a]) for u, a in zip(utilities, kept, strict=True))
            if value_new <= value_kept + self.min_gain * abs(value_kept):
                alloc = kept
        counts = {j.name: a for j, a in zip(state.jobs, alloc, strict=True) if a > 0}
        return pack(state, counts)
