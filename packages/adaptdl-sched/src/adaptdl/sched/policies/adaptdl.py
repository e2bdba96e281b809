"""AdaptDL's own policy: admission by response ratio, then an exact allocation over
candidate configurations per job, with restart costs amortised over each job's
predicted remaining time.

Each round has two steps.

**Admission.** Jobs holding GPUs keep at least their minimum (no preemption to
zero). Waiting jobs are admitted, while GPUs are left, by response ratio
``(age_j + T1_j) / T1_j``, ``T1_j`` the job's predicted remaining time on one GPU
(its remaining progress over its goodput there; one round before its hints carry a
model, so a new job starts and profiles): short jobs first, and a waiting job's ratio
grows with its age, so none starves (a long job waits at most until its ratio passes
the short ones'). With ``priority=False``, by submission order.

**Scaling.** Every admitted job ``j`` gets a value ``v_j(k)`` for each candidate
configuration ``k`` (a count of GPUs from its minimum to its cap, packed onto the
fewest nodes, ``ceil(k / gpus_per_node)``), and the allocation maximises
``sum_j v_j(k_j)`` within the cluster's GPUs:

* **speedup** ``s_j(k)``: the job's goodput with ``k`` GPUs over its goodput with one,
  each at the batch size the job's own goodput engine would pick there (core's model,
  rebuilt from the job's hints by ``goodput_fn_from_hints``, as pollux does);
* **optimism past what was profiled**: the speedups come from the job's model with
  its synchronisation time held flat past the most replicas it has run on
  (``optimistic``; core's ``GoodputFunction.network_flat_beyond``). A per-replica
  network slope fitted on a few small counts can make every larger count look
  slower than the job's current one, and a count never tried never corrects it
  (yolov3 in the Pollux traces sat on 4 GPUs for hours while dozens were idle);
  held flat, the job is tried larger (within ``explore_factor`` times its largest
  count) and the fit learns from what it measures there;
* **restart cost, amortised**: a configuration other than the job's current one costs
  it its restart cost ``R_j`` once. Over the time ``H_j(k)`` the new configuration
  will be held, the effective speedup is ``s_j(k) * H_j(k) / (H_j(k) + R_j)``: a
  change pays off only if it buys back its restart before the job ends or changes
  again. ``H_j(k)`` is the least of the job's predicted remaining time at ``k`` (its
  remaining progress over its rate there), ``horizon``, and, with
  ``measured_hold``, the job's own measured time between its allocation changes,
  ``(its run time on GPUs + horizon) / (its changes + 1)`` (``horizon`` counts as one
  prior observation, so a new job starts at ``horizon``): a job that is resized
  often (a long job filling the GPUs that short jobs come and go from) is charged
  its restarts over the short time it actually keeps a configuration;
* **objective**: ``v_j(k) = -n_j ** (-weight) * s_j(k) ** fairness``, a p-mean
  (``fairness`` p < 0 protects the slowest jobs) weighted towards the jobs nearer
  their end: ``n_j`` is the count of active jobs (waiting ones included) whose
  predicted remaining time on one GPU ``T1_j`` is at least the job's (itself
  included), the number of jobs whose completion waits on this one's in
  shortest-remaining-first order. After heSRPT (Berg, Vesilo and Harchol-Balter,
  2020: the split of a parallelisable resource among jobs of known sizes that
  minimises mean flow time depends on each job's rank by size, not on the sizes),
  the weight is the job's rank, not its size, so a
  long job's share does not shrink with how long it is (the tail stays close to
  pollux's) and the lean to short jobs is the same at every load. With
  ``rank=False`` the weight is ``(T1_j / 1 h) ** weight`` (the size itself);
* **exact where cheap**: the multiple-choice knapsack is solved as an integer program
  by ``scipy.optimize.milp`` (HiGHS) within ``time_budget`` seconds; the greedy
  best-gain-per-GPU allocation is always computed too and the better of the two kept,
  so a solver stopped by its budget never does worse than the fallback;
* **hysteresis**: a new allocation must beat keeping the current one (topped up with
  the free GPUs) by ``min_gain`` of the objective, as in pollux.

Every ingredient can be switched off (``amortise=False``,
``measured_hold=False``, ``priority=False``, ``exact=False``, ``weight=0``,
``rank=False``, ``min_gain=0``, ``optimistic=False``): :data:`ABLATIONS`, run by
``adaptdl-sim ablation``.

What the policy reads of each job (the job view the live scheduler will carry):

* ``job.name``: its identity (the key of the returned allocation);
* ``job.submit``: submission time (its age, for the response ratio);
* ``job.hints``: core's scheduling hints (``adaptdl.hints/1``), read only through
  ``goodput_fn_from_hints`` and the hints' own bounds (``hints_speedup``);
* ``job.nodes``: its current placement, one node index per GPU;
* ``job.remaining_progress``: its own estimate of the work left (scale-invariant
  progress, as pollux reads it), or None where nobody knows it (a live job). An
  unknown job counts as needing ``unknown_remaining`` seconds on one GPU (default an
  hour, the amortisation ``horizon``): its response ratio then grows with its age
  alone (first come, first served among unknown jobs), and a restart is amortised over
  that time at each count;
* ``job.min_replicas``, ``job.max_replicas``: its bounds;
* ``job.restart_cost``: its seconds per restart (measured by the live scheduler where
  it could, else the cluster's default; the simulator's jobs carry the cluster's
  ``restart_penalty``, the cost it charges every policy's restarts alike);
* ``job.run_time``: the seconds it has held GPUs (for its measured hold time).

All of these are members of ``adaptdl.sched.view.JobView``: the simulator and the
live scheduler (``adaptdl.sched.scheduler``) run this policy alike.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import csr_matrix

from adaptdl.core.validate import check_float, check_int
from adaptdl.sched.policies.base import Allocation, greedy_allocate, pack
from adaptdl.sched.policies.pollux import SpeedupCache, batch_gpu_cap
from adaptdl.sched.view import ClusterState, JobView

FloatArray = npt.NDArray[np.float64]

# Speedup a job with no GPUs counts as (finite, so that the p-mean stays finite).
_NO_GPU_SPEEDUP = 1e-3


def objective(values: Sequence[FloatArray], alloc: Sequence[int]) -> float:
    """``sum_j values[j][alloc[j]]``, -inf where an entry is not allowed (-inf)."""
    return float(sum(float(v[a]) for v, a in zip(values, alloc, strict=True)))


def solve_milp(
    values: Sequence[FloatArray], capacity: int, time_limit: float
) -> tuple[list[int], bool] | None:
    """Choose one count per job (``values[j][k]``: job j's value with k GPUs; -inf: not
    allowed) maximising the sum within ``capacity`` GPUs, as an integer program.

    Returns ``(counts, optimal)``: ``optimal`` is False where HiGHS stopped at
    ``time_limit`` with a feasible but unproven answer; None where it found none.
    Only non-dominated counts become variables (a count worth no more than a smaller
    one is never better), which keeps the program small.
    """
    check_int("capacity", capacity, min=0)
    check_float("time_limit", time_limit, min=0.0, min_exclusive=True)
    cols_job: list[int] = []
    cols_k: list[int] = []
    cost: list[float] = []
    for j, v in enumerate(values):
        best = -math.inf
        for k, value in enumerate(v):
            if k > capacity or not math.isfinite(value) or value <= best:
                continue
            best = float(value)
            cols_job.append(j)
            cols_k.append(k)
            cost.append(-best)
    n = len(values)
    if n == 0:
        return [], True
    if len(set(cols_job)) < n:
        return None  # a job with no allowed count within capacity
    m = len(cost)
    # Shift each job's values so the smallest is 0: same optimum, better conditioning.
    c = np.array(cost)
    jobs = np.array(cols_job)
    ks = np.array(cols_k, dtype=np.float64)
    shift = np.zeros(n)
    np.maximum.at(shift, jobs, c)
    c = c - shift[jobs]
    one = csr_matrix((np.ones(m), (jobs, np.arange(m))), shape=(n, m))
    cap = csr_matrix(ks.reshape(1, -1))
    res = milp(
        c,
        integrality=np.ones(m),
        bounds=Bounds(0, 1),
        constraints=[
            LinearConstraint(one, np.ones(n), np.ones(n)),
            LinearConstraint(cap, -np.inf, capacity),
        ],
        options={"time_limit": time_limit, "presolve": True},
    )
    if res.x is None:
        return None
    chosen = np.flatnonzero(res.x > 0.5)
    counts = [0] * n
    for col in chosen:
        counts[cols_job[col]] = cols_k[col]
    if sum(counts) > capacity:
        return None
    return counts, bool(res.status == 0)


#: The ablation (``adaptdl-sim ablation``): the policy, then each ingredient off in turn.
ABLATIONS: dict[str, dict[str, Any]] = {
    "adaptdl": {},
    "no amortised restarts": {"amortise": False},
    "amortised over remaining time only": {"measured_hold": False},
    "greedy, no MILP": {"exact": False},
    "FIFO admission": {"priority": False},
    "unweighted p-mean": {"weight": 0.0},
    "weight by size, not rank": {"rank": False},
    "no hysteresis": {"min_gain": 0.0},
    "network extrapolated past what was profiled": {"optimistic": False},
}


class AdaptDLPolicy:
    """Exact, restart-aware, short-first allocation (see the module's docstring)."""

    name = "adaptdl"
    adaptive = True

    def __init__(
        self,
        *,
        fairness: float = -0.5,
        priority: bool = True,
        weight: float = -1.0,
        amortise: bool = True,
        horizon: float | None = 3600.0,
        exact: bool = True,
        time_budget: float = 0.5,
        min_gain: float = 0.01,
        explore_factor: int = 4,
        unknown_remaining: float = 3600.0,
        rank: bool = True,
        measured_hold: bool = True,
        optimistic: bool = True,
    ) -> None:
        check_float("fairness", fairness, min=-10.0, max=-1e-3)
        check_float("weight", weight, min=-2.0, max=2.0)
        if horizon is not None:
            check_float("horizon", horizon, min=0.0, min_exclusive=True)
        check_float("time_budget", time_budget, min=0.0, min_exclusive=True)
        check_float("min_gain", min_gain, min=0.0)
        check_int("explore_factor", explore_factor, min=1)
        check_float("unknown_remaining", unknown_remaining, min=0.0, min_exclusive=True)
        self.fairness = fairness
        self.priority = priority
        self.weight = weight
        self.amortise = amortise
        self.horizon = horizon
        self.exact = exact
        self.time_budget = time_budget
        self.min_gain = min_gain
        self.explore_factor = explore_factor
        self.unknown_remaining = unknown_remaining
        self.rank = rank
        self.measured_hold = measured_hold
        self.optimistic = optimistic
        #: Per job: its allocation changes over the rounds seen (its seconds on GPUs are
        #: its own `run_time`).
        self._changes: dict[str, int] = {}
        self._weights: tuple[ClusterState | None, dict[str, float]] = (None, {})
        #: Per round: (CPU seconds of allocate, jobs, whether the MILP proved its optimum).
        self.rounds: list[tuple[float, int, bool]] = []
        self._speedups = SpeedupCache(optimistic=optimistic)

    # -- per-job view --------------------------------------------------------------

    def replica_bounds(self, job: JobView, state: ClusterState) -> tuple[int, int]:
        """(fewest GPUs when running, most GPUs) for the job this round."""
        hints = job.hints
        cap = min(state.total_gpus, job.max_replicas)
        profiled: int = hints["max_profiled_replicas"]
        cap = min(cap, max(1, self.explore_factor * profiled))
        cap = min(cap, batch_gpu_cap(hints))
        lo = max(1, job.min_replicas)
        return lo, cap

    def _speedup(self, job: JobView, cap: int, gpus_per_node: int) -> tuple[FloatArray, float]:
        return self._speedups(job, cap, gpus_per_node)

    def remaining_alone(self, job: JobView, state: ClusterState) -> float:
        """Predicted seconds the job needs on one GPU from now; ``state.interval`` before
        its hints carry a model (unknown: a new job counts as short, so that it runs
        and profiles soon); ``unknown_remaining`` where its remaining progress is
        unknown (a live job)."""
        _, cap = self.replica_bounds(job, state)
        _, base = self._speedup(job, cap, state.gpus_per_node)
        rate = base / float(job.hints["init_batch_size"])
        if rate <= 0:
            return state.interval
        remaining = job.remaining_progress
        if remaining is None:
            return max(self.unknown_remaining, state.interval)
        return max(float(remaining) / rate, state.interval)

    def response_ratio(self, job: JobView, state: ClusterState) -> float:
        """(age + remaining time alone) / remaining time alone: highest first."""
        alone = self.remaining_alone(job, state)
        return (max(state.time - float(job.submit), 0.0) + alone) / alone

    def values(self, job: JobView, state: ClusterState) -> FloatArray:
        """The job's value with 0..cap GPUs once admitted (-inf where its bounds forbid
        the count; 0 GPUs is forbidden: an admitted job keeps at least its minimum)."""
        lo, cap = self.replica_bounds(job, state)
        speedup, base = self._speedup(job, cap, state.gpus_per_node)
        restart = float(job.restart_cost)
        k = np.arange(len(speedup))
        s = speedup.copy()
        cur = len(job.nodes)
        if self.amortise:
            # Seconds left at each count: progress left over progress per second
            # there (goodput over the initial batch size; unknown before a profile).
            rate = speedup * base / job.hints["init_batch_size"]
            remaining = job.remaining_progress
            if remaining is None:
                # Unknown work left (a live job): unknown_remaining seconds on one GPU,
                # in progress at the rate one GPU makes.
                remaining = self.unknown_remaining * base / job.hints["init_batch_size"]
            with np.errstate(divide="ignore"):
                left = np.where(rate > 0, remaining / np.maximum(rate, 1e-300), np.inf)
            held = left if self.horizon is None else np.minimum(left, self.horizon)
            if self.measured_hold and self.horizon is not None:
                held = np.minimum(held, self.hold_time(job))
            changed = k != cur
            with np.errstate(invalid="ignore"):
                kept = np.where(np.isfinite(held), held / (held + restart), 1.0)
            s = np.where(changed & (k > 0), s * kept, s)
        s = np.maximum(s, _NO_GPU_SPEEDUP)
        out: FloatArray = -np.power(s, self.fairness)
        if self.weight != 0:
            out = out * self.job_weights(state)[job.name]
        out[k < lo] = -np.inf
        return out

    def job_weights(self, state: ClusterState) -> dict[str, float]:
        """Each active job's weight in the objective: ``n_j ** -weight``, ``n_j`` the
        count of jobs predicted to need at least as long on one GPU (itself included);
        ``(T1_j / 1 h) ** weight`` with ``rank`` off. Computed once per round."""
        if self._weights[0] is state:
            return self._weights[1]
        alone = {job.name: self.remaining_alone(job, state) for job in state.jobs}
        if self.rank:
            # Finishing a job sooner shortens the wait of every job still behind it in
            # shortest-remaining-first order: the count of those is its weight.
            times = np.sort(np.fromiter(alone.values(), dtype=np.float64, count=len(alone)))
            at_least = {
                name: len(times) - int(np.searchsorted(times, t, side="left"))
                for name, t in alone.items()
            }
            weights = {name: float(n) ** -self.weight for name, n in at_least.items()}
        else:
            weights = {name: (t / 3600.0) ** self.weight for name, t in alone.items()}
        self._weights = (state, weights)
        return weights

    def hold_time(self, job: JobView) -> float:
        """Seconds the job is expected to keep a new configuration: the seconds it has
        held GPUs (``job.run_time``) per allocation change, with ``horizon`` as one
        prior observation (``horizon`` for a job not seen yet; infinite without a
        horizon). Its run time, not rounds times the interval: a live scheduler also
        runs a round when a job arrives or ends, and a job's GPUs count from when it
        got them."""
        if self.horizon is None:
            return math.inf
        changes = self._changes.get(job.name, 0)
        return (float(job.run_time) + self.horizon) / (changes + 1.0)

    # -- the round -------------------------------------------------------------------

    def admit(self, state: ClusterState) -> list[bool]:
        """Which jobs hold GPUs this round: the running ones keep theirs (no
        preemption), then the waiting ones by response ratio while GPUs are left
        (by submission with ``priority`` off)."""
        free = state.total_gpus
        admitted = [False] * len(state.jobs)
        bounds = [self.replica_bounds(job, state) for job in state.jobs]
        # A job whose minimum exceeds its most GPUs cannot run this round.
        mins = [lo if lo <= hi else state.total_gpus + 1 for lo, hi in bounds]
        running = [bool(j.nodes) and all(state.up[n] for n in j.nodes) for j in state.jobs]
        for i in range(len(state.jobs)):
            if running[i] and mins[i] <= free:
                admitted[i] = True
                free -= mins[i]
        waiting = [i for i in range(len(state.jobs)) if not running[i]]
        if self.priority:
            waiting.sort(key=lambda i: -self.response_ratio(state.jobs[i], state))
        for i in waiting:
            if mins[i] <= free:
                admitted[i] = True
                free -= mins[i]
        return admitted

    def allocate(self, state: ClusterState) -> Allocation:
        start = time.process_time()
        admitted = self.admit(state)
        jobs = [j for j, a in zip(state.jobs, admitted, strict=True) if a]
        values = [self.values(job, state) for job in jobs]
        capacity = state.total_gpus
        floor = [int(np.argmax(np.isfinite(v))) for v in values]
        alloc = self._greedy(values, capacity, start=floor)
        optimal = False
        if self.exact:
            solved = solve_milp(values, capacity, self.time_budget)
            if solved is not None:
                counts, optimal = solved
                if objective(values, counts) >= objective(values, alloc):
                    alloc = counts
        if self.min_gain > 0:
            current = [
                min(max(len(j.nodes) if all(state.up[n] for n in j.nodes) else 0, lo), len(v) - 1)
                for j, lo, v in zip(jobs, floor, values, strict=True)
            ]
            if sum(current) <= capacity and math.isfinite(objective(values, current)):
                kept = self._greedy(values, capacity, start=current)
                value_new, value_kept = objective(values, alloc), objective(values, kept)
                if value_new <= value_kept + self.min_gain * abs(value_kept):
                    alloc = kept
        chosen = {j.name: a for j, a in zip(jobs, alloc, strict=True) if a > 0}
        out = pack(state, chosen)
        self._record(state, out)
        self.rounds.append((time.process_time() - start, len(state.jobs), optimal))
        return out

    def _record(self, state: ClusterState, out: Allocation) -> None:
        """Count each running job's allocation changes (a count or a placement other
        than the one it holds), for :meth:`hold_time`; forget the jobs that left."""
        changes = {}
        for job in state.jobs:
            count = self._changes.get(job.name, 0)
            if job.nodes and sorted(out.get(job.name, ())) != sorted(job.nodes):
                count += 1
            changes[job.name] = count
        self._changes = changes

    @staticmethod
    def _greedy(
        values: Sequence[FloatArray], capacity: int, start: Sequence[int] | None = None
    ) -> list[int]:
        """Greedy best gain per GPU, never landing on a forbidden count."""
        # A forbidden count (below min replicas) is bridged: the jump from 0 straight
        # to the minimum is one of the greedy's steps.
        finite = [np.where(np.isfinite(v), v, -1e300) for v in values]
        return greedy_allocate(finite, capacity, start=start)
