"""Pollux (Qiao et al., OSDI 2021): co-adaptive, goodput-driven scheduling.

Each job's speedup function (goodput with k GPUs over goodput with one, each at the
batch size its own goodput engine would choose) comes from the job's core
``GoodputFunction``, fitted to the step times that job has experienced. GPUs go to
maximise the sum of speedups, greedily by best gain per GPU; a change of a job's
allocation scales its speedup by ``1 - restart_penalty / restart_horizon``, so a
marginal gain does not pay for a restart. A job may grow to at most twice the most
GPUs it has run on (its model is untested beyond), multi-node jobs do not share
their partial nodes with other multi-node jobs where avoidable, and the batch size
is chosen by each job at its new allocation.
"""

from __future__ import annotations

import numpy as np

from adaptdl.core._validate import check_float, check_int
from adaptdl.sim.jobs import SimJob
from adaptdl.sim.policies.base import Allocation, ClusterState, greedy_allocate, pack


class PolluxPolicy:
    """Goodput-optimising allocation with restart-cost weighting."""

    name = "pollux"
    adaptive = True

    def __init__(
        self,
        *,
        restart_horizon: float | None = None,
        explore_factor: int = 2,
        max_gpus_per_job: int | None = None,
    ) -> None:
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
        horizon = self.restart_horizon or 10.0 * state.interval
        discount = max(0.0, 1.0 - state.restart_penalty / horizon)
        speedup = job.goodput.speedup(self.gpu_cap(job, state), state.gpus_per_node)
        u = speedup * discount
        cur = job.num_gpus
        if 0 < cur < len(u):
            u[cur] = speedup[cur]
        return u

    def allocate(self, state: ClusterState) -> Allocation:
        utilities = [self.utility(job, state) for job in state.jobs]
        alloc = greedy_allocate(utilities, state.total_gpus)
        counts = {j.name: a for j, a in zip(state.jobs, alloc, strict=True) if a > 0}
        return pack(state, counts)
