"""The metrics' declared components: the estimator factory and the loss floor's config."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adaptdl.core.job import Job
from adaptdl.core.stats.estimators import DEFAULT_ESTIMATOR, ESTIMATORS, estimator_factory
from adaptdl.core.stats.floor import FloorConfig, LossFloor, sgd_rate
from adaptdl.core.stats.gns import GradientNoiseScale
from adaptdl.core.stats.metrics import MetricsConfig, MetricsState


def _smoothed(init_batch_size: int, num_groups: int) -> GradientNoiseScale:
    return GradientNoiseScale(
        init_batch_size=init_batch_size, num_groups=num_groups, smoothing=0.9
    )


def _fed(metrics: MetricsState) -> GradientNoiseScale:
    est = metrics.ensure_gns(16)
    for sqr_local, total in [(40.0, 15.0), (42.0, 15.5), (38.0, 14.5), (41.0, 15.2)]:
        est.update([sqr_local], [total], 2, 8)
    return est


def test_an_unknown_estimator_is_refused_naming_the_value_and_the_registered_names() -> None:
    registry = {**ESTIMATORS, "smoothed": _smoothed}
    message = r"estimator must be one of .*'gradient-noise-scale', 'smoothed'.*got 'nope'"
    with pytest.raises(ValueError, match=message):
        estimator_factory("nope", registry)
    with pytest.raises(ValueError, match=message):
        MetricsState(config=MetricsConfig(estimator="nope"), estimators=registry)
    with pytest.raises(ValueError, match=r"got 'smoothed'"):
        Job(metrics_config=MetricsConfig(estimator="smoothed"))  # not in core's registry
    with pytest.raises(ValueError, match=r"estimator must be a non-empty name, got 3"):
        MetricsConfig(estimator=3)  # type: ignore[arg-type]


def test_the_job_makes_its_estimator_by_the_configured_name() -> None:
    job = Job(
        metrics_config=MetricsConfig(estimator="smoothed"),
        estimators={**ESTIMATORS, "smoothed": _smoothed},
    )
    est = job.metrics.ensure_gns(8, 2)
    assert est.smoothing == 0.9 and (est.init_batch_size, est.num_groups) == (8, 2)
    assert job.metrics.ensure_gns(8, 2) is est  # kept while its shape holds
    default = Job().metrics.ensure_gns(8)
    assert type(default) is GradientNoiseScale
    assert default.to_json() == GradientNoiseScale(init_batch_size=8).to_json()
    assert MetricsConfig().estimator == DEFAULT_ESTIMATOR


def test_a_factory_making_another_shape_is_refused() -> None:
    metrics = MetricsState(
        config=MetricsConfig(estimator="wrong"),
        estimators={"wrong": lambda b, g: GradientNoiseScale(init_batch_size=b + 1)},
    )
    with pytest.raises(ValueError, match=r"estimator 'wrong' made one for .*\(17, 1\).*\(16, 1\)"):
        metrics.ensure_gns(16)


@given(
    memory=st.floats(0.0, 1.0, exclude_max=True),
    min_steps=st.integers(1, 10**6),
    cap=st.floats(0.0, 1.0, exclude_max=True),
)
def test_a_floor_config_makes_a_floor_with_its_settings(
    memory: float, min_steps: int, cap: float
) -> None:
    floor = FloorConfig(memory=memory, min_steps=min_steps, cap=cap).make()
    assert (floor.memory, floor.min_steps, floor.cap) == (memory, min_steps, cap)
    assert floor.to_json() == LossFloor(memory=memory, min_steps=min_steps, cap=cap).to_json()


def test_the_floor_configs_defaults_are_the_floors_and_bad_values_are_named() -> None:
    assert FloorConfig().make().to_json() == LossFloor().to_json()
    assert FloorConfig().enabled
    for bad, message in (
        ({"memory": 1.0}, r"memory must be"),
        ({"cap": -0.1}, r"cap must be"),
        ({"min_steps": 0}, r"min_steps must be"),
        ({"enabled": "no"}, r"enabled must be True or False, got 'no'"),
    ):
        with pytest.raises(ValueError, match=message):
            FloorConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"floor must be a FloorConfig, got None"):
        MetricsConfig(floor=None)  # type: ignore[arg-type]


def test_the_floor_off_by_config_keeps_no_floor_and_credits_nothing() -> None:
    on = MetricsState(config=MetricsConfig(floor=FloorConfig(min_steps=1)))
    off = MetricsState(config=MetricsConfig(floor=FloorConfig(enabled=False, min_steps=1)))
    for metrics in (on, off):
        _fed(metrics)
        for _ in range(4):
            metrics.profiler.record(1, 1, 16, accum_step=False, step_time=0.02)
        for _ in range(3):
            metrics.add_progress(1.0)
            metrics.observe_loss(0.02, [sgd_rate(0.05, 0.9)], 16)
    assert on.floor is not None and on.floor_share() > 0.0
    assert off.floor is None and off.floor_share() == 0.0
    fn = off.goodput_fn(16)
    assert fn is not None and fn.grad_params == off.grad_params()
    assert off.to_json()["floor"] is None
    # A checkpoint holding a floor restores none into a job configured without it.
    off.load_json(on.to_json())
    assert off.floor is None and off.floor_share() == 0.0
