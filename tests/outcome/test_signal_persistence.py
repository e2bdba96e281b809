"""`experiments.outcome.signal_persistence`: the lagged products, the prototype estimator."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from experiments.outcome import signal_persistence as sp
from hypothesis import given, settings
from hypothesis import strategies as st

import torch
from adaptdl.core.stats.gns import GradientNoiseScale


def _params_with_grad(values: np.ndarray) -> list[torch.Tensor]:
    p = torch.zeros(len(values), requires_grad=True)
    p.grad = torch.from_numpy(values.astype(np.float64)).float()
    return [p]


def test_memory_product_pairs_each_step_with_the_average_before_it() -> None:
    memory = sp.GradientMemory(0.5)
    g1, g2, g3 = np.array([1.0, 0.0]), np.array([0.0, 2.0]), np.array([3.0, 1.0])
    assert math.isnan(memory.product(_params_with_grad(g1)))
    assert memory.product(_params_with_grad(g2)) == pytest.approx(g2 @ g1)
    # e_2 normalised: (0.5 * 0.5 g1 + 0.5 g2) / (0.25 + 0.5).
    e2 = (0.25 * g1 + 0.5 * g2) / 0.75
    assert memory.product(_params_with_grad(g3)) == pytest.approx(g3 @ e2)


def test_memory_zero_is_the_previous_step_only() -> None:
    memory = sp.GradientMemory(0.0)
    grads = [np.array([1.0, 2.0]), np.array([-1.0, 0.5]), np.array([4.0, 4.0])]
    out = [memory.product(_params_with_grad(g)) for g in grads]
    assert out[1:] == pytest.approx([grads[1] @ grads[0], grads[2] @ grads[1]])


@pytest.mark.parametrize("beta", [-0.1, 1.0, 1.5])
def test_memory_refuses_a_beta_outside_its_range(beta: float) -> None:
    with pytest.raises(ValueError, match="beta must be in"):
        sp.GradientMemory(beta)


@settings(max_examples=20, deadline=None)
@given(st.floats(0.0, 0.9), st.integers(0, 2**31 - 1))
def test_memory_product_is_unbiased_for_a_fixed_gradient(beta: float, seed: int) -> None:
    # Independent noise on a constant gradient: E[g_t . e_{t-1}] = |G|^2, no noise term.
    gen = np.random.default_rng(seed)
    g = np.array([0.6, -0.8, 0.3])
    memory = sp.GradientMemory(beta)
    products = [memory.product(_params_with_grad(g + gen.normal(0, 1.0, 3))) for _ in range(4000)]
    mean = float(np.mean(products[1:]))
    # The same-step squared norm would read |G|^2 + 3 (the noise's trace) = 4.09.
    assert mean == pytest.approx(g @ g, abs=0.3)


def test_memory_product_cancels_a_gradient_that_flips_sign() -> None:
    memory = sp.GradientMemory(0.0)
    out = [memory.product(_params_with_grad(np.array([(-1.0) ** t, 0.0]))) for t in range(6)]
    assert out[1:] == pytest.approx([-1.0] * 5)


def test_persistent_scale_takes_the_queued_products_in_order() -> None:
    plain = GradientNoiseScale(init_batch_size=16)
    proto = sp.PersistentSignalScale(init_batch_size=16)
    proto.pending.extend([math.nan, 0.25, 0.5])
    steps = [(3.0, 1.0), (2.6, 0.9), (2.2, 0.8)]  # (local_sqr over 2 micro-batches, total)
    for local, total in steps:
        plain.update(local, total, 2, 8)
        proto.update(local, total, 2, 8)
    assert not proto.pending
    # Same tr(Sigma) estimates; |G|^2 is core's at the first step, then the products.
    assert proto.var == pytest.approx(plain.var, rel=1e-12)
    reference = GradientNoiseScale(init_batch_size=16)
    from adaptdl.core.stats.gns import step_estimates

    for k, (local, total) in enumerate(steps):
        sqr, var = step_estimates(local, total, 2, 8)
        sqr = sqr if k == 0 else [0.25, 0.5][k - 1]
        reference._fold((sqr,), (var,), 1.0)
    assert proto.sqr == pytest.approx(reference.sqr, rel=1e-12)
    assert proto.sqr != pytest.approx(plain.sqr, rel=1e-3)


def test_persistent_scale_keeps_core_estimate_with_nothing_queued() -> None:
    plain = GradientNoiseScale(init_batch_size=16)
    proto = sp.PersistentSignalScale(init_batch_size=16)
    plain.update(3.0, 1.0, 2, 8)
    proto.update(3.0, 1.0, 2, 8)
    assert (proto.sqr, proto.var) == pytest.approx((plain.sqr, plain.var), rel=1e-12)


def test_persistent_scale_takes_one_group_only() -> None:
    proto = sp.PersistentSignalScale(init_batch_size=16, num_groups=2)
    with pytest.raises(ValueError, match="one parameter group"):
        proto.update([1.0, 1.0], [0.5, 0.5], 2, 8)


def test_summarise_splits_phases_where_the_levels_were_first_reached() -> None:
    # Two phases: steps 0-3 (signal 2, lag-1 product 1) until 0.5, then 4-9 (4 and 4).
    rows = [[2.0, 10.0, 1.0, 1.0]] * 4 + [[4.0, 10.0, 4.0, 4.0]] * 6
    run = {
        "problem": "shapes",
        "lags": [1],
        "averages": [0.5],
        "evals": [[0, 0.1], [4, 0.6], [10, 0.9]],
        "rows": rows,
    }
    phases = sp.summarise([run], levels=[0.5, 0.8])
    assert [p["steps"] for p in phases] == [4, 6]
    assert phases[0]["noise_scale"] == pytest.approx(
        {"simple": 5.0, "lag 1": 10.0, "average 0.5": 10.0}
    )
    assert phases[1]["noise_scale"]["lag 1"] == pytest.approx(2.5)
    text = sp.table(phases)
    assert "| 0.5 | 4 | 10.0 | 5 | 10 | 10 |" in text
    assert "| 0.5 | 2 | 0.50 | 0.50 |" in text  # the products over the same-step |G|^2


def test_run_records_every_step_until_the_target_on_a_tiny_problem(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from experiments.outcome import time_to_target

    tiny = {**time_to_target.PROBLEMS["shapes"], "train_size": 256, "val_size": 64}
    tiny.update(progress_epochs=1, eval_every_samples=64, target_accuracy=1.01)
    monkeypatch.setitem(time_to_target.PROBLEMS, "shapes", tiny)
    out = sp.run(0, "shapes", lags=(1, 2), averages=(0.5,))
    # One epoch of 16-sample steps, evaluated every 4 steps and at the end.
    assert len(out["rows"]) == 16
    assert [s for s, _ in out["evals"]] == [0, 4, 8, 12, 16]
    assert all(len(r) == 2 + 2 + 1 for r in out["rows"])
    assert math.isnan(out["rows"][0][2]) and math.isnan(out["rows"][1][3])
    assert all(np.isfinite(r[2]) for r in out["rows"][1:])


def test_decision_only_keeps_core_statistics_for_the_gain() -> None:
    plain = GradientNoiseScale(init_batch_size=16)
    proto = sp.PersistentSignalScale(init_batch_size=16, decision_only=True)
    proto.pending.extend([math.nan, 0.05, 0.05, 0.05])
    steps = [(3.0, 1.0), (2.6, 0.9), (2.2, 0.8), (2.4, 0.85)]
    for local, total in steps:
        plain.update(local, total, 2, 8)
        proto.update(local, total, 2, 8)
    # The gain (and so the rate and the progress) is core's.
    assert (proto.sqr, proto.var) == pytest.approx((plain.sqr, plain.var), rel=1e-12)
    assert proto.gain(16.0) == pytest.approx(plain.gain(16.0), rel=1e-12)
    # The decision reads the products: a smaller |G|^2, the same tr(Sigma).
    decided, core = proto.grad_params(), plain.grad_params()
    assert decided is not None and core is not None
    assert decided.var == pytest.approx(core.var, rel=1e-12)
    assert decided.sqr < 0.5 * core.sqr
    bound, core_bound = proto.grad_params_bound(2.0), plain.grad_params_bound(2.0)
    assert bound is not None and core_bound is not None
    assert bound.sqr != pytest.approx(core_bound.sqr, rel=1e-3)
    assert proto.resolved


def test_decision_only_is_unresolved_while_the_products_are_negative() -> None:
    proto = sp.PersistentSignalScale(init_batch_size=16, decision_only=True)
    proto.pending.extend([-0.5, -0.5])
    proto.update(3.0, 1.0, 2, 8)
    proto.update(2.6, 0.9, 2, 8)
    assert proto.sqr > 0.0  # core's estimate resolves the gradient
    assert not proto.resolved  # the decision's does not: it grows by its cap only


def test_queued_products_pair_with_their_steps_under_the_step_contract() -> None:
    # Two replicas: the contract folds each step's summed norms at the next step's
    # measure; the trainer queues the step's product between the two (before its
    # optimizer.step()). Each fold must take its own step's product.
    from tests.threadcollective import run_replicas

    from adaptdl.core.stats.gns import step_estimates
    from adaptdl.core.stats.metrics import MetricsState
    from adaptdl.core.stats.step import StepMeasurement, StepStatistics

    norms = [(3.0, 1.5), (2.8, 1.2), (2.6, 1.0), (2.4, 0.9)]  # per replica: local, total
    products = [math.nan, 0.3, 0.2, 0.1]

    def replica(collective: Any) -> Any:
        metrics = MetricsState()
        metrics.gns = sp.PersistentSignalScale(init_batch_size=8)
        steps = StepStatistics(metrics, collective)
        for (local, total), product in zip(norms, products, strict=True):
            measurement = StepMeasurement(
                local_sqr=[local], total_sqr=[total], micro_batches=1, num_replicas=2, batch_size=4
            )
            steps.measure(measurement, 8)
            metrics.gns.pending.append(product)
        steps.drain()
        return metrics.gns.sqr, metrics.gns.var, len(metrics.gns.pending)

    reference = GradientNoiseScale(init_batch_size=8)
    for (local, total), product in zip(norms, products, strict=True):
        sqr, var = step_estimates(2 * local, total, 2, 4)
        reference._fold((sqr if math.isnan(product) else product,), (var,), 1.0)
    for sqr, var, left in run_replicas(2, replica):
        assert (sqr, var) == pytest.approx((reference.sqr, reference.var), rel=1e-12)
        assert left == 0


def test_persistent_scale_refuses_single_micro_batch_steps() -> None:
    proto = sp.PersistentSignalScale(init_batch_size=16)
    with pytest.raises(ValueError, match="two or more micro-batches"):
        proto.update_differenced(1.0, 1.0, 1.0, 16)


def test_decision_only_changes_the_models_the_decision_reads() -> None:
    from adaptdl.core.stats.metrics import MetricsState

    steps = [(3.0, 1.0), (2.6, 0.9), (2.2, 0.8), (2.4, 0.85)]
    models = []
    for products in ([math.nan] * 4, [math.nan, 0.05, 0.05, 0.05]):
        metrics = MetricsState()
        metrics.gns = sp.PersistentSignalScale(init_batch_size=16, decision_only=True)
        metrics.gns.pending.extend(products)
        for local, total in steps:
            metrics.gns.update(local, total, 2, 8)
        models.append((metrics.grad_params(), metrics.gns.gain(16.0)))
    (core_params, core_gain), (params, gain) = models
    assert core_params is not None and params is not None
    assert params.sqr < 0.5 * core_params.sqr  # the decision reads the products
    assert gain == pytest.approx(core_gain, rel=1e-12)  # the gain does not
