"""Learning-rate scaling rules: the AdaScale gain and each rule's factor."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptdl.core.stats.scaling import (
    AdamScale,
    AdaScale,
    GivenFactor,
    LEGWScale,
    LinearScale,
    ScalingRule,
    SqrtScale,
    adascale_gain,
)

SETTINGS = settings(max_examples=200, deadline=None)
ALL_RULES: list[ScalingRule] = [
    AdaScale(),
    AdamScale(),
    LinearScale(),
    SqrtScale(),
    LEGWScale(1.0, 10, 1),
]

stat = st.floats(min_value=0.0, max_value=1e6)
scales = st.floats(min_value=1.0, max_value=1e4)


def test_hand_computed_gains() -> None:
    assert adascale_gain(1.0, 1.0, 4.0) == pytest.approx(2.0 / 1.25)
    assert adascale_gain(3.0, 6.0, 2.0) == pytest.approx(9.0 / 6.0)
    assert adascale_gain(1.0, 1.0, 0.5) == pytest.approx(2.0 / 3.0)


@SETTINGS
@given(stat, stat, scales)
def test_gain_lies_between_one_and_scale(sqr: float, var: float, scale: float) -> None:
    assert 1.0 <= adascale_gain(sqr, var, scale) <= scale


@SETTINGS
@given(stat, stat, st.floats(min_value=1e-3, max_value=1.0))
def test_gain_below_unit_scale_lies_between_scale_and_one(
    sqr: float, var: float, scale: float
) -> None:
    assert scale <= adascale_gain(sqr, var, scale) <= 1.0


@SETTINGS
@given(
    stat, stat, st.floats(min_value=1e-3, max_value=1e4), st.floats(min_value=1e-3, max_value=1e4)
)
def test_gain_is_monotone_in_scale(sqr: float, var: float, s1: float, s2: float) -> None:
    lo, hi = sorted((s1, s2))
    assert adascale_gain(sqr, var, lo) <= adascale_gain(sqr, var, hi) * (1 + 1e-12)


@SETTINGS
@given(stat, stat)
def test_gain_is_one_at_unit_scale(sqr: float, var: float) -> None:
    assert adascale_gain(sqr, var, 1.0) == pytest.approx(1.0, rel=1e-12)


@SETTINGS
@given(st.floats(min_value=1e-3, max_value=1e3), scales)
def test_gain_tends_to_scale_when_noise_dominates(sqr: float, scale: float) -> None:
    assert adascale_gain(0.0, sqr, scale) == pytest.approx(scale)
    assert adascale_gain(sqr, sqr * 1e12, scale) == pytest.approx(scale, rel=1e-6)


@SETTINGS
@given(st.floats(min_value=1e-3, max_value=1e3), scales)
def test_gain_tends_to_one_without_noise(sqr: float, scale: float) -> None:
    assert adascale_gain(sqr, 0.0, scale) == 1.0
    assert adascale_gain(sqr, sqr * 1e-12, scale) == pytest.approx(1.0, rel=1e-6)


def test_gain_is_one_without_any_statistics() -> None:
    assert adascale_gain(0.0, 0.0, 16.0) == 1.0


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((-1.0, 1.0, 2.0), "sqr must be >= 0"),
        ((1.0, -1.0, 2.0), "var must be >= 0"),
        ((1.0, 1.0, 0.0), "scale must be > 0"),
        ((1.0, 1.0, -2.0), "scale must be > 0"),
        ((math.nan, 1.0, 2.0), "sqr must be finite"),
        ((1.0, math.inf, 2.0), "var must be finite"),
        ((1.0, 1.0, "2"), "scale must be a real number"),
    ],
)
def test_gain_rejects_bad_input(args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        adascale_gain(*args)


# -- rules --


def test_rule_factors() -> None:
    assert AdaScale().lr_factor(3.0, 8.0, 0.0) == 3.0
    assert AdamScale().lr_factor(4.0, 8.0, 0.0) == 2.0
    assert LinearScale().lr_factor(3.0, 8.0, 0.0) == 8.0
    assert SqrtScale().lr_factor(3.0, 16.0, 0.0) == 4.0


def test_rules_have_distinct_names_and_share_the_protocol() -> None:
    assert len({rule.name for rule in ALL_RULES}) == len(ALL_RULES)
    assert all(isinstance(rule, ScalingRule) for rule in ALL_RULES)


@SETTINGS
@given(st.floats(min_value=1.0, max_value=1e3), st.floats(0.0, 1.0), st.floats(0.0, 1e6))
def test_gain_rules_stay_within_the_gain(scale: float, frac: float, progress: float) -> None:
    gain = 1.0 + frac * (scale - 1.0)
    assert (
        1.0
        <= AdamScale().lr_factor(gain, scale, progress)
        <= AdaScale().lr_factor(gain, scale, progress)
    )
    assert SqrtScale().lr_factor(gain, scale, progress) <= LinearScale().lr_factor(
        gain, scale, progress
    )


def test_legw_ramps_linearly_over_a_warmup_that_grows_with_scale() -> None:
    # 2 base epochs of 1000 samples at initial batch 100: 20 initial steps at scale 1.
    rule = LEGWScale(base_warmup_epochs=2, data_size=1000, init_batch_size=100)
    assert rule.warmup_progress(1.0) == 20.0
    assert rule.warmup_progress(4.0) == 80.0
    assert rule.lr_factor(1.0, 1.0, 0.0) == 0.0
    assert rule.lr_factor(1.0, 1.0, 10.0) == pytest.approx(0.5)
    assert rule.lr_factor(1.0, 1.0, 20.0) == 1.0
    assert rule.lr_factor(3.0, 4.0, 40.0) == pytest.approx(2.0 * 0.5)
    assert rule.lr_factor(3.0, 4.0, 80.0) == 2.0
    assert rule.lr_factor(3.0, 4.0, 1e9) == 2.0


def test_legw_without_warmup_is_sqrt_scale() -> None:
    rule = LEGWScale(0.0, 1000, 100)
    assert rule.lr_factor(1.0, 9.0, 0.0) == 3.0


@SETTINGS
@given(
    st.floats(0.0, 10.0),
    st.floats(min_value=0.01, max_value=100.0),
    st.floats(0.0, 1e5),
    st.floats(0.0, 1e5),
)
def test_legw_never_exceeds_sqrt_scale_and_never_decreases_with_progress(
    epochs: float, scale: float, p1: float, p2: float
) -> None:
    rule = LEGWScale(epochs, 5000, 50)
    lo, hi = sorted((p1, p2))
    assert 0.0 <= rule.lr_factor(1.0, scale, lo) <= rule.lr_factor(1.0, scale, hi)
    assert rule.lr_factor(1.0, scale, hi) <= math.sqrt(scale) * (1 + 1e-12)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0.0, 2.0, 0.0), "gain must be > 0"),
        ((1.0, 0.0, 0.0), "scale must be > 0"),
        ((1.0, 2.0, -1.0), "progress must be >= 0"),
        ((math.nan, 2.0, 0.0), "gain must be finite"),
    ],
)
@pytest.mark.parametrize(
    "rule",
    ALL_RULES,
    ids=[rule.name for rule in ALL_RULES],
)
def test_rules_reject_bad_input(rule: ScalingRule, args: tuple[float, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        rule.lr_factor(*args)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((-1.0, 10, 1), "base_warmup_epochs must be >= 0"),
        ((1.0, 0, 1), "data_size must be >= 1"),
        ((1.0, 10, 0), "init_batch_size must be >= 1"),
        ((1.0, 10.5, 1), "data_size must be an int"),
    ],
)
def test_legw_rejects_bad_configuration(args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LEGWScale(*args)


@given(st.floats(0.0, 1e6), st.floats(1e-3, 1e3), st.floats(0.0, 1e6))
def test_a_given_factor_is_applied_as_given(factor, scale, progress):
    """A user's own rule (issue 38): the adapter computes the factor, core applies it."""
    rule = GivenFactor(factor)
    assert isinstance(rule, ScalingRule) and rule.name == "given"
    assert rule.lr_factor(adascale_gain(1.0, 1.0, scale), scale, progress) == factor


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan, "2", None])
def test_a_given_factor_must_be_a_finite_real_at_least_zero(bad):
    with pytest.raises(ValueError, match="factor"):
        GivenFactor(bad)
