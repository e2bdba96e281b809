"""Each policy's defining behaviour, and that no allocation exceeds the cluster."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptdl.sched.policies import (
    POLICIES,
    ClusterState,
    FifoPolicy,
    OptimusPolicy,
    PolluxPolicy,
    TiresiasPolicy,
    greedy_allocate,
    make_policy,
    pack,
)
from adaptdl.sched.round import AllocationError
from adaptdl.sim.apps import builtin_applications
from adaptdl.sim.cluster import ClusterConfig, simulate
from adaptdl.sim.jobs import SimJob
from adaptdl.sim.workload import JobSpec, synthetic_workload

APPS = builtin_applications()
APP = APPS["resnet-small"]


def _job(name: str, submit: float, replicas: int, *, adaptive: bool = False) -> SimJob:
    spec = JobSpec(name, submit, APP.name, replicas, APP.init_batch_size * 2)
    return SimJob(spec, APP, adaptive=adaptive)


def _state(
    jobs: list[SimJob], nodes: int = 2, gpus: int = 4, time: float = 1000.0
) -> ClusterState:
    return ClusterState(
        time=time,
        num_nodes=nodes,
        gpus_per_node=gpus,
        up=(True,) * nodes,
        jobs=tuple(sorted(jobs, key=lambda j: j.submit)),
        interval=60.0,
        restart_penalty=30.0,
    )


def _per_node(alloc: dict[str, list[int]]) -> Counter[int]:
    c: Counter[int] = Counter()
    for nodes in alloc.values():
        c.update(nodes)
    return c


def test_fifo_never_runs_a_later_job_before_an_earlier_waiting_one() -> None:
    running = _job("a", 0.0, 6)
    running.set_allocation(0.0, [0, 0, 0, 0, 1, 1], 30.0)
    waiting = _job("b", 10.0, 4)  # needs 4, only 2 free
    later = _job("c", 20.0, 2)  # would fit, but b is first
    alloc = FifoPolicy().allocate(_state([running, waiting, later]))
    assert "b" not in alloc and "c" not in alloc
    assert sorted(alloc["a"]) == [0, 0, 0, 0, 1, 1]


def test_fifo_admits_in_submission_order_when_they_fit() -> None:
    jobs = [_job("a", 0.0, 4), _job("b", 1.0, 2), _job("c", 2.0, 4)]
    alloc = FifoPolicy().allocate(_state(jobs))
    assert set(alloc) == {"a", "b"}


def test_tiresias_demotes_a_job_past_its_threshold() -> None:
    policy = TiresiasPolicy(thresholds=(100.0,))
    old = _job("old", 0.0, 8)
    old.set_allocation(0.0, [0] * 4 + [1] * 4, 30.0)
    old.advance(50.0)  # 8 GPUs x 50 s = 400 GPU-seconds > 100
    new = _job("new", 40.0, 8)
    state = _state([old, new], time=50.0)
    assert policy.queue(old, 50.0) == 1 and policy.queue(new, 50.0) == 0
    alloc = policy.allocate(state)
    assert set(alloc) == {"new"}  # the demoted job is preempted by the fresh one


def test_tiresias_promotes_a_starving_job() -> None:
    policy = TiresiasPolicy(thresholds=(100.0,), starve_factor=2.0)
    old = _job("old", 0.0, 8)
    old.set_allocation(0.0, [0] * 4 + [1] * 4, 30.0)
    old.advance(50.0)
    old.set_allocation(50.0, [], 30.0)  # preempted after 50 s of running
    policy.allocate(_state([old], time=50.0))  # starts its wait
    assert policy.queue(old, 120.0) == 1
    assert policy.queue(old, 200.0) == 0  # waited 150 s > 2 x 50 s


def test_tiresias_rejects_unordered_thresholds() -> None:
    with pytest.raises(ValueError, match=r"thresholds\[1\]"):
        TiresiasPolicy(thresholds=(100.0, 50.0))


def _profiled(job: SimJob, replicas: int) -> None:
    """Give the job a profile covering ``replicas`` GPUs (its hints then say so)."""
    job.goodput.record(1, replicas, 32, 0.1, 0.2, 0.1)


def _fake_speedups(policy: PolluxPolicy, curves: dict[str, object], base: float = 1.0) -> None:
    """Make the policy see ``curves[name](k)`` as job ``name``'s speedup for 0..k GPUs."""

    def speedup(job: SimJob, max_gpus: int, gpus_per_node: int) -> tuple[np.ndarray, float]:
        return curves[job.name](max_gpus), base  # type: ignore[operator]

    policy.speedup = speedup  # type: ignore[method-assign]


def test_pollux_gives_more_gpus_to_the_job_with_larger_marginal_goodput() -> None:
    scales = _job("scales", 0.0, 1, adaptive=True)
    flat = _job("flat", 1.0, 1, adaptive=True)
    _profiled(scales, 8)
    _profiled(flat, 8)
    policy = PolluxPolicy(fairness=1.0)
    _fake_speedups(
        policy,
        {
            "scales": lambda k: np.concatenate([[0.0], np.arange(1, k + 1) * 0.9]),
            "flat": lambda k: np.concatenate([[0.0], 1.0 + 0.05 * np.arange(k)]),
        },
    )
    alloc = policy.allocate(_state([scales, flat]))
    assert len(alloc["scales"]) > len(alloc.get("flat", []))
    assert sum(len(v) for v in alloc.values()) <= 8


def test_pollux_fairness_gives_every_job_a_gpu_first() -> None:
    jobs = [_job(f"j{i}", float(i), 1, adaptive=True) for i in range(5)]
    for j in jobs:
        _profiled(j, 8)
    policy = PolluxPolicy()
    curve = lambda k: np.concatenate([[0.0], np.arange(1, k + 1) * 0.99])  # noqa: E731
    _fake_speedups(policy, {j.name: curve for j in jobs})
    alloc = policy.allocate(_state(jobs))
    assert set(alloc) == {j.name for j in jobs}


def test_pollux_keeps_an_allocation_when_the_gain_does_not_pay_the_restart() -> None:
    job = _job("a", 0.0, 1, adaptive=True)
    job.set_allocation(0.0, [0, 0], 30.0)
    _profiled(job, 4)
    # 3 GPUs would be 1% faster than 2: not worth a 30 s restart over a long job.
    policy = PolluxPolicy(restart_horizon=600.0)
    _fake_speedups(policy, {"a": lambda k: np.array([0.0, 1.0, 1.9, 1.92, 1.93][: k + 1])})
    alloc = policy.allocate(_state([job], nodes=1))
    assert sorted(alloc["a"]) == [0, 0]


def test_pollux_reads_each_job_through_its_hints() -> None:
    # The policy's view of a job is core's hints document, checked by core, and the
    # goodput model it rebuilds from them is the job's own.
    from adaptdl.core.decide.hints import goodput_fn_from_hints, validate_hints

    job = _job("a", 0.0, 1, adaptive=True)
    job.set_allocation(0.0, [0, 0], 30.0)
    hints = job.hints
    assert validate_hints(hints) == hints
    assert hints["max_profiled_replicas"] == 2
    assert goodput_fn_from_hints(hints) == job.goodput.goodput_fn()
    speedup, base = PolluxPolicy().speedup(job, 4, 4)
    assert speedup[1] == 1.0 and base > 0
    assert PolluxPolicy().gpu_cap(job, _state([job], nodes=4)) == 8  # 4 x the 2 profiled


def test_pollux_avoids_sharing_a_node_between_two_distributed_jobs() -> None:
    a, b = _job("a", 0.0, 6), _job("b", 1.0, 6)
    alloc = pack(_state([a, b], nodes=4), {"a": 6, "b": 6})
    spread_a, spread_b = set(alloc["a"]), set(alloc["b"])
    assert len(spread_a) == 2 and len(spread_b) == 2 and not spread_a & spread_b


def test_optimus_gives_the_next_gpu_where_remaining_time_falls_most() -> None:
    long = _job("long", 0.0, 1)
    short = _job("short", 1.0, 1)
    short.progress = APP.target_progress * 0.99  # almost done
    alloc = OptimusPolicy().allocate(_state([long, short], nodes=1))
    assert len(alloc["long"]) > len(alloc["short"]) >= 1


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.lists(st.floats(0, 10), min_size=1, max_size=9), min_size=1, max_size=8),
    st.integers(0, 20),
    st.booleans(),
)
def test_greedy_never_exceeds_capacity(utils: list, capacity: int, min_first: bool) -> None:
    arrays = [np.concatenate([[0.0], np.cumsum(u)]) for u in utils]
    alloc = greedy_allocate(arrays, capacity, min_first=min_first)
    assert sum(alloc) <= capacity
    assert all(0 <= a <= len(u) - 1 for a, u in zip(alloc, arrays, strict=True))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 8), min_size=1, max_size=10), st.integers(1, 4))
def test_pack_never_exceeds_a_node(counts: list[int], nodes: int) -> None:
    jobs = [_job(f"j{i}", float(i), c) for i, c in enumerate(counts)]
    state = _state(jobs, nodes=nodes)
    want, free = {}, state.total_gpus
    for j, c in zip(jobs, counts, strict=True):
        if c <= free:
            want[j.name] = c
            free -= c
    alloc = pack(state, want)
    assert all(v <= 4 for v in _per_node(alloc).values())
    assert {k: len(v) for k, v in alloc.items()} == want


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 10_000), mtbf=st.sampled_from([0.0, 3000.0]))
def test_no_policy_over_allocates_the_cluster(policy: str, seed: int, mtbf: float) -> None:
    jobs = synthetic_workload(APPS, 6, duration=1200.0, seed=seed, max_replicas=8)
    config = ClusterConfig(num_nodes=3, gpus_per_node=4, node_mtbf=mtbf, seed=seed)
    # simulate() raises AllocationError on any over-allocation or down node.
    result = simulate(jobs, APPS, make_policy(policy), config)
    assert result.unfinished == 0
    assert all(g <= 12 for _, g in result.utilization)


def test_an_over_allocating_policy_is_caught() -> None:
    class Greedy:
        name = "greedy"
        adaptive = False

        def allocate(self, state: ClusterState) -> dict[str, list[int]]:
            return {j.name: [0] * 5 for j in state.jobs}

    jobs = synthetic_workload(APPS, 2, seed=1)
    with pytest.raises(AllocationError, match="5 GPUs on node 0"):
        simulate(jobs, APPS, Greedy(), ClusterConfig(num_nodes=2))


def test_unknown_policy_is_named() -> None:
    with pytest.raises(ValueError, match="unknown policy 'slurm'"):
        make_policy("slurm")
