"""The simulator's jobs decide their batch size exactly as the real loader does.

One job state (profile, gradient statistics, replicas, last decision) goes through
the torch-side path (core's ``Job`` and ``LoaderHelper.sync_local_bsz``, which the
torch loader calls) and through the simulated job's caller; the decisions must be
the same.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from adaptdl.core.decide.batchsize import BatchSizeQuery, batch_size_query, even_split
from adaptdl.core.goodput import PerfParams
from adaptdl.core.job import Job
from adaptdl.core.loop.loader import LoaderHelper
from adaptdl.core.stats.gns import GradientNoiseScale
from adaptdl.core.topology import Topology
from adaptdl.sim.apps import ApplicationModel, ParametricApplication, builtin_applications
from adaptdl.sim.jobs import SimJob
from adaptdl.sim.workload import JobSpec

APPS = builtin_applications()


class _RankZero:
    """Rank 0 of ``num_replicas``: the one replica that decides (its broadcast is its own)."""

    rank = 0

    def __init__(self, num_replicas: int) -> None:
        self.num_replicas = num_replicas

    def broadcast(self, value: Any, root: int = 0) -> Any:
        return value


def _sim_job(app: ApplicationModel, allocations: list[list[int]]) -> SimJob:
    """An adaptive simulated job that ran on each allocation in turn (and profiled it)."""
    spec = JobSpec("job", 0.0, app.name, 1, app.init_batch_size)
    job = SimJob(spec, app, adaptive=True)
    for i, nodes in enumerate(allocations):
        job.set_allocation(100.0 * i, nodes, 30.0)
    return job


def _torch_decision(
    sim: SimJob, num_nodes: int, num_replicas: int, current: tuple[int, int] | None
) -> tuple[int, int]:
    """What core's loader decides from the simulated job's state on this topology."""
    app = sim.app
    m0 = app.init_batch_size
    topo = Topology(rank=0, num_replicas=num_replicas, num_nodes=num_nodes)
    job = Job(topo, collective=_RankZero(num_replicas))  # type: ignore[arg-type]
    loader = LoaderHelper(job, m0)
    grad = sim.goodput.grad
    # An estimator that has seen as many samples as the simulated job trained on (the
    # decision's warm-up reads them off the normaliser), with the same statistics.
    smoothing = 0.999
    weight = max(-math.expm1(sim.goodput.samples / m0 * math.log(smoothing)), 1e-12)
    # The simulator's statistics are exact: every step's estimate the same, no spread,
    # so the decision's confidence cap (which the simulator does not apply) is no cap.
    gns = GradientNoiseScale(
        init_batch_size=m0,
        smoothing=smoothing,
        sqr_biased=(grad.sqr * weight,),
        var_biased=(grad.var * m0 * weight,),
        weight=weight,
        sqr_diff_biased=0.0,
        var_diff_biased=0.0,
        moment_weight=weight,
        moment_weight_sq=weight**2 / 1e6,
    )
    # Restored as a checkpoint would restore them: the metrics' own state, as data.
    job.metrics.load_json(
        {"gns": gns.to_json(), "progress": 0.0, "profiler": sim.goodput.profiler.to_json()}
    )
    # The simulated job takes the statistics exactly as core's estimator reports them.
    measured = job.metrics.grad_params()
    assert measured is not None
    sim.goodput.set_grad(measured)
    lo, hi = app.local_bsz_bounds
    if hi < m0:
        # The seed API refuses a largest local batch below the target batch size (the
        # transformer's 16 < 32): ask the job's decision, which the loader calls,
        # with the query the loader builds.
        loader.train()
        query = batch_size_query(
            num_nodes,
            num_replicas,
            m0,
            max_batch_size=app.max_batch_size,
            local_bsz_bounds=app.local_bsz_bounds,
            gradient_accumulation=True,
            local_bsz=current[0] if current else 0,
            accum_steps=current[1] if current else 0,
        )
        return job.batch_size_decision(query)
    loader.autoscale_batch_size(app.max_batch_size, (lo, hi), gradient_accumulation=True)
    if current is not None:
        # The loader's last decision, as it would be after an earlier pass.
        default = job.batch_size_decision
        job.batch_size_decision = lambda query: current
        loader.sync_local_bsz()
        job.batch_size_decision = default
    loader.sync_local_bsz()
    return loader.current_local_bsz, loader.accumulation_steps


placements = st.lists(st.integers(1, 4), min_size=1, max_size=4)


@settings(max_examples=40)
@given(
    name=st.sampled_from(sorted(APPS)),
    history=st.lists(placements, min_size=0, max_size=3),
    per_node=placements,
    keep=st.sampled_from(["none", "last", "smallest"]),
)
def test_sim_and_loader_decide_the_same(
    name: str, history: list[list[int]], per_node: list[int], keep: str
) -> None:
    app = APPS[name]
    allocations = [[n for n, c in enumerate(p) for _ in range(c)] for p in history]
    sim = _sim_job(app, allocations)
    nodes, replicas = len(per_node), sum(per_node)
    lo = app.local_bsz_bounds[0]
    current = {
        "none": None,
        "last": (sim.atomic_bsz, sim.accum_steps) if sim.atomic_bsz else None,
        "smallest": (lo, 0),
    }[keep]
    expected = _torch_decision(sim, nodes, replicas, current)
    assert sim.goodput.decide(nodes, replicas, current) == expected


def test_transformer_on_one_gpu_gets_the_whole_batch_by_accumulating() -> None:
    # Before any profile both fall back to core's even split: 32 samples as two
    # micro-batches of 16 (the largest local batch), not one of 16 (the simulator's
    # own fallback before it used core's decision).
    sim = SimJob(JobSpec("t", 0.0, "transformer", 1, 32), APPS["transformer"], adaptive=True)
    assert sim.goodput.decide(1, 1) == (16, 1)
    assert _torch_decision(sim, 1, 1, None) == (16, 1)


def test_a_started_job_decides_on_its_profile_as_the_loader_does() -> None:
    sim = _sim_job(APPS["transformer"], [[0]])
    assert sim.goodput.goodput_fn() is not None
    assert sim.atomic_bsz * (sim.accum_steps + 1) >= 32
    current = (sim.atomic_bsz, sim.accum_steps)
    for nodes, replicas in [(1, 1), (1, 2), (1, 4), (2, 8), (4, 16)]:
        expected = _torch_decision(sim, nodes, replicas, current)
        assert sim.goodput.decide(nodes, replicas, current) == expected


@settings(max_examples=60)
@given(
    name=st.sampled_from(sorted(APPS)),
    batch=st.integers(1, 4096),
    per_node=placements,
)
def test_fixed_config_is_cores_even_split_within_the_memory_bound(
    name: str, batch: int, per_node: list[int]
) -> None:
    app = APPS[name]
    job = SimJob(JobSpec("f", 0.0, name, 1, batch), app, adaptive=False)
    placement = tuple(sorted(per_node, reverse=True))
    atomic, accum = job.fixed_config(placement)
    hi = app.local_bsz_bounds[1]
    query = BatchSizeQuery(len(placement), sum(placement), batch, None, (None, hi), True, None)
    assert (atomic, accum) == even_split(query)
    assert 1 <= atomic <= hi
    assert atomic * (accum + 1) * sum(placement) >= batch


def test_hints_and_queries_cap_the_total_at_one_pass_alike() -> None:
    """A scheduler must not plan for a total batch the job's loader would never take."""
    from adaptdl.sim.jobs import JobGoodput

    job = JobGoodput(32, 4096, (16, 512), accumulation=True, dataset_size=1000)
    assert job.query(1, 2, None).max_batch_size == 1000
    assert job.hints()["max_batch_size"] == 1000
    unbounded = JobGoodput(32, 4096, (16, 512), accumulation=True)
    assert unbounded.hints()["max_batch_size"] == unbounded.query(1, 2, None).max_batch_size
    assert unbounded.hints()["max_batch_size"] == 4096


def test_a_decision_capped_by_the_warm_up_is_asked_again_once_the_job_trained() -> None:
    # Core's rule: at most 2x growth per decision while the noise estimate is young.
    app = APPS["recommender"]
    sim = _sim_job(app, [[0, 0, 0, 0]])
    assert not sim.goodput.mature
    # Two decisions at the start (before and after the first profile), each capped.
    assert sim.batch_size <= 4 * app.init_batch_size
    assert not sim.maybe_reconfigure(0.0)  # nothing trained since
    sim.advance(60.0)
    assert sim.goodput.samples > 0 and sim.goodput.mature
    assert sim.maybe_reconfigure(60.0)
    assert sim.batch_size > 4 * app.init_batch_size
    assert not sim.maybe_reconfigure(60.0)  # mature: only a new model asks again


# One event of a simulated job: a new allocation (GPUs per node; empty: suspended), a
# failure that loses it, or an epoch boundary; then seconds of training.
sim_events = st.tuples(
    st.sampled_from(["allocate", "fail", "epoch"]),
    st.lists(st.integers(1, 4), min_size=0, max_size=4),
    st.floats(1.0, 600.0),
)


@settings(max_examples=40, deadline=None)
@example(  # the tree before fell to 8 here: 24 on 1 GPU, 8 x 3 on 3, then 8 on 1 again
    name="compute-bound",
    events=[("allocate", [1], 600.0), ("allocate", [3], 600.0), ("allocate", [1], 600.0)],
)
@given(
    name=st.sampled_from([*sorted(APPS), "compute-bound"]),
    events=st.lists(sim_events, min_size=1, max_size=10),
)
def test_no_simulated_resize_restart_or_decision_trains_below_the_initial_batch(
    name: str, events: list[tuple[str, list[int], float]]
) -> None:
    """Issue 38, for the simulator's jobs (core's decision): whatever allocations,
    failures and epochs come, every configuration's total holds at least the initial
    batch size rounded up to the GPUs (or the lower local bound on each). The
    compute-bound application's throughput is flat in the batch size: the model rates a
    small total as well as the initial one."""
    app = APPS.get(name) or ParametricApplication(
        "compute-bound",
        24,
        192,
        (8, 24),
        20_000,
        3,
        perf_params=PerfParams(1e-4, 0.01, 1e-3, 1e-4, 1e-3, 1e-4, 1.0),
        noise_start=1.0,
        noise_end=2.0,
    )
    job = SimJob(JobSpec("j", 0.0, app.name, 1, app.init_batch_size), app, adaptive=True)
    time = 0.0
    for kind, per_node, seconds in events:
        if job.done:
            break
        if kind == "allocate":
            job.set_allocation(time, [n for n, c in enumerate(per_node) for _ in range(c)], 30.0)
        elif kind == "fail" and job.nodes:
            job.lose_allocation(time)
        elif kind == "epoch" and job.nodes:
            boundary = job.next_boundary()
            if boundary is not None:
                time = max(time, boundary[0])
                job.cross_boundary(time)
        time += seconds
        job.advance(time)
        job.maybe_reconfigure(time)
    lo = app.local_bsz_bounds[0]
    m0 = app.init_batch_size
    for _, gpus, total, _ in job.history:
        if gpus:
            assert total >= max(-(-m0 // gpus), lo) * gpus, job.history


def test_a_job_whose_bounds_cannot_reach_its_batch_says_so_at_its_start() -> None:
    """The transformer's local batches hold at most 16 of its 32: without accumulation
    one GPU cannot train the batch asked for, and the job's first decision says why."""
    app = APPS["transformer"]
    job = SimJob(JobSpec("t", 0.0, app.name, 1, 32), app, adaptive=True, accumulation=False)
    with pytest.raises(
        ValueError, match=r"local_bsz_bounds=\(4, 16\).*batch_size=32 on 1 replica"
    ):
        job.set_allocation(0.0, [0], 30.0)
    # Two GPUs reach it (16 x 2).
    job = SimJob(JobSpec("t", 0.0, app.name, 1, 32), app, adaptive=True, accumulation=False)
    job.set_allocation(0.0, [0, 0], 30.0)
    assert job.batch_size >= 32
