"""Tests of the Pollux goodput model: throughput, efficiency, optimiser and fit."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptdl.core.goodput import (
    PARAM_FLOOR,
    GoodputFunction,
    GradParams,
    PerfParams,
    compute_time,
    fit_perf_params,
    optim_step_time,
)
from adaptdl.core.stats.scaling import adascale_gain

PERF = PerfParams(0.1, 0.01, 0.2, 0.01, 0.1, 0.005, 2.0)
GRAD = GradParams(sqr=1.0, var=5.0)

# -- strategies ---------------------------------------------------------------

log_uniform = st.floats(-4.0, 0.0).map(lambda e: 10.0**e)
perf_params = st.builds(
    PerfParams,
    log_uniform,
    log_uniform,
    log_uniform,
    log_uniform,
    log_uniform,
    log_uniform,
    st.floats(1.0, 10.0),
    # The optimiser step's own cost: none (the model without it) or some.
    st.one_of(st.just(0.0), log_uniform),
)
grad_params = st.builds(
    GradParams,
    st.one_of(st.just(0.0), st.floats(-3.0, 1.0).map(lambda e: 10.0**e)),
    st.one_of(st.just(0.0), st.floats(-3.0, 2.0).map(lambda e: 10.0**e)),
)


@st.composite
def topologies(draw: Any, max_replicas: int = 16) -> tuple[int, int]:
    replicas = draw(st.integers(1, max_replicas))
    nodes = draw(st.integers(1, replicas))
    return nodes, replicas


@st.composite
def search_spaces(draw: Any) -> dict[str, Any]:
    """A goodput function, a topology and optimiser bounds small enough to brute-force."""
    init = draw(st.integers(1, 256))
    nodes, replicas = draw(topologies())
    max_batch_size = draw(st.one_of(st.none(), st.integers(init, 20 * init + 100)))
    lo = draw(st.one_of(st.none(), st.integers(1, 40)))
    hi = draw(st.one_of(st.none(), st.integers(lo or 1, (lo or 1) + 300)))
    atomic_range = draw(st.one_of(st.none(), st.just((lo, hi))))
    accumulation = draw(st.booleans())
    m_max = init if max_batch_size is None else max_batch_size
    bmin = (atomic_range[0] or 1) if atomic_range else 1
    if accumulation and m_max // (replicas * bmin) > 400:
        accumulation = False  # keep the brute force small
    return {
        "function": GoodputFunction(draw(perf_params), draw(grad_params), init),
        "nodes": nodes,
        "replicas": replicas,
        "max_batch_size": max_batch_size,
        "atomic_bsz_range": atomic_range,
        "accumulation": accumulation,
    }


def brute_force(space: dict[str, Any]) -> tuple[float, int, int, bool]:
    """Best (goodput, atomic_bsz, accum_steps) over every admissible integer pair.

    Also says whether any admissible configuration reaches the initial batch size.
    """
    f: GoodputFunction = space["function"]
    replicas = space["replicas"]
    m0 = f.init_batch_size
    m_max = space["max_batch_size"] or m0
    lo, hi = space["atomic_bsz_range"] or (None, None)
    bmin, bmax = lo or 1, hi or m_max
    u_max = m_max // (replicas * bmin) if space["accumulation"] else 1
    best: dict[bool, tuple[float, int, int]] = {}
    for u in range(1, u_max + 1):
        sizes = np.arange(bmin, min(bmax, m_max // (replicas * u)) + 1)
        if len(sizes) == 0:
            continue
        values = f.evaluate(space["nodes"], replicas, sizes, u - 1)
        totals = replicas * sizes * u
        for reaches in (True, False):
            mask = (totals >= m0) == reaches
            if mask.any():
                i = int(np.argmax(np.where(mask, values, -1.0)))
                if values[i] > best.get(reaches, (-1.0, 0, 0))[0]:
                    best[reaches] = (float(values[i]), int(sizes[i]), u - 1)
    if True in best:
        return (*best[True], True)
    if False in best:
        return (*best[False], False)
    return 0.0, 0, 0, False


def optimize(space: dict[str, Any]) -> tuple[float, int, int]:
    f: GoodputFunction = space["function"]
    result: tuple[float, int, int] = f.optimize(
        space["nodes"],
        space["replicas"],
        max_batch_size=space["max_batch_size"],
        atomic_bsz_range=space["atomic_bsz_range"],
        accumulation=space["accumulation"],
    )
    return result


# -- parameters ----------------------------------------------------------------


def test_perf_params_by_keyword_and_position_agree() -> None:
    by_keyword = PerfParams(
        alpha_c=0.1, beta_c=0.01, alpha_n=0.2, beta_n=0.01, alpha_r=0.1, beta_r=0.005, gamma=2
    )
    assert by_keyword == PERF
    assert by_keyword.gamma == 2.0 and isinstance(by_keyword.gamma, float)
    assert PERF.astuple() == (0.1, 0.01, 0.2, 0.01, 0.1, 0.005, 2.0, 0.0)


def test_params_round_trip_through_json() -> None:
    assert PerfParams.from_dict(json.loads(json.dumps(PERF.to_dict()))) == PERF
    assert GradParams.from_dict(json.loads(json.dumps(GRAD.to_dict()))) == GRAD
    f = GoodputFunction(PERF.to_dict(), list(GRAD.to_dict().values()), 64)
    assert f.perf_params == PERF and f.grad_params == GRAD


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"alpha_c": -1.0}, "alpha_c must be >= 0.0"),
        ({"beta_n": math.nan}, "beta_n must be finite"),
        ({"alpha_r": math.inf}, "alpha_r must be finite"),
        ({"beta_c": 0.0}, "beta_c must be > 0"),
        ({"gamma": 0.5}, r"gamma must be in \[1.0, 10.0\]"),
        ({"gamma": 11.0}, r"gamma must be in \[1.0, 10.0\]"),
        ({"alpha_n": "0.1"}, "alpha_n must be a real number"),
    ],
)
def test_perf_params_reject_bad_values(kwargs: dict[str, Any], match: str) -> None:
    values = PERF.to_dict()
    values.update(kwargs)
    with pytest.raises(ValueError, match=match):
        PerfParams(**values)


def test_grad_params_reject_bad_values() -> None:
    with pytest.raises(ValueError, match=r"sqr must be >= 0\.0"):
        GradParams(-1.0, 1.0)
    with pytest.raises(ValueError, match="var must be finite"):
        GradParams(1.0, math.nan)


def test_from_dict_names_missing_and_unexpected_keys() -> None:
    data = PERF.to_dict()
    del data["gamma"]
    data["delta"] = 1.0
    with pytest.raises(ValueError, match=r"missing \['gamma'\], unexpected \['delta'\]"):
        PerfParams.from_dict(data)
    with pytest.raises(ValueError, match=r"missing \['var'\]"):
        GradParams.from_dict({"sqr": 1.0})
    with pytest.raises(TypeError, match="needs a mapping"):
        GradParams.from_dict([1.0, 2.0])  # type: ignore[arg-type]


def test_goodput_function_takes_sequences_and_mappings() -> None:
    f = GoodputFunction(list(PERF.astuple()), {"sqr": 1.0, "var": 5.0}, 64)
    assert f.perf_params == PERF and f.grad_params == GRAD
    with pytest.raises(ValueError, match=r"grad_params must have 2 values \(sqr, var\)"):
        GoodputFunction(PERF, (1.0, 2.0, 3.0), 64)
    with pytest.raises(TypeError, match="perf_params must be a PerfParams"):
        GoodputFunction("fast", GRAD, 64)  # type: ignore[arg-type]


def test_goodput_function_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="init_batch_size must be >= 1"):
        GoodputFunction(PERF, GRAD, 0)
    with pytest.raises(ValueError, match="perf_params must have 7 or 8 values"):
        GoodputFunction((0.1, 0.2), GRAD, 32)
    with pytest.raises(TypeError, match="grad_params must be a GradParams"):
        GoodputFunction(PERF, 3.0, 32)  # type: ignore[arg-type]


# -- throughput ------------------------------------------------------------------


def test_throughput_matches_hand_calculation() -> None:
    f = GoodputFunction(PERF, GRAD, 128)
    # One replica: no network, T_o = T_c = 0.1 + 0.01 * 64 = 0.74 s.
    assert f.throughput(1, 1, 64, 0) == pytest.approx(64 / 0.74)
    # Two accumulation steps: 3 * 0.74 s for 192 samples.
    assert f.throughput(1, 1, 64, 2) == pytest.approx(192 / (3 * 0.74))
    # Four replicas in one node: T_n = 0.1 + 0.005 * 2 = 0.11, gamma = 2.
    optim = math.hypot(0.74, 0.11)
    assert f.throughput(1, 4, 64, 0) == pytest.approx(256 / optim)
    # Eight replicas on two nodes, one accumulation step: T_n = 0.2 + 0.01 * 6 = 0.26.
    optim = math.hypot(0.74, 0.26)
    assert f.throughput(2, 8, 64, 1) == pytest.approx(8 * 64 * 2 / (0.74 + optim))
    # Two replicas on two nodes: only the constant term, T_n = 0.2.
    assert f.throughput(2, 2, 64, 0) == pytest.approx(128 / math.hypot(0.74, 0.2))


def test_gamma_one_adds_and_large_gamma_overlaps() -> None:
    additive = GoodputFunction(PerfParams(0.1, 0.01, 0.3, 0.0, 0.3, 0.0, 1.0), GRAD, 1)
    assert additive.throughput(1, 2, 10, 0) == pytest.approx(20 / (0.2 + 0.3))
    overlapped = GoodputFunction(PerfParams(0.1, 0.01, 0.3, 0.0, 0.3, 0.0, 10.0), GRAD, 1)
    assert overlapped.throughput(1, 2, 10, 0) == pytest.approx(20 / (0.2**10 + 0.3**10) ** 0.1)
    # Extreme ratios of compute to network time neither overflow nor lose the larger.
    huge = GoodputFunction(PerfParams(1e-8, 1e-8, 1e6, 1e6, 1e6, 1e6, 10.0), GRAD, 1)
    assert huge.throughput(2, 64, 1, 0) == pytest.approx(64 / (1e6 + 62e6))


def test_goodput_is_throughput_times_efficiency() -> None:
    f = GoodputFunction(PERF, GRAD, 128)
    total = 4 * 64 * 3
    expected = f.throughput(1, 4, 64, 2) * f.efficiency(total)
    assert f.evaluate(1, 4, 64, 2) == pytest.approx(expected)
    assert f(1, 4, 64, 2) == f.evaluate(1, 4, 64, 2)


def test_scalars_in_give_python_scalars_out() -> None:
    f = GoodputFunction(PERF, GRAD, 128)
    for value in (f.evaluate(1, 4, 64, 0), f.throughput(1, 4, 64, 0), f.efficiency(512)):
        assert type(value) is float
    g, b, k = f.optimize(1, 4, max_batch_size=1024)
    assert (type(g), type(b), type(k)) == (float, int, int)


def test_zero_dimensional_arguments_give_python_scalars() -> None:
    # numpy scalars and 0-d arrays take the one-configuration path, like plain numbers.
    f = GoodputFunction(PERF, GRAD, 128)
    for nodes, replicas in ((np.int64(1), np.float64(4)), (np.array(1), np.array(4.0))):
        value = f.evaluate(nodes, replicas, np.array(64), np.int32(0))
        assert type(value) is float and value == f.evaluate(1, 4, 64, 0)
        g, b, k = f.optimize(nodes, replicas, max_batch_size=1024, accumulation=True)
        assert (type(g), type(b), type(k)) == (float, int, int)
        assert (g, b, k) == f.optimize(1, 4, max_batch_size=1024, accumulation=True)


def test_arrays_broadcast() -> None:
    f = GoodputFunction(PERF, GRAD, 128)
    nodes = np.array([[1], [2]])
    bsz = np.array([16, 32, 64])
    values = f.evaluate(nodes, 4, bsz, 0)
    assert values.shape == (2, 3)
    assert values[1, 2] == pytest.approx(f.evaluate(2, 4, 64, 0))
    assert f.efficiency([128, 256]).shape == (2,)
    g, b, k = f.optimize(nodes, np.array([[2, 4, 8]]), max_batch_size=2048, accumulation=True)
    assert g.shape == b.shape == k.shape == (2, 3)
    assert b.dtype == np.int64 and k.dtype == np.int64
    for i in range(2):
        for j in range(3):
            one = f.optimize(int(nodes[i, 0]), [2, 4, 8][j], 2048, accumulation=True)
            assert (g[i, j], b[i, j], k[i, j]) == pytest.approx(one)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 1, 32, 0), "num_nodes must be >= 1.0"),
        ((1.5, 2, 32, 0), "num_nodes must be whole numbers, got 1.5"),
        ((2, 1, 32, 0), "num_nodes must be <= num_replicas"),
        ((1, 1, 0, 0), "atomic_bsz must be > 0.0"),
        ((1, 1, math.nan, 0), "atomic_bsz must be finite"),
        ((1, 1, 32, -1), "accum_steps must be >= 0.0"),
        ((1, [1, 2], "x", 0), "atomic_bsz must be a real number"),
        ((True, 1, 32, 0), "num_nodes must be a real number"),
    ],
)
@pytest.mark.parametrize("as_array", [False, True])
def test_evaluate_rejects_bad_configurations(
    args: tuple[Any, ...], match: str, as_array: bool
) -> None:
    f = GoodputFunction(PERF, GRAD, 128)
    if as_array:
        args = tuple(np.array([a]) if np.ndim(a) == 0 else a for a in args)
    with pytest.raises(ValueError, match=match):
        f.evaluate(*args)
    with pytest.raises(ValueError, match=match):
        f.throughput(*args)


@settings(max_examples=100, deadline=None)
@given(
    f=st.builds(GoodputFunction, perf_params, grad_params, st.integers(1, 512)),
    topology=topologies(max_replicas=64),
    bsz=st.integers(1, 10_000),
    accum=st.integers(0, 50),
)
def test_scalar_and_array_evaluation_agree(
    f: GoodputFunction, topology: tuple[int, int], bsz: int, accum: int
) -> None:
    nodes, replicas = topology
    for method in (f.evaluate, f.throughput):
        one = method(nodes, replicas, bsz, accum)
        many = method(np.array([nodes]), [replicas], bsz, np.array(accum))
        assert one == pytest.approx(many[0], rel=1e-12)


def model_optim_time(
    p: PerfParams, nodes: int, replicas: int, bsz: int, flat: int | None = None
) -> float:
    """The model's optimiser step time written out from its docstring (the network's
    per-replica count stopped at ``flat`` replicas, if given)."""
    extra = max(replicas - 2, 0)
    if flat is not None:
        extra = min(extra, max(flat - 2, 0))
    if replicas == 1:
        network = 0.0
    elif nodes > 1:
        network = p.alpha_n + p.beta_n * extra
    else:
        network = p.alpha_r + p.beta_r * extra
    compute = p.alpha_c + p.beta_c * bsz
    return float((compute**p.gamma + network**p.gamma) ** (1.0 / p.gamma) + p.alpha_o)


@settings(max_examples=100, deadline=None)
@given(p=perf_params, topology=topologies(max_replicas=64), bsz=st.integers(1, 10_000))
def test_compute_and_optimiser_step_times_are_the_model(
    p: PerfParams, topology: tuple[int, int], bsz: int
) -> None:
    nodes, replicas = topology
    compute = p.alpha_c + p.beta_c * bsz
    optim = model_optim_time(p, nodes, replicas, bsz)
    assert compute_time(p, bsz) == pytest.approx(compute, rel=1e-12)
    assert optim_step_time(p, nodes, replicas, bsz) == pytest.approx(optim, rel=1e-9)
    # The goodput function's throughput runs on the same times.
    f = GoodputFunction(p, GRAD, 1)
    throughput = f.throughput(nodes, replicas, bsz, 0)
    assert throughput == pytest.approx(replicas * bsz / optim_step_time(p, nodes, replicas, bsz))
    many = optim_step_time(p, np.array([nodes, 1]), np.array([replicas, 1]), bsz)
    assert many.shape == (2,)
    assert many[0] == pytest.approx(optim_step_time(p, nodes, replicas, bsz), rel=1e-12)
    # One replica: nothing to wait for, the optimiser step only.
    assert many[1] == pytest.approx(compute + p.alpha_o, rel=1e-12)


@settings(max_examples=100, deadline=None)
@given(
    p=perf_params,
    topology=topologies(max_replicas=64),
    bsz=st.integers(1, 10_000),
    flat=st.integers(1, 64),
)
def test_a_network_held_flat_past_a_count_is_the_model_up_to_it(
    p: PerfParams, topology: tuple[int, int], bsz: int, flat: int
) -> None:
    nodes, replicas = topology
    plain = GoodputFunction(p, GRAD, 64)
    held = GoodputFunction(p, GRAD, 64, network_flat_beyond=flat)
    # The model's times with the per-replica count stopped at `flat`.
    optim = model_optim_time(p, nodes, replicas, bsz, flat)
    assert held.throughput(nodes, replicas, bsz, 0) == pytest.approx(replicas * bsz / optim)
    if replicas <= flat:
        assert held.evaluate(nodes, replicas, bsz, 2) == plain.evaluate(nodes, replicas, bsz, 2)
    # Optimistic: never a lower goodput, at its best batch size too.
    assert held.evaluate(nodes, replicas, bsz, 0) >= plain.evaluate(nodes, replicas, bsz, 0)
    best = held.optimize(nodes, replicas, max_batch_size=4096)[0]
    assert best >= plain.optimize(nodes, replicas, max_batch_size=4096)[0] * (1 - 1e-12)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "4"])
def test_network_flat_beyond_must_be_a_count(bad: Any) -> None:
    with pytest.raises((ValueError, TypeError), match="network_flat_beyond"):
        GoodputFunction(
            PerfParams(0.1, 0.01, 0.2, 0.01, 0.1, 0.005, 1.0), GRAD, 64, network_flat_beyond=bad
        )


def test_step_times_reject_bad_configurations() -> None:
    with pytest.raises(ValueError, match="num_nodes must be <= num_replicas"):
        optim_step_time(PERF, 2, 1, 32)
    with pytest.raises(ValueError, match=r"atomic_bsz must be > 0\.0"):
        compute_time(PERF, 0)
    with pytest.raises(ValueError, match=r"atomic_bsz must be > 0\.0"):
        optim_step_time(PERF, 1, 1, [32, 0])


# -- efficiency --------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(grad=grad_params, init=st.integers(1, 10_000), sizes=st.lists(st.floats(0.5, 1e6)))
def test_efficiency_in_unit_interval_and_non_increasing(
    grad: GradParams, init: int, sizes: list[float]
) -> None:
    f = GoodputFunction(PERF, grad, init)
    sizes = sorted([*sizes, float(init)])
    values = f.efficiency(sizes)
    assert np.all(values > 0) and np.all(values <= 1)
    assert np.all(np.diff(values) <= 1e-15)
    assert f.efficiency(init) == 1.0


@settings(max_examples=200, deadline=None)
@given(grad=grad_params, init=st.integers(1, 10_000), scale=st.floats(0.1, 1e4))
def test_efficiency_and_the_adascale_gain_are_one_definition(
    grad: GradParams, init: int, scale: float
) -> None:
    # The goodput model's efficiency (scalar and array paths) and the gain the steps
    # take (`adascale_gain`, hence `GradientNoiseScale.gain`) agree to the last bit:
    # the efficiency is the gain over the scale (below the initial batch: 1).
    batch = init * scale
    effective = max(batch, init) / init
    gain = adascale_gain(grad.sqr, grad.var, effective)
    f = GoodputFunction(PERF, grad, init)
    assert f.efficiency(batch) == gain / effective
    assert f.efficiency([batch, batch])[0] == gain / effective
    assert 1.0 <= gain <= effective


def test_efficiency_is_the_pollux_form() -> None:
    # B_noise = M0 * var / sqr = 100 * 3 / 1 = 300 samples.
    f = GoodputFunction(PERF, GradParams(sqr=1.0, var=3.0), 100)
    assert f.efficiency(400) == pytest.approx((300 + 100) / (300 + 400))
    assert f.efficiency(50) == 1.0  # not credited with more than 1 below M0
    # Pure noise: every sample counts fully; no information: no gain from scaling.
    assert GoodputFunction(PERF, GradParams(0.0, 1.0), 100).efficiency(800) == 1.0
    assert GoodputFunction(PERF, GradParams(0.0, 0.0), 100).efficiency(800) == 0.125
    assert GoodputFunction(PERF, GradParams(1.0, 0.0), 100).efficiency(800) == 0.125


# -- optimiser -----------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(space=search_spaces())
def test_optimize_matches_brute_force(space: dict[str, Any]) -> None:
    g, b, k = optimize(space)
    g_best, _, _, _ = brute_force(space)
    if g_best == 0.0:
        assert (g, b, k) == (0.0, 0, 0)
        return
    assert g >= g_best * (1 - 5e-3)  # the requirement
    assert g == pytest.approx(g_best, rel=1e-9)  # what the search proves: exact
    # The reported goodput is that of the reported configuration.
    assert g == pytest.approx(space["function"].evaluate(space["nodes"], space["replicas"], b, k))


@settings(max_examples=150, deadline=None)
@given(space=search_spaces())
def test_optimize_respects_every_bound(space: dict[str, Any]) -> None:
    f: GoodputFunction = space["function"]
    g, b, k = optimize(space)
    _, _, _, reachable = brute_force(space)
    m_max = space["max_batch_size"] or f.init_batch_size
    lo, hi = space["atomic_bsz_range"] or (None, None)
    if g == 0.0:
        assert space["replicas"] * (lo or 1) > m_max
        return
    assert (lo or 1) <= b <= (hi or m_max)
    assert k >= 0 and (space["accumulation"] or k == 0)
    total = space["replicas"] * b * (k + 1)
    assert total <= m_max
    assert (total >= f.init_batch_size) == reachable


@settings(max_examples=30, deadline=None)
@given(f=st.builds(GoodputFunction, perf_params, grad_params, st.integers(1, 512)))
def test_optimize_vectorised_agrees_with_one_at_a_time(f: GoodputFunction) -> None:
    nodes = np.array([1, 1, 2, 2, 4, 8])
    replicas = np.array([1, 4, 2, 8, 16, 64])
    m_max, bounds = 50 * f.init_batch_size, (2, 200)
    for accumulation in (False, True):
        g, b, k = f.optimize(nodes, replicas, m_max, bounds, accumulation)
        for i in range(len(nodes)):
            g1, b1, k1 = f.optimize(int(nodes[i]), int(replicas[i]), m_max, bounds, accumulation)
            assert g[i] == pytest.approx(g1, rel=1e-12)
            if (b[i], k[i]) != (b1, k1):  # only a tie within rounding may differ
                other = f.evaluate(int(nodes[i]), int(replicas[i]), b1, k1)
                assert other == pytest.approx(g[i], rel=1e-12)


def test_optimize_large_ranges_beyond_brute_force_stay_consistent() -> None:
    f = GoodputFunction(PERF, GradParams(1.0, 1000.0), 64)
    g, b, _ = f.optimize(4, 16, max_batch_size=1_000_000, atomic_bsz_range=(1, 100_000))
    sizes = np.arange(1, 62_501)
    brute = f.evaluate(4, 16, sizes, 0)
    assert g == pytest.approx(brute.max(), rel=1e-12)
    assert b == sizes[np.argmax(brute)]
    g2, b2, k2 = f.optimize(4, 16, 1_000_000, (1, 512), accumulation=True)
    assert b2 <= 512 and 16 * b2 * (k2 + 1) <= 1_000_000
    assert g2 >= f.evaluate(4, 16, 512, np.arange(0, 122)).max() * (1 - 1e-6)


def test_optimize_finds_sparse_admissible_pairs() -> None:
    # Total exactly 219 = 3 * 73 with atomic <= 65: only (3, 72) and (1, 218) fit,
    # far beyond the first numbers of micro-batches the scan examines.
    f = GoodputFunction(PERF, GRAD, 219)
    _, b, k = f.optimize(1, 1, atomic_bsz_range=(None, 65), accumulation=True)
    assert (b, k) == (3, 72)
    _, b_arr, k_arr = f.optimize([1], [1], atomic_bsz_range=(None, 65), accumulation=True)
    assert (b_arr[0], k_arr[0]) == (3, 72)


def test_unreachable_initial_batch_size_gives_the_largest_total_below() -> None:
    # A local batch of exactly 100 needs a divisor of 100 in [30, 40]: there is none,
    # so the initial batch size cannot be reached and the best total lies below it.
    f = GoodputFunction(PERF, GRAD, 100)
    space = {
        "function": f,
        "nodes": 1,
        "replicas": 1,
        "max_batch_size": None,
        "atomic_bsz_range": (30, 40),
        "accumulation": True,
    }
    g, b, k = optimize(space)
    g_best, b_best, k_best, reachable = brute_force(space)
    assert not reachable
    assert g == pytest.approx(g_best)
    assert (b, k) == (b_best, k_best) == (40, 0)  # a tie with (40, 1): fewer steps win


@pytest.mark.parametrize("scalar", [False, True])
def test_optimize_is_exact_even_from_a_wrong_real_maximiser(
    monkeypatch: pytest.MonkeyPatch, scalar: bool
) -> None:
    # The local search after the real maximiser makes the integer result exact on
    # its own; feed it a maximiser far off to the left and to the right.
    import adaptdl.core.goodput.optimize as goodput_optimize

    f = GoodputFunction(PERF, GRAD, 128)
    sizes = np.arange(16, 257)
    best = f.evaluate(2, 8, sizes, 0).max()
    for wrong in (16.0, 256.0):
        # One search serves floats (one configuration) and arrays alike.
        monkeypatch.setattr(
            goodput_optimize, "_argmax_continuous", lambda p, u, lo, hi, w=wrong: w + 0.0 * lo
        )
        if scalar:
            g, b, _ = f.optimize(2, 8, 4096, (16, 256))
        else:
            g, b, _ = (x[0] for x in f.optimize([2], [8], 4096, (16, 256)))
        assert g == pytest.approx(best, rel=1e-12)
        assert b == sizes[np.argmax(f.evaluate(2, 8, sizes, 0))]


def test_default_max_batch_size_is_the_initial_one() -> None:
    f = GoodputFunction(PERF, GRAD, 128)
    # Replicas divide 128: the total is exactly the initial batch size.
    assert f.optimize(1, 4) == (pytest.approx(f.evaluate(1, 4, 32, 0)), 32, 0)
    # Three replicas cannot make 128 exactly: the largest total below it.
    assert f.optimize(1, 3)[1:] == (42, 0)
    # With accumulation a small memory bound splits the initial batch.
    assert f.optimize(1, 4, atomic_bsz_range=(None, 8), accumulation=True)[1:] == (8, 3)


def test_infeasible_configuration_gives_zero() -> None:
    f = GoodputFunction(PERF, GRAD, 16)
    g, b, k = f.optimize([1, 8], [4, 64], max_batch_size=32, atomic_bsz_range=(1, None))
    assert g[1] == 0.0 and b[1] == 0 and k[1] == 0 and g[0] > 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_batch_size": 64}, r"max_batch_size must be >= init_batch_size \(128\)"),
        ({"max_batch_size": 256.0}, "max_batch_size must be an int"),
        ({"atomic_bsz_range": (0, 8)}, r"atomic_bsz_range\[0\] must be >= 1"),
        ({"atomic_bsz_range": (16, 8)}, r"atomic_bsz_range\[1\] must be >= 16"),
        ({"atomic_bsz_range": (1, 2, 3)}, "atomic_bsz_range must be a pair"),
        ({"atomic_bsz_range": 8}, "atomic_bsz_range must be a pair"),
        ({"accumulation": 1}, "accumulation must be a bool"),
    ],
)
def test_optimize_rejects_bad_bounds(kwargs: dict[str, Any], match: str) -> None:
    f = GoodputFunction(PERF, GRAD, 128)
    with pytest.raises(ValueError, match=match):
        f.optimize(1, 4, **kwargs)


def test_optimize_rejects_bad_topology() -> None:
    f = GoodputFunction(PERF, GRAD, 128)
    with pytest.raises(ValueError, match="num_nodes must be <= num_replicas"):
        f.optimize([1, 3], [2, 2])
    with pytest.raises(ValueError, match=r"num_replicas must be >= 1\.0"):
        f.optimize(1, 0)


# -- fit -------------------------------------------------------------------------


def synthetic_profile(
    params: PerfParams, rng: np.random.Generator, n: int, noise: float = 0.05
) -> tuple[np.ndarray, ...]:
    """Observations at random configurations with multiplicative lognormal noise."""
    nodes = rng.integers(1, 5, n)
    replicas = nodes * rng.integers(1, 5, n)
    bsz = rng.integers(4, 257, n)
    f = GoodputFunction(params, GRAD, 1)
    accum = params.alpha_c + params.beta_c * bsz
    optim = replicas * bsz / f.throughput(nodes, replicas, bsz, 0)
    accum = accum * np.exp(rng.normal(0.0, noise, n))
    optim = optim * np.exp(rng.normal(0.0, noise, n))
    return nodes, replicas, bsz, accum, optim


def prediction_errors(
    fitted: PerfParams, true: PerfParams, rng: np.random.Generator
) -> tuple[float, float]:
    """Median relative errors of accumulation and optimiser step times, held out."""
    nodes, replicas, bsz, accum, optim = synthetic_profile(true, rng, 500, noise=0.0)
    f = GoodputFunction(fitted, GRAD, 1)
    pred_accum = fitted.alpha_c + fitted.beta_c * bsz
    pred_optim = replicas * bsz / f.throughput(nodes, replicas, bsz, 0)
    return (
        float(np.median(np.abs(pred_accum / accum - 1))),
        float(np.median(np.abs(pred_optim / optim - 1))),
    )


fit_params = st.builds(
    PerfParams,
    *[st.floats(-3.0, -1.0).map(lambda e: 10.0**e)] * 1,
    st.floats(-4.0, -2.0).map(lambda e: 10.0**e),
    *[st.floats(-3.0, -0.5).map(lambda e: 10.0**e)] * 4,
    st.floats(1.0, 10.0),
)


@settings(max_examples=15, deadline=None)
@given(true=fit_params, seed=st.integers(0, 2**32 - 1), n=st.sampled_from([50, 200]))
def test_fit_predicts_held_out_step_times(true: PerfParams, seed: int, n: int) -> None:
    rng = np.random.default_rng(seed)
    fitted = fit_perf_params(*synthetic_profile(true, rng, n))
    err_accum, err_optim = prediction_errors(fitted, true, rng)
    assert err_accum < 0.10
    assert err_optim < 0.10


@settings(max_examples=6, deadline=None)
@given(
    true=fit_params,
    seed=st.integers(0, 2**32 - 1),
    start=st.sampled_from([1e-8, 1e-3, 10.0, 1e4]),
    gamma=st.sampled_from([1.0, 10.0]),
)
def test_fit_converges_from_poor_starts(
    true: PerfParams, seed: int, start: float, gamma: float
) -> None:
    rng = np.random.default_rng(seed)
    initial = PerfParams(start, start, start, start, start, start, gamma)
    fitted = fit_perf_params(*synthetic_profile(true, rng, 200), initial=initial)
    err_accum, err_optim = prediction_errors(fitted, true, rng)
    assert err_accum < 0.10
    assert err_optim < 0.10


@pytest.mark.parametrize("scale", [1e-5, 1e4])
def test_fit_is_indifferent_to_the_time_unit(scale: float) -> None:
    # Microsecond and multi-hour steps: far from any fixed default start.
    true = PerfParams(
        0.05 * scale, 0.002 * scale, 0.3 * scale, 0.02 * scale, 0.1 * scale, 0.01 * scale, 3.0
    )
    rng = np.random.default_rng(11)
    fitted = fit_perf_params(*synthetic_profile(true, rng, 100))
    err_accum, err_optim = prediction_errors(fitted, true, rng)
    assert err_accum < 0.05 and err_optim < 0.05


def test_fit_recovers_exact_parameters_without_noise() -> None:
    true = PerfParams(0.05, 0.002, 0.3, 0.02, 0.1, 0.01, 1.0)
    rng = np.random.default_rng(7)
    fitted = fit_perf_params(*synthetic_profile(true, rng, 100, noise=0.0))
    err_accum, err_optim = prediction_errors(fitted, true, rng)
    assert err_accum < 1e-3 and err_optim < 1e-3


def test_fit_priors_for_unobserved_dimensions() -> None:
    true = PerfParams(0.05, 0.002, 0.3, 0.02, 0.1, 0.01, 1.5)
    f = GoodputFunction(true, GRAD, 1)
    # One node, at most two replicas, one atomic batch size.
    nodes = np.array([1, 1, 1, 1])
    replicas = np.array([1, 2, 1, 2])
    bsz = np.full(4, 64)
    accum = true.alpha_c + true.beta_c * bsz
    optim = replicas * bsz / f.throughput(nodes, replicas, bsz, 0)
    fitted = fit_perf_params(nodes, replicas, bsz, accum, optim)
    assert fitted.alpha_c == pytest.approx(accum[0] / 2)  # half of the compute time
    assert fitted.alpha_c + 64 * fitted.beta_c == pytest.approx(accum[0], rel=1e-3)
    assert fitted.beta_r == pytest.approx(PARAM_FLOOR)  # never more than two replicas
    assert fitted.alpha_n >= 1.1 * fitted.alpha_r  # never across nodes
    assert fitted.beta_n >= 1.1 * fitted.beta_r
    # Single replica only: no network term to fit, gamma stays 1.
    alone = fit_perf_params([1, 1], [1, 1], [32, 64], accum[:2] * [0.6, 1], accum[:2] * [0.6, 1])
    assert alone.gamma == 1.0
    assert alone.alpha_r == pytest.approx(PARAM_FLOOR)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"num_nodes": []}, "num_nodes must hold at least one observation"),
        ({"atomic_bsz": [32, 64]}, "all observation arrays must have the same length"),
        ({"accum_step_time": [0.1, math.nan, 0.2]}, "accum_step_time must be finite"),
        ({"optim_step_time": [0.1, math.inf, 0.2]}, "optim_step_time must be finite"),
        ({"optim_step_time": [0.1, 0.0, 0.2]}, r"optim_step_time must be > 0.0, got 0.0"),
        ({"accum_step_time": [0.1, -1.0, 0.2]}, r"accum_step_time must be > 0.0, got -1.0"),
        ({"atomic_bsz": [32, 0, 64]}, "atomic_bsz must be > 0.0"),
        ({"num_nodes": [1, 3, 1]}, "num_nodes must be <= num_replicas"),
        ({"num_replicas": [1, 2.5, 4]}, "num_replicas must be whole numbers"),
        ({"num_replicas": [[1, 2, 4]]}, "num_replicas must be a 1-D sequence"),
        ({"num_nodes": ["a", "b", "c"]}, "num_nodes must be a real number"),
    ],
)
def test_fit_rejects_bad_observations(change: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {
        "num_nodes": [1, 1, 1],
        "num_replicas": [1, 2, 4],
        "atomic_bsz": [32, 32, 64],
        "accum_step_time": [0.1, 0.1, 0.2],
        "optim_step_time": [0.1, 0.15, 0.3],
    }
    args.update(change)
    with pytest.raises(ValueError, match=match):
        fit_perf_params(**args)
