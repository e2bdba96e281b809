"""Argument checks that fail with a message naming the argument, value and range."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]

# Plain numbers that a check may accept without building an array (booleans excluded).
_NUMBER_TYPES = (int, float, np.integer, np.floating)


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type.

    Both a TypeError and a ValueError, so that callers documented to raise
    ValueError for any invalid argument (the seed API does) keep that contract.
    """


def check_int(name: str, value: Any, *, min: int | None = None, max: int | None = None) -> int:
    """Return ``value`` as an int, or raise naming ``name``, the value and the range.

    Booleans are rejected: ``True`` is not a batch size.
    """
    if type(value) is int:  # the common case, without the costlier ABC check
        result = value
    elif isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    else:
        result = int(value)
    _check_range(name, result, min, max)
    return result


def check_bool(name: str, value: Any) -> bool:
    """Return ``value`` if it is a ``bool``, else raise naming ``name``; 0 and 1 are not."""
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


def check_flag(name: str, value: Any) -> bool:
    """`check_bool` that also takes a numpy bool (a mask's element), as a ``bool``."""
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return bool(value)


def check_seed(value: Any) -> int:
    """A shuffle seed: an int >= 0 (an attrs converter)."""
    return check_int("seed", value, min=0)


def check_epoch(value: Any) -> int:
    """An epoch number: an int >= 0 (an attrs converter)."""
    return check_int("epoch", value, min=0)


#: An attrs validator: ``(instance, attribute, value) -> None``, raising on a bad value.
Validator = Callable[[Any, Any, Any], None]


def int_in(*, min: int | None = None, max: int | None = None) -> Validator:
    """An attrs validator that applies `check_int` to the field, named by the field."""

    def check(instance: Any, attribute: Any, value: Any) -> None:
        check_int(attribute.name, value, min=min, max=max)

    return check


def float_in(
    *, min: float | None = None, max: float | None = None, min_exclusive: bool = False
) -> Validator:
    """An attrs validator that applies `check_float` to the field, named by the field."""

    def check(instance: Any, attribute: Any, value: Any) -> None:
        check_float(attribute.name, value, min=min, max=max, min_exclusive=min_exclusive)

    return check


def check_float(
    name: str,
    value: Any,
    *,
    min: float | None = None,
    max: float | None = None,
    min_exclusive: bool = False,
    max_exclusive: bool = False,
) -> float:
    """Return ``value`` as a finite float, or raise naming ``name``, the value and the range
    (``min_exclusive``/``max_exclusive``: an open end)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(
            f"{name} must be a real number, got {value!r} ({type(value).__name__})"
        )
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{name} must be finite, got {result!r}")
    _check_range(name, result, min, max, min_exclusive, max_exclusive)
    return result


def _check_range(
    name: str,
    value: float,
    lo: float | None,
    hi: float | None,
    lo_open: bool = False,
    hi_open: bool = False,
) -> None:
    below = lo is not None and (value <= lo if lo_open else value < lo)
    above = hi is not None and (value >= hi if hi_open else value > hi)
    if not (below or above):
        return
    if lo is not None and hi is not None:
        allowed = f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    elif lo is not None:
        allowed = f"{'>' if lo_open else '>='} {lo}"
    else:
        allowed = f"{'<' if hi_open else '<='} {hi}"
    raise ValueError(f"{name} must be {allowed}, got {value!r}")


def as_real_array(
    name: str, value: Any, *, expected: str = "a real number or an array of them"
) -> FloatArray:
    """Return ``value`` as a float64 array, or raise ArgumentTypeError naming ``name``.

    Integer and floating dtypes pass; booleans, strings, objects and ragged nested
    sequences do not. ``expected`` is what the message says the argument must be.
    """
    try:
        array = np.asarray(value)
    except Exception as exc:  # ragged nested sequences and the like
        raise ArgumentTypeError(f"{name} must be {expected}: {exc}") from None
    if array.dtype == np.bool_ or not (
        np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.floating)
    ):
        raise ArgumentTypeError(f"{name} must be {expected}, got dtype {array.dtype}")
    return array.astype(np.float64, copy=False)


def check_reals(
    name: str, value: Any, *, min: float, exclusive: bool = False, integer: bool = False
) -> float | FloatArray:
    """Return ``value`` checked: finite, ``>= min`` (``> min`` if ``exclusive``), whole if
    ``integer``; raise naming ``name`` and the first bad value.

    A plain number or a 0-d array comes back as a float, anything else as a float64
    array, so that one configuration can take the fast float path of its caller.
    """
    if isinstance(value, _NUMBER_TYPES) and not isinstance(value, (bool, np.bool_)):
        # Fast accept; a number that fails goes through the array checks for the message.
        number = float(value)
        if (
            math.isfinite(number)
            and (number > min if exclusive else number >= min)
            and (not integer or number == math.floor(number))
        ):
            return number
    array = as_real_array(name, value)
    bad = ~np.isfinite(array)
    if bad.any():
        raise ValueError(f"{name} must be finite, got {_first(array, bad)}")
    bad = array <= min if exclusive else array < min
    if bad.any():
        raise ValueError(
            f"{name} must be {'>' if exclusive else '>='} {min}, got {_first(array, bad)}"
        )
    if integer:
        bad = array != np.floor(array)
        if bad.any():
            raise ValueError(f"{name} must be whole numbers, got {_first(array, bad)}")
    return float(array) if array.ndim == 0 else array


def _first(array: FloatArray, bad: npt.NDArray[np.bool_]) -> str:
    return repr(array[bad].flat[0].item())


def check_keys(name: str, value: Any, keys: Iterable[str]) -> Mapping[str, Any]:
    """Return ``value`` if it is a mapping with exactly ``keys``, else raise naming ``name``
    and the missing and unexpected keys."""
    if not isinstance(value, Mapping):
        raise ArgumentTypeError(f"{name} must be a mapping, got {type(value).__name__}")
    wanted = list(keys)
    missing = [k for k in wanted if k not in value]
    extra = sorted(str(k) for k in value if k not in wanted)
    if missing or extra:
        raise ValueError(
            f"{name} needs exactly the keys {wanted}; missing {missing}, unexpected {extra}"
        )
    return value


def check_state(name: str, data: Any, schema: str, keys: Iterable[str]) -> Mapping[str, Any]:
    """Check a versioned JSON state: a mapping tagged ``schema`` with exactly ``keys``
    (``name`` names it in the message about keys); return it."""
    if not isinstance(data, Mapping):
        raise ArgumentTypeError(f"data must be a mapping, got {type(data).__name__}")
    if data.get("schema") != schema:
        raise ValueError(f"schema must be {schema!r}, got {data.get('schema')!r}")
    return check_keys(name, data, keys)
