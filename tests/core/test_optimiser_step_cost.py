"""The optimiser step's own cost ``alpha_o`` (#38 item 4): the model, its fit, its
documents, and the decision that accumulates on one replica because of it.

A step costs ``k * T_c + T_o`` with ``T_o`` the overlapped compute and
synchronisation plus ``alpha_o``, at every number of replicas; the fit identifies
``alpha_o`` only from measured accumulation micro-batches, and until one is measured
the decision tries one accumulated step where an optimistic model rates it.
"""

from __future__ import annotations

import math

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptdl.core.decide.batchsize import BatchSizeQuery, GoodputDecision
from adaptdl.core.decide.hints import goodput_fn_from_hints, validate_hints
from adaptdl.core.goodput import (
    GoodputFunction,
    GradParams,
    PerfParams,
    fit_perf_params,
    optim_step_time,
)
from adaptdl.core.stats.profiler import FIT_AFTER, Profiler

log_uniform = st.floats(-4.0, 0.0).map(lambda e: 10.0**e)
perf_params = st.builds(
    PerfParams, *[log_uniform] * 6, st.floats(1.0, 10.0), st.one_of(st.just(0.0), log_uniform)
)


@settings(max_examples=60, deadline=None)
@given(
    p=perf_params,
    nodes=st.integers(1, 4),
    per_node=st.integers(1, 4),
    bsz=st.integers(1, 512),
    accum=st.integers(0, 8),
)
def test_the_optimiser_step_pays_alpha_o_once_per_step(
    p: PerfParams, nodes: int, per_node: int, bsz: int, accum: int
) -> None:
    """``T_o`` is the model without ``alpha_o`` plus ``alpha_o``, exactly, and a step of
    ``k`` accumulation steps takes ``k * T_c + T_o``; 0 is the model without it."""
    replicas = nodes * per_node
    without = attrs.evolve(p, alpha_o=0.0)
    assert optim_step_time(p, nodes, replicas, bsz) == (
        optim_step_time(without, nodes, replicas, bsz) + p.alpha_o
    )
    compute = p.alpha_c + p.beta_c * bsz
    step = accum * compute + optim_step_time(p, nodes, replicas, bsz)
    f = GoodputFunction(p, GradParams(1.0, 1.0), 1)
    throughput = f.throughput(nodes, replicas, bsz, accum)
    assert throughput == pytest.approx(replicas * bsz * (accum + 1) / step, rel=1e-12)
    assert PerfParams(*without.astuple()[:7]) == without  # the seven values of before


def test_alpha_o_makes_accumulation_pay_on_one_replica() -> None:
    """Without it, one replica's throughput is flat in the micro-batches, so a larger
    total only loses efficiency; with it, k steps amortise the optimiser step."""
    base = PerfParams(1e-3, 1e-4, 0.01, 1e-3, 0.005, 1e-3, 1.0)
    grad = GradParams(1.0, 8.0)  # noise scale 256 at 32: large batches keep efficiency
    plain = GoodputFunction(base, grad, 32)
    costly = GoodputFunction(attrs.evolve(base, alpha_o=0.03), grad, 32)
    assert plain.throughput(1, 1, 32, 3) == pytest.approx(plain.throughput(1, 1, 32, 0))
    assert costly.throughput(1, 1, 32, 3) > 2.0 * costly.throughput(1, 1, 32, 0)
    kwargs = {"max_batch_size": 512, "atomic_bsz_range": (32, 32), "accumulation": True}
    assert plain.optimize(1, 1, **kwargs)[2] == 0  # type: ignore[arg-type]
    assert costly.optimize(1, 1, **kwargs)[2] > 0  # type: ignore[arg-type]


# -- the documents --------------------------------------------------------------------


def test_perf_params_round_trip_with_alpha_o_and_load_without() -> None:
    p = PerfParams(0.01, 0.001, 0.02, 0.002, 0.01, 0.001, 1.5, 0.03)
    assert PerfParams.from_dict(p.to_dict()) == p
    assert list(p.to_dict()) == list(PerfParams.FIELDS)
    old = {k: v for k, v in p.to_dict().items() if k != "alpha_o"}
    assert PerfParams.from_dict(old) == attrs.evolve(p, alpha_o=0.0)
    with pytest.raises(ValueError, match="alpha_o must be >= 0"):
        PerfParams(0.01, 0.001, 0.02, 0.002, 0.01, 0.001, 1.5, -1.0)
    with pytest.raises(ValueError, match="unexpected \\['alpha_x'\\]"):
        PerfParams.from_dict({**old, "alpha_x": 1.0})


def test_states_and_hints_written_before_alpha_o_load_with_none() -> None:
    prof = Profiler()
    for _ in range(FIT_AFTER):
        prof.record(1, 1, 32, accum_step=False, step_time=0.036)
    assert prof.perf_params() is not None
    state = prof.to_json()
    assert Profiler.from_json(state) == prof
    del state["last_fit"]["alpha_o"]  # as written before it existed
    restored = Profiler.from_json(state)
    assert restored.last_fit == prof.last_fit  # unidentified: 0 either way
    document = {
        "schema": "adaptdl.hints/1",
        "perf_params": state["last_fit"],
        "grad_params": {"sqr": 1.0, "var": 2.0},
        "init_batch_size": 32,
        "max_batch_size": 512,
        "local_bsz_bounds": [32, 32],
        "gradient_accumulation": True,
        "max_profiled_replicas": 1,
        "max_profiled_nodes": 1,
    }
    assert validate_hints(document)["perf_params"]["alpha_o"] == 0.0
    fn = goodput_fn_from_hints(document)
    assert fn is not None and fn.perf_params.alpha_o == 0.0


# -- the fit --------------------------------------------------------------------------


TRUE = PerfParams(0.002, 6e-5, 0.02, 0.002, 0.008, 0.001, 1.5, 0.03)


def observations(
    true: PerfParams, replicas: list[int], sizes: list[int], measured: bool
) -> tuple[np.ndarray, ...]:
    """Exact observations of ``true`` at every (replicas, size) on one node; the
    accumulation times measured, or estimated as a profiler does (step less sync);
    last, whether measured and the optimiser step less its sync."""
    r, b = (np.array(v).ravel() for v in np.meshgrid(replicas, sizes))
    nodes = np.ones_like(r)
    compute = true.alpha_c + true.beta_c * b
    optim = optim_step_time(true, nodes, r, b)
    without = optim_step_time(attrs.evolve(true, alpha_o=0.0), nodes, r, b)
    sync = without - compute  # what overlapping leaves of synchronisation
    accum = compute if measured else optim - sync
    return nodes, r, b, accum, optim, np.full(r.shape, measured), optim - sync


@pytest.mark.parametrize(
    ("replicas", "sizes"), [([1], [32]), ([1], [16, 32, 64]), ([1, 2, 4], [16, 64])]
)
def test_the_fit_recovers_alpha_o_from_measured_accumulation(
    replicas: list[int], sizes: list[int]
) -> None:
    *obs, measured, less_sync = observations(TRUE, replicas, sizes, measured=True)
    fitted = fit_perf_params(*obs, measured, less_sync)
    assert fitted.alpha_o == pytest.approx(TRUE.alpha_o, rel=0.02)
    nodes, r, b, _, optim = obs
    assert optim_step_time(fitted, nodes, r, b) == pytest.approx(optim, rel=1e-3)


def test_sync_times_tell_alpha_o_from_the_network_on_replicas_of_one_count() -> None:
    """Two replicas, one size: the optimiser step is ``T_c + alpha_r + alpha_o`` either
    way; its time less its sync wait is ``T_c + alpha_o``, which tells them apart.
    Without it the fit keeps the model without alpha_o, which explains the steps."""
    true = attrs.evolve(TRUE, gamma=1.0)
    *obs, measured, less_sync = observations(true, [2], [32], measured=True)
    fitted = fit_perf_params(*obs, measured, less_sync)
    assert fitted.alpha_o == pytest.approx(true.alpha_o, rel=0.02)
    assert fitted.alpha_r == pytest.approx(true.alpha_r, rel=0.05)
    blind = fit_perf_params(*obs, measured)
    assert blind.alpha_o == 0.0 and blind.alpha_r == pytest.approx(0.038, rel=0.02)


def test_estimated_rows_do_not_bias_alpha_o() -> None:
    """Configurations that never accumulated hold the optimiser step's cost in their
    estimated compute time: compared with ``T_c + alpha_o``, they agree with it."""
    *measured_obs, measured, sync1 = observations(TRUE, [1], [32], measured=True)
    *estimated_obs, estimated, sync2 = observations(TRUE, [1, 2], [16, 64], measured=False)
    columns = [np.concatenate(pair) for pair in zip(measured_obs, estimated_obs, strict=True)]
    fitted = fit_perf_params(
        *columns, np.concatenate([measured, estimated]), np.concatenate([sync1, sync2])
    )
    assert fitted.alpha_o == pytest.approx(TRUE.alpha_o, rel=0.02)
    assert fitted.alpha_c + fitted.beta_c * 64 == pytest.approx(
        TRUE.alpha_c + TRUE.beta_c * 64, rel=0.02
    )


@settings(max_examples=20, deadline=None)
@given(
    theta=st.lists(st.floats(-9.0, 0.0), min_size=6, max_size=6),
    gamma=st.floats(1.0, 5.0),
    log_alpha_o=st.one_of(st.none(), st.floats(-9.0, 0.0)),
    seed=st.integers(0, 2**16),
)
def test_the_fits_gradient_is_the_objectives(
    theta: list[float], gamma: float, log_alpha_o: float | None, seed: int
) -> None:
    """The analytic gradient the descent uses, with and without alpha_o, against
    central differences, on observations of every kind (measured or estimated
    accumulation, 1, 2, 4 replicas, one or two nodes, with sync times)."""
    from adaptdl.core.goodput.fit import _Observations

    rng = np.random.default_rng(seed)
    n_single, n_intra, n_inter = 3, 3, 2
    n = n_single + n_intra + n_inter
    estimated = rng.integers(0, 2, n).astype(float)
    apart = np.flatnonzero(estimated[n_single:] == 0.0) + n_single
    obs = _Observations(
        bsz=rng.integers(4, 256, n).astype(float),
        log_accum=rng.normal(-5.0, 1.0, n),
        log_optim=rng.normal(-4.0, 1.0, n),
        n_single=n_single,
        n_intra=n_intra,
        extra=np.array([0.0, 2.0, 0.0, 6.0, 1.0]),
        estimated=estimated,
        apart=apart,
        log_apart=rng.normal(-4.5, 1.0, apart.shape[0]),
    )
    point = np.array([*theta, gamma, *([] if log_alpha_o is None else [log_alpha_o])])
    _, grad = obs.objective(point)
    for i in range(point.shape[0]):
        step = np.zeros_like(point)
        step[i] = 1e-6
        numeric = (obs.objective(point + step)[0] - obs.objective(point - step)[0]) / 2e-6
        assert grad[i] == pytest.approx(numeric, rel=1e-4, abs=1e-6)


def test_without_measured_accumulation_alpha_o_is_none_and_the_fit_as_before() -> None:
    *obs, measured, less_sync = observations(TRUE, [1, 2], [16, 64], measured=False)
    assert not measured.any()
    fitted = fit_perf_params(*obs)
    assert fitted.alpha_o == 0.0
    assert fit_perf_params(*obs, measured, less_sync) == fitted
    # Estimated compute times hold all of the optimiser step: it is taken as compute.
    assert fitted.alpha_c + fitted.beta_c * 16 == pytest.approx(
        TRUE.alpha_c + TRUE.beta_c * 16 + TRUE.alpha_o, rel=0.02
    )
    with pytest.raises(ValueError, match="accum_measured must be 4 bools"):
        fit_perf_params(*obs, [True])


def test_the_profiler_counts_accumulation_as_measured_from_fit_after_records() -> None:
    prof = Profiler()
    for _ in range(FIT_AFTER):
        prof.record(1, 1, 32, accum_step=False, step_time=0.036)
    assert prof.perf_params() is not None and prof.last_fit is not None
    assert prof.last_fit.alpha_o == 0.0
    for _ in range(FIT_AFTER):
        assert not prof.observations().accum_measured.any()
        prof.record(1, 1, 32, accum_step=True, step_time=0.004)
        prof.record(1, 1, 32, accum_step=False, step_time=0.036)
    assert prof.observations().accum_measured.tolist() == [True]
    fit = prof.perf_params()  # the FIT_AFTER-th accumulation step: a full fit
    assert fit is not None and fit.alpha_o == pytest.approx(0.032, rel=1e-3)


# -- the decision ---------------------------------------------------------------------

#: One replica, 4 ms of compute per 32 samples and a 32 ms optimiser step.
COSTLY = PerfParams(1e-8, 0.004 / 32, 0.002, 1e-8, 0.001, 1e-8, 1.0, 0.032)
#: The same compute and no optimiser-step cost: accumulation gains nothing.
CHEAP = attrs.evolve(COSTLY, alpha_o=0.0)
NOISY = GradParams(1.0, 16.0)  # noise scale 512 at 32: a larger batch loses little


def query(current: tuple[int, int] | None, replicas: int = 1) -> BatchSizeQuery:
    return BatchSizeQuery(
        num_nodes=1,
        num_replicas=replicas,
        batch_size=32,
        max_batch_size=512,
        local_bsz_bounds=(32, 32),
        gradient_accumulation=True,
        current=current,
    )


def run_steps(prof: Profiler, true: PerfParams, replicas: int, accum: int, steps: int) -> None:
    """Record ``steps`` optimiser steps at 32 per replica with ``accum`` accumulation
    micro-batches each, timed by ``true``."""
    compute = true.alpha_c + true.beta_c * 32
    optim = optim_step_time(true, 1, replicas, 32)
    sync = max(optim_step_time(attrs.evolve(true, alpha_o=0.0), 1, replicas, 32) - compute, 0.0)
    for _ in range(steps):
        for _ in range(accum):
            prof.record(1, replicas, 32, accum_step=True, step_time=compute)
        prof.record(1, replicas, 32, accum_step=False, step_time=optim, sync_time=sync)


def decision(prof: Profiler, grad: GradParams = NOISY) -> GoodputDecision:
    return GoodputDecision(lambda: prof.goodput_fn(grad, 32), explore_fn=prof.optimistic_fit)


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_one_size_job_with_a_costly_optimiser_step_grows_by_accumulation(
    replicas: int,
) -> None:
    """The issue's job: local bounds (32, 32). Before any accumulation is measured it
    tries one accumulated step, holds it until its steps are in the fit, then the
    fit (alpha_o identified) grows it further; its total never falls back."""
    prof = Profiler()
    run_steps(prof, COSTLY, replicas, 0, 20)
    decide = decision(prof)
    assert GoodputDecision(lambda: prof.goodput_fn(NOISY, 32))(query((32, 0), replicas)) == (
        32,
        0,
    )  # the fit alone: flat throughput, never accumulates on one replica
    current = decide(query((32, 0), replicas))
    assert current == (32, 1)  # the try
    run_steps(prof, COSTLY, replicas, 1, FIT_AFTER - 1)
    assert decide(query(current, replicas)) == current  # held until measured
    run_steps(prof, COSTLY, replicas, 1, 1)
    fit = prof.perf_params()
    assert fit is not None
    # One replica: the optimiser step's excess over the compute; two (one size): its
    # time less its sync wait, over the compute.
    assert fit.alpha_o == pytest.approx(0.032, rel=0.05)
    assert optim_step_time(fit, 1, replicas, 32) == pytest.approx(
        optim_step_time(COSTLY, 1, replicas, 32), rel=1e-3
    )
    assert prof.optimistic_fit(True) is not None  # one size: the size gap stays open
    current = decide(query(current, replicas))
    assert current[0] == 32 and current[1] >= 3


def test_a_job_whose_optimiser_step_costs_nothing_tries_once_and_stays() -> None:
    prof = Profiler()
    run_steps(prof, CHEAP, 1, 0, 20)
    decide = decision(prof)
    current = decide(query((32, 0)))
    assert current == (32, 1)  # the optimistic model: worth a try
    run_steps(prof, CHEAP, 1, 1, FIT_AFTER)
    fit = prof.perf_params()
    assert fit is not None and fit.alpha_o < 1e-4
    # The fit decides: no gain from accumulating, so back to one micro-batch (the
    # efficiency it loses at 64 passes the threshold), and never another try.
    answers = []
    for _ in range(4):
        current = decide(query(current))
        answers.append(current)
        run_steps(prof, CHEAP, 1, current[1], 4)
    assert answers == [(32, 0)] * 4


def test_no_try_without_accumulation_nor_where_a_larger_batch_gains_nothing() -> None:
    prof = Profiler()
    run_steps(prof, COSTLY, 1, 0, 20)
    no_accum = attrs.evolve(query((32, 0)), gradient_accumulation=False)
    assert decision(prof)(no_accum) == (32, 0)
    # No gradient noise: twice the batch makes no more progress per step.
    assert decision(prof, GradParams(1.0, 0.0))(query((32, 0))) == (32, 0)


@settings(max_examples=30, deadline=None)
@given(
    alpha_o=st.sampled_from([0.0, 0.004, 0.032]),
    replicas=st.sampled_from([1, 2, 3]),
    noise=st.floats(1.0, 1000.0),
    trial=st.integers(0, FIT_AFTER + 2),
)
def test_accumulation_trials_keep_every_contract(
    alpha_o: float, replicas: int, noise: float, trial: int
) -> None:
    """Whatever the job and however far its try went: the answer is within the local
    bounds, at least the initial total, at most max_batch_size, and a try (an answer
    the fit alone would not give) is one accumulation step."""
    true = attrs.evolve(COSTLY, alpha_o=alpha_o)
    prof = Profiler()
    run_steps(prof, true, replicas, 0, 20)
    run_steps(prof, true, replicas, 1, trial)
    grad = GradParams(1.0, noise / 32)
    for current in [(32, 0), (32, 1), (32, 3)]:
        q = query(current, replicas)
        local, accum = decision(prof, grad)(q)
        total = local * replicas * (accum + 1)
        assert local == 32 and 32 * replicas <= total <= 512
        plain = GoodputDecision(lambda: prof.goodput_fn(grad, 32))(q)
        if (local, accum) != plain:
            assert accum == 1 or (local, accum) == current
            assert math.isfinite(total)
