"""Parametric applications step as core's throughput model says."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from adaptdl.core.goodput import GoodputFunction, GradParams, PerfParams
from adaptdl.sim.apps import (
    DEFAULT_PERF_PARAMS,
    ParametricApplication,
    builtin_applications,
    stats_by_batch_size,
)

APPS = builtin_applications()


@given(
    name=st.sampled_from(sorted(APPS)),
    per_node=st.lists(st.integers(1, 4), min_size=1, max_size=6),
    local=st.integers(1, 1024),
    accum=st.integers(0, 6),
)
def test_iteration_time_is_cores_model(
    name: str, per_node: list[int], local: int, accum: int
) -> None:
    app = APPS[name]
    fn = GoodputFunction(app.perf_params, GradParams(0.0, 0.0), app.init_batch_size)
    nodes, replicas = len(per_node), sum(per_node)
    step, _ = app.iteration_time(per_node, local, accum)
    samples = replicas * local * (accum + 1)
    assert step == pytest.approx(samples / fn.throughput(nodes, replicas, local, accum))


def test_single_fields_override_the_default_model() -> None:
    app = ParametricApplication("x", 32, 64, (1, 64), 1000, 2, alpha_c=0.5, gamma=2.0)
    assert app.perf_params.alpha_c == 0.5 and app.perf_params.gamma == 2.0
    assert app.perf_params.beta_c == DEFAULT_PERF_PARAMS.beta_c
    own = PerfParams(0.1, 0.01, 0.2, 0.01, 0.1, 0.005, 3.0)
    assert ParametricApplication("y", 32, 64, (1, 64), 1000, 2, perf_params=own).perf_params == own
    with pytest.raises(TypeError, match="alpha_x"):
        ParametricApplication("z", 32, 64, (1, 64), 1000, 2, alpha_x=1.0)
    with pytest.raises(ValueError, match="beta_c"):
        ParametricApplication("z", 32, 64, (1, 64), 1000, 2, beta_c=-1.0)


@given(
    st.lists(st.integers(1, 4096), min_size=1, max_size=5, unique=True).map(sorted),
    st.floats(0.5, 5000.0),
    st.integers(-2, 4),
)
def test_stats_by_batch_size_are_linear_between_rows_and_flat_outside(
    sizes: list[int], batch_size: float, epoch: int
) -> None:
    bs = np.array(sizes, dtype=np.float64)
    sqr = np.outer(bs, [1.0, 2.0, 3.0])  # linear in the batch size: interpolation is exact
    var = sqr + 1.0
    e = min(max(epoch, 0), 2)
    clamped = min(max(batch_size, bs[0]), bs[-1])
    got = stats_by_batch_size(bs, sqr, var, batch_size, epoch)
    assert got == pytest.approx((clamped * (e + 1), clamped * (e + 1) + 1.0), rel=1e-9)
