"""The shared argument checks of adaptdl.core.validate."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from adaptdl.core.validate import (
    ArgumentTypeError,
    as_real_array,
    check_bool,
    check_keys,
    check_reals,
    check_seed,
    check_state,
)


@given(st.one_of(st.integers(-5, 5), st.floats(allow_nan=True, allow_infinity=True)))
def test_check_reals_says_the_same_of_a_number_and_of_an_array_holding_it(value: Any) -> None:
    # Numbers take a fast path; what it accepts and the message it raises must be
    # those of the array checks.
    kwargs: dict[str, Any] = {"min": 0.0, "integer": True}
    try:
        one = check_reals("x", value, **kwargs)
    except ValueError as exc:
        with pytest.raises(ValueError) as many:
            check_reals("x", [value], **kwargs)
        assert str(many.value) == str(exc)
    else:
        assert type(one) is float
        assert check_reals("x", [value], **kwargs).tolist() == [one]


def test_check_reals_gives_floats_for_numbers_and_zero_d_arrays() -> None:
    for value in (3, 3.0, np.int64(3), np.float32(3.0), np.array(3)):
        assert type(check_reals("x", value, min=1.0)) is float
    array = check_reals("x", [[1, 2]], min=1.0)
    assert isinstance(array, np.ndarray) and array.dtype == np.float64 and array.shape == (1, 2)


@pytest.mark.parametrize(
    ("value", "kwargs", "error", "match"),
    [
        (math.inf, {}, ValueError, "x must be finite, got inf"),
        ([1.0, -2.0], {}, ValueError, r"x must be >= 0.0, got -2.0"),
        (0, {"exclusive": True}, ValueError, r"x must be > 0.0, got 0.0"),
        ([1, 2.5], {"integer": True}, ValueError, "x must be whole numbers, got 2.5"),
        (True, {}, ArgumentTypeError, "x must be a real number or an array of them"),
        ("3", {}, ArgumentTypeError, "got dtype <U1"),
        ([[1], [1, 2]], {}, ArgumentTypeError, "x must be a real number"),
    ],
)
def test_check_reals_names_the_argument_and_the_first_bad_value(
    value: Any, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        check_reals("x", value, min=0.0, **kwargs)


def test_as_real_array_says_what_was_expected() -> None:
    with pytest.raises(ArgumentTypeError, match="g must be an array of real numbers"):
        as_real_array("g", [True], expected="an array of real numbers")


def test_check_keys_and_state_name_missing_and_unexpected_keys() -> None:
    assert check_keys("thing", {"a": 1, "b": 2}, ("a", "b")) == {"a": 1, "b": 2}
    with pytest.raises(ValueError, match=r"thing needs exactly the keys \['a', 'b'\]; "):
        check_keys("thing", {"a": 1, "c": 3}, ("a", "b"))
    with pytest.raises(ValueError, match=r"missing \['b'\], unexpected \['c'\]"):
        check_keys("thing", {"a": 1, "c": 3}, ("a", "b"))
    with pytest.raises(ArgumentTypeError, match="thing must be a mapping, got list"):
        check_keys("thing", [], ("a",))
    doc = {"schema": "s/1", "a": 1}
    assert check_state("state", doc, "s/1", ("schema", "a")) == doc
    with pytest.raises(ValueError, match="schema must be 's/1', got 's/2'"):
        check_state("state", {**doc, "schema": "s/2"}, "s/1", ("schema", "a"))
    with pytest.raises(ArgumentTypeError, match="data must be a mapping"):
        check_state("state", None, "s/1", ("schema", "a"))


def test_check_bool_and_seed() -> None:
    assert check_bool("flag", False) is False
    with pytest.raises(ArgumentTypeError, match=r"flag must be a bool, got 1 \(int\)"):
        check_bool("flag", 1)
    assert check_seed(np.int64(7)) == 7
    with pytest.raises(ValueError, match="seed must be >= 0"):
        check_seed(-1)


def test_the_attrs_validators_name_the_field_and_its_range():
    import attrs

    from adaptdl.core.validate import float_in, int_in

    @attrs.define
    class Settings:
        count: int = attrs.field(default=1, validator=int_in(min=1, max=4))
        rate: float = attrs.field(default=0.5, validator=float_in(min=0.0, min_exclusive=True))

    assert Settings(4, 1e-9) == Settings(count=4, rate=1e-9)
    with pytest.raises(ValueError, match=r"count must be .*got 5"):
        Settings(count=5)
    with pytest.raises(ValueError, match=r"rate must be .*got 0"):
        Settings(rate=0.0)
