"""Argument checks that fail with a message naming the argument, value and range."""

from __future__ import annotations

import math
import numbers
from typing import Any


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type.

    Both a TypeError and a ValueError, so that callers documented to raise
    ValueError for any invalid argument (the seed API does) keep that contract.
    """


def check_int(name: str, value: Any, *, min: int | None = None, max: int | None = None) -> int:
    """Return ``value`` as an int, or raise naming ``name``, the value and the range.

    Booleans are rejected: ``True`` is not a batch size.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    result = int(value)
    _check_range(name, result, min, max)
    return result


def check_float(
    name: str,
    value: Any,
    *,
    min: float | None = None,
    max: float | None = None,
    min_exclusive: bool = False,
) -> float:
    """Return ``value`` as a finite float, or raise naming ``name``, the value and the range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(
            f"{name} must be a real number, got {value!r} ({type(value).__name__})"
        )
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{name} must be finite, got {result!r}")
    if min_exclusive and min is not None and result <= min:
        raise ValueError(f"{name} must be > {min}, got {result!r}")
    _check_range(name, result, min, max)
    return result


def _check_range(name: str, value: float, lo: float | None, hi: float | None) -> None:
    if lo is not None and value < lo:
        allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    if hi is not None and value > hi:
        allowed = f"<= {hi}" if lo is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
