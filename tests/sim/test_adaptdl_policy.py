"""The adaptdl policy on simulated jobs: its allocations are feasible, and each of its
ingredients does what it claims (small synthetic jobs; the trace runs belong to
``adaptdl-sim ablation`` and the benchmark). Its integer program and its reading of
live job views: ``tests/sched/test_adaptdl_policy.py``."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptdl.sched.policies import AdaptDLPolicy, ClusterState, make_policy
from adaptdl.sched.policies.adaptdl import ABLATIONS
from adaptdl.sim.apps import builtin_applications
from adaptdl.sim.cli import main
from adaptdl.sim.cluster import ClusterConfig, simulate
from adaptdl.sim.jobs import SimJob
from adaptdl.sim.metrics import alone_seconds
from adaptdl.sim.workload import JobSpec, synthetic_workload

APPS = builtin_applications()
APP = APPS["resnet-small"]


def _job(name: str, submit: float, *, progress: float = 0.0) -> SimJob:
    spec = JobSpec(name, submit, APP.name, 1, APP.init_batch_size)
    job = SimJob(spec, APP, adaptive=True)
    job.progress = progress
    return job


def _profiled(name: str, submit: float, gpus: int, nodes: list[int] | None = None) -> SimJob:
    """A job that has run on ``gpus`` GPUs (so its hints carry a model) and holds them."""
    job = _job(name, submit)
    placed = nodes if nodes is not None else [0] * gpus
    job.set_allocation(submit, placed, 30.0)
    return job


def _state(jobs: list[SimJob], nodes: int = 2, gpus: int = 4, time: float = 600.0) -> ClusterState:
    return ClusterState(
        time=time,
        num_nodes=nodes,
        gpus_per_node=gpus,
        up=(True,) * nodes,
        jobs=tuple(sorted(jobs, key=lambda j: (j.submit, j.name))),
        interval=60.0,
        restart_penalty=30.0,
    )


@settings(max_examples=25, deadline=None)
@given(
    held=st.lists(st.integers(0, 4), min_size=1, max_size=6),
    bounds=st.lists(
        st.tuples(
            st.one_of(st.none(), st.integers(1, 4)), st.one_of(st.none(), st.integers(1, 8))
        ),
        min_size=6,
        max_size=6,
    ),
    exact=st.booleans(),
)
def test_allocation_fits_the_cluster_and_each_jobs_bounds(
    held: list[int], bounds: list[tuple[int | None, int | None]], exact: bool
) -> None:
    jobs = []
    free_node = 0
    for i, gpus in enumerate(held):
        if gpus and free_node < 4:
            job = _profiled(f"j{i}", float(i), gpus, [free_node] * gpus)
            free_node += 1
        else:
            job = _job(f"j{i}", float(i))
        lo, hi = bounds[i]
        job.min_replicas = 1 if lo is None else lo  # type: ignore[misc]
        if hi is not None and hi >= job.min_replicas:
            job.max_replicas = hi
        jobs.append(job)
    state = _state(jobs, nodes=4)
    alloc = AdaptDLPolicy(exact=exact).allocate(state)
    per_node: Counter[int] = Counter()
    for nodes in alloc.values():
        per_node.update(nodes)
    assert all(c <= state.gpus_per_node for c in per_node.values())
    for job in jobs:
        n = len(alloc.get(job.name, ()))
        if n:
            assert job.min_replicas <= n <= job.max_replicas


def test_restart_cost_is_amortised_over_the_remaining_time() -> None:
    # The same job near its end and at its start: a resize is worth less near the end.
    policy = AdaptDLPolicy(weight=0.0, horizon=None)
    fresh = _profiled("fresh", 0.0, 1)
    ending = _profiled("ending", 0.0, 1)
    ending.progress = APP.target_progress * 0.999
    state = _state([fresh, ending])
    v_fresh, v_ending = policy.values(fresh, state), policy.values(ending, state)
    # Relative loss of moving from 1 to 2 GPUs (values are -speedup^p, negative).
    assert v_ending[2] / v_ending[1] > v_fresh[2] / v_fresh[1]
    off = AdaptDLPolicy(weight=0.0, amortise=False)
    assert off.values(ending, state)[2] == pytest.approx(off.values(fresh, state)[2])


@settings(max_examples=15, deadline=None)
@given(
    done=st.lists(
        st.sampled_from([0.0, 0.2, 0.5, 0.8, 0.95]), min_size=1, max_size=5, unique=True
    ),
    weight=st.sampled_from([-1.0, -0.5]),
)
def test_the_weight_is_the_jobs_rank_by_remaining_time_not_its_size(
    done: list[float], weight: float
) -> None:
    # heSRPT's weight: the count of jobs predicted to need at least as long (itself
    # included), so the shortest of n jobs weighs n ** -weight and the longest 1,
    # however long they are.
    jobs = []
    for i, fraction in enumerate(done):
        job = _profiled(f"j{i}", 0.0, 1, [i % 2])
        job.progress = APP.target_progress * fraction
        jobs.append(job)
    state = _state(jobs)
    policy = AdaptDLPolicy(weight=weight)
    weights = policy.job_weights(state)
    alone = {job.name: policy.remaining_alone(job, state) for job in jobs}
    for job in jobs:
        n = sum(t >= alone[job.name] for t in alone.values())
        assert weights[job.name] == pytest.approx(n**-weight)
    # Making the longest job longer changes no weight; by size (rank off) it does.
    by_size = AdaptDLPolicy(weight=weight, rank=False).job_weights(state)
    longest = max(jobs, key=lambda j: alone[j.name])
    longer = longest.progress > 0
    longest.progress = 0.0
    relonger = _state(jobs)
    assert AdaptDLPolicy(weight=weight).job_weights(relonger) == pytest.approx(weights)
    resized = AdaptDLPolicy(weight=weight, rank=False).job_weights(relonger)
    if longer:
        assert resized[longest.name] < by_size[longest.name]


def test_a_job_resized_every_round_is_charged_its_restarts_over_that_time() -> None:
    # A lone job on an empty cluster grows every round (4 x its profiled GPUs): its
    # measured time per configuration falls from the horizon, and a change costs it
    # more than it would over its remaining time alone.
    # Its rounds come at uneven times (a live scheduler also runs one when a job
    # arrives or ends): what counts is the time it held GPUs, not rounds x interval.
    policy = AdaptDLPolicy(weight=0.0)
    job = _profiled("grows", 0.0, 1, [0])
    assert policy.hold_time(job) == policy.horizon
    now = 0.0
    for rounds in range(1, 16):
        now += 7.0 * rounds
        job.advance(now)
        job.progress = 0.0  # its remaining time stays longer than the hold
        state = _state([job], nodes=4, time=now)
        alloc = policy.allocate(state)
        assert sorted(alloc["grows"]) != sorted(job.nodes)
        assert job.run_time == pytest.approx(now)
        assert policy.hold_time(job) == pytest.approx((now + 3600.0) / (rounds + 1))
    state = _state([job], nodes=4, time=now)
    v = policy.values(job, state)
    unmeasured = AdaptDLPolicy(weight=0.0, measured_hold=False).values(job, state)
    assert v[2] / v[1] > unmeasured[2] / unmeasured[1]  # values < 0: a larger loss
    policy.allocate(_state([_profiled("other", 0.0, 1, [0])], nodes=4))
    # A job that left is forgotten: back with no changes counted.
    assert policy.hold_time(job) == pytest.approx(now + 3600.0)


def test_a_short_job_has_the_higher_response_ratio_and_waiting_raises_it() -> None:
    policy = AdaptDLPolicy()
    short = _profiled("short", 0.0, 1)
    short.progress = APP.target_progress * 0.9
    long = _profiled("long", 0.0, 1)
    state = _state([short, long])
    assert policy.response_ratio(short, state) > policy.response_ratio(long, state)
    later = _state([short, long], time=state.time + 10 * 3600)
    assert policy.response_ratio(long, later) > policy.response_ratio(long, state)


def test_the_one_free_gpu_goes_to_the_short_waiting_job_not_the_earlier_long_one() -> None:
    running = _profiled("running", 0.0, 1, [0])
    long = _profiled("long", 1.0, 1, [0])
    long.set_allocation(2.0, [], 30.0)  # profiled, then preempted: waiting
    short = _profiled("short", 3.0, 1, [0])
    short.set_allocation(4.0, [], 30.0)
    short.progress = APP.target_progress * 0.95
    state = _state([running, long, short], nodes=1, gpus=2)
    alloc = AdaptDLPolicy().allocate(state)
    assert "short" in alloc and "long" not in alloc
    assert alloc["running"] == [0]  # a running job is not preempted
    fifo = AdaptDLPolicy(priority=False).allocate(state)
    assert "long" in fifo and "short" not in fifo


def test_no_job_starves_on_a_crowded_cluster() -> None:
    # More jobs than GPUs for hours: every job still finishes.
    jobs = synthetic_workload(APPS, 12, duration=600.0, seed=3, max_replicas=4)
    result = simulate(jobs, APPS, make_policy("adaptdl"), ClusterConfig(num_nodes=1))
    assert result.unfinished == 0
    assert all(j.finish is not None for j in result.jobs)


def test_rounds_record_the_solver_time() -> None:
    policy = AdaptDLPolicy()
    jobs = synthetic_workload(APPS, 6, duration=600.0, seed=1, max_replicas=4)
    result = simulate(jobs, APPS, policy, ClusterConfig(num_nodes=2))
    assert len(policy.rounds) == result.rounds
    assert all(seconds >= 0 and n >= 1 for seconds, n, _ in policy.rounds)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"fairness": 0.5}, "fairness"),
        ({"weight": 5.0}, "weight"),
        ({"horizon": 0.0}, "horizon"),
        ({"time_budget": 0.0}, "time_budget"),
        ({"min_gain": -0.1}, "min_gain"),
        ({"explore_factor": 0}, "explore_factor"),
        ({"unknown_remaining": 0.0}, "unknown_remaining"),
    ],
)
def test_bad_constants_are_rejected_by_name(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AdaptDLPolicy(**kwargs)  # type: ignore[arg-type]


def test_ablation_prints_pollux_and_each_ingredient_off(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "w.csv").write_text(
        "name,time,application,num_replicas,batch_size\na,0,resnet-small,1,256\nb,30,speech,2,40\n"
    )
    assert main(["ablation", str(tmp_path / "w.csv"), "--nodes", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out["mean"]) == ["pollux", *ABLATIONS]
    for summary in out["mean"].values():
        assert summary["unfinished"] == 0 and summary["max_round_seconds"] >= 0


def test_slowdown_against_running_alone() -> None:
    # The oracle never gets slower with more GPUs, and a job run alone is near it.
    small = alone_seconds(APP, 4, 4)
    assert alone_seconds(APP, 16, 4) <= small
    jobs = synthetic_workload(APPS, 1, duration=60.0, seed=0, max_replicas=4)
    result = simulate(jobs, APPS, make_policy("adaptdl"), ClusterConfig(num_nodes=1))
    (job,) = result.jobs
    assert job.slowdown is not None and 0.9 < job.slowdown < 5.0
    assert result.max_slowdown == job.slowdown
