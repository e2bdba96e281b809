"""The adaptdl policy alone, on plain job views: its integer program is exact, and it
decides for live jobs, whose remaining progress nobody knows (``remaining_progress``
None). Its behaviour on simulated jobs: ``tests/sim/test_adaptdl_policy.py``."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.sched.views import View, profiled_hints

from adaptdl.core.decide.hints import goodput_fn_from_hints
from adaptdl.core.goodput import GradParams, PerfParams
from adaptdl.sched.policies import LIVE_POLICIES, AdaptDLPolicy, make_policy
from adaptdl.sched.policies.adaptdl import objective, solve_milp
from adaptdl.sched.policies.pollux import hints_speedup
from adaptdl.sched.round import allocation_round
from adaptdl.sched.view import ClusterState, JobView


def _brute_force(values: list[np.ndarray], capacity: int) -> float:
    best = -math.inf
    for counts in itertools.product(*(range(len(v)) for v in values)):
        if sum(counts) <= capacity:
            best = max(best, objective(values, counts))
    return best


value_tables = st.lists(
    st.lists(
        st.floats(min_value=-100.0, max_value=0.0, allow_nan=False), min_size=1, max_size=5
    ).map(np.array),
    min_size=1,
    max_size=4,
)


@settings(max_examples=60, deadline=None)
@given(values=value_tables, capacity=st.integers(0, 8))
def test_milp_is_exact_and_never_worse_than_greedy(
    values: list[np.ndarray], capacity: int
) -> None:
    solved = solve_milp(values, capacity, time_limit=5.0)
    assert solved is not None
    counts, optimal = solved
    assert optimal
    assert sum(counts) <= capacity
    assert objective(values, counts) == pytest.approx(_brute_force(values, capacity), abs=1e-6)
    greedy = AdaptDLPolicy._greedy(values, capacity)
    assert objective(values, counts) >= objective(values, greedy) - 1e-6


def test_milp_respects_forbidden_counts() -> None:
    # Job 0 may not run on 1 GPU (its minimum is 2): with 1 GPU free it gets none.
    values = [np.array([-10.0, -np.inf, -1.0]), np.array([-10.0, -5.0])]
    solved = solve_milp(values, 1, time_limit=5.0)
    assert solved is not None and solved[0] == [0, 1]


def test_milp_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="capacity"):
        solve_milp([np.zeros(2)], -1, 1.0)
    with pytest.raises(ValueError, match="time_limit"):
        solve_milp([np.zeros(2)], 1, 0.0)


def _state(*jobs: JobView, nodes: int = 2, time: float = 600.0) -> ClusterState:
    return ClusterState(
        time=time,
        num_nodes=nodes,
        gpus_per_node=4,
        up=(True,) * nodes,
        jobs=jobs,
        interval=60.0,
        restart_penalty=30.0,
    )


def test_adaptdl_is_a_live_policy() -> None:
    assert "adaptdl" in LIVE_POLICIES
    assert isinstance(make_policy("adaptdl"), AdaptDLPolicy)


def _trapped_hints() -> dict[str, Any]:
    """Hints of a job profiled up to 4 replicas (2 nodes) whose fit found a steep
    per-replica cross-node slope there: 0.05 + 0.5 s per replica past two."""
    hints = dict(profiled_hints((1, 2, 4), grad=GradParams(1.0, 100.0)))
    hints["perf_params"] = PerfParams(0.01, 0.01, 0.05, 0.5, 0.02, 1e-8, 1.0).to_dict()
    hints["max_profiled_replicas"] = 4
    hints["max_profiled_nodes"] = 2
    return hints


def test_a_slope_fitted_on_small_counts_does_not_keep_a_job_small() -> None:
    # yolov3 in the Pollux traces: a slope from its first few cross-node steps made
    # every count past 4 look slower, so it was never tried (and never corrected) with
    # most of the cluster idle. Held flat past 4, the job is tried on 16.
    hints = _trapped_hints()
    held_fn, fitted_fn = (
        goodput_fn_from_hints(hints, optimistic=True),
        goodput_fn_from_hints(hints),
    )
    assert held_fn is not None and held_fn.network_flat_beyond == 4
    assert fitted_fn is not None and fitted_fn.network_flat_beyond is None
    plain, _ = hints_speedup(hints, 16, 4)
    held, _ = hints_speedup(hints, 16, 4, optimistic=True)
    np.testing.assert_array_equal(held[:5], plain[:5])  # what was profiled is unchanged
    assert plain[16] < plain[4] < held[16]
    job = View("trapped", nodes=[0, 0, 0, 0], started=0.0, run_time=600.0, hints=hints)
    state = _state(job, nodes=4)
    assert len(AdaptDLPolicy(optimistic=False).allocate(state)["trapped"]) == 4
    assert len(AdaptDLPolicy().allocate(state)["trapped"]) == 16


def test_live_jobs_with_unknown_remaining_progress_are_scheduled() -> None:
    # Live views: remaining progress unknown, one running on 2 GPUs, two waiting.
    hints = profiled_hints((1, 2))
    jobs = (
        View("run", submit=0.0, nodes=[0, 0], started=0.0, hints=hints),
        View("old", submit=10.0, hints=hints),
        View("new", submit=500.0, hints=hints),
    )
    state = _state(*jobs, nodes=1)
    policy = AdaptDLPolicy()
    done = allocation_round(policy, state)  # checked against the cluster and bounds
    assert done.nodes("run")  # a running job is not preempted
    assert sum(len(done.nodes(j.name)) for j in jobs) <= 4
    # Unknown jobs all count as unknown_remaining seconds alone: admitted by age.
    assert policy.remaining_alone(jobs[1], state) == policy.unknown_remaining
    assert policy.response_ratio(jobs[1], state) > policy.response_ratio(jobs[2], state)
    assert np.all(np.isfinite(policy.values(jobs[0], state)[1:]))


def test_unknown_remaining_sets_the_amortisation_of_a_restart() -> None:
    # A job thought nearly done loses more, relatively, by moving than one thought long.
    hints = profiled_hints((1, 2))
    job = View("j", nodes=[0], started=0.0, hints=hints)
    state = _state(job)
    short, long = AdaptDLPolicy(unknown_remaining=60.0), AdaptDLPolicy(unknown_remaining=3600.0)
    v_short, v_long = short.values(job, state), long.values(job, state)
    assert v_short[2] / v_short[1] > v_long[2] / v_long[1]


@settings(max_examples=25, deadline=None)
@given(
    known=st.lists(st.one_of(st.none(), st.floats(1.0, 1e4)), min_size=1, max_size=6),
    held=st.lists(st.integers(0, 4), min_size=6, max_size=6),
)
def test_known_and_unknown_jobs_together_fit_the_cluster(
    known: list[float | None], held: list[int]
) -> None:
    hints = profiled_hints((1, 2))
    jobs = []
    node = 0
    for i, remaining in enumerate(known):
        gpus = held[i] if node < 2 else 0
        nodes = [node] * gpus
        node += 1 if gpus else 0
        jobs.append(
            View(
                f"j{i}",
                submit=float(i),
                nodes=nodes,
                started=0.0 if nodes else None,
                remaining_progress=remaining,
                hints=hints,
            )
        )
    # allocation_round raises AllocationError on an answer the cluster cannot hold.
    done = allocation_round(AdaptDLPolicy(), _state(*jobs))
    assert all(len(done.nodes(j.name)) in (0, *range(j.min_replicas, 9)) for j in jobs)
