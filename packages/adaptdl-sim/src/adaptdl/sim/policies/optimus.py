"""Optimus-style (Peng et al., EuroSys 2018) greedy on estimated remaining time.

Every job (in submission order, while GPUs last) gets one GPU; then each further GPU
goes to the job whose estimated remaining time it reduces the most. Remaining time is
the remaining progress over the job's progress rate at its submitted batch size, from
the application model (an oracle, as the Pollux study's "Optimus+Oracle"). Batch size
is as submitted.
"""

from __future__ import annotations

import numpy as np

from adaptdl.sim.jobs import SimJob
from adaptdl.sim.policies.base import Allocation, ClusterState, greedy_allocate, pack


class OptimusPolicy:
    """Greedy marginal reduction of estimated remaining time."""

    name = "optimus"
    adaptive = False

    def __init__(self, max_gpus_per_job: int | None = None) -> None:
        self.max_gpus_per_job = max_gpus_per_job
        # Rates change only with the epoch (gradient statistics): cache them per job.
        self._rates: dict[str, tuple[int, int, np.ndarray]] = {}

    def remaining_times(self, job: SimJob, max_gpus: int, gpus_per_node: int) -> np.ndarray:
        """Estimated remaining seconds with 1..max_gpus GPUs (index k-1)."""
        cached = self._rates.get(job.name)
        if cached is None or cached[0] != job.epoch or cached[1] != max_gpus:
            rates = np.empty(max_gpus)
            for k in range(1, max_gpus + 1):
                full, rem = divmod(k, gpus_per_node)
                placement = (gpus_per_node,) * full + ((rem,) if rem else ())
                rates[k - 1] = max(job.estimated_rate(placement), 1e-12)
            cached = (job.epoch, max_gpus, rates)
            self._rates[job.name] = cached
        return job.remaining_progress / cached[2]

    def allocate(self, state: ClusterState) -> Allocation:
        cap = state.total_gpus
        if self.max_gpus_per_job is not None:
            cap = min(cap, self.max_gpus_per_job)
        utilities = []
        for job in state.jobs:
            # More GPUs than the batch has samples (at the smallest local batch) are useless.
            k_max = max(1, min(cap, job.spec.batch_size // job.app.local_bsz_bounds[0]))
            t = self.remaining_times(job, k_max, state.gpus_per_node)
            # Utility: negated remaining time, offset so that 1 GPU has value t1 + 1.
            u = np.concatenate([[0.0], t[0] + 1.0 - t])
            utilities.append(u)
        active = {j.name for j in state.jobs}
        for name in [n for n in self._rates if n not in active]:
            del self._rates[name]
        alloc = greedy_allocate(utilities, state.total_gpus, min_first=True)
        counts = {j.name: a for j, a in zip(state.jobs, alloc, strict=True) if a > 0}
        return pack(state, counts)
