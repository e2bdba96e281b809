"""The parameters of the goodput model: :class:`PerfParams` and :class:`GradParams`.

Both are frozen, validated at construction and round-trip through JSON with
``to_dict`` / ``from_dict``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs

from adaptdl.core.validate import ArgumentTypeError, check_float, check_int, check_keys

#: Smallest value a fitted alpha or beta can take: the model's times stay positive.
PARAM_FLOOR = 1e-8
#: Range of the compute/communication overlap exponent.
GAMMA_RANGE = (1.0, 10.0)


def _from_mapping(cls_name: str, names: tuple[str, ...], data: Any) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise ArgumentTypeError(
            f"{cls_name}.from_dict needs a mapping, got {data!r} ({type(data).__name__})"
        )
    check_keys(f"{cls_name}.from_dict", data, names)
    return {n: data[n] for n in names}


@attrs.frozen
class PerfParams:
    """Parameters of the throughput model (seconds; see :mod:`adaptdl.core.goodput.model`).

    Every alpha and beta is finite and non-negative, ``beta_c`` is positive (the
    compute time grows with the batch size) and ``gamma`` lies in [1, 10].
    """

    alpha_c: float
    beta_c: float
    alpha_n: float
    beta_n: float
    alpha_r: float
    beta_r: float
    gamma: float

    FIELDS: ClassVar[tuple[str, ...]] = (
        "alpha_c",
        "beta_c",
        "alpha_n",
        "beta_n",
        "alpha_r",
        "beta_r",
        "gamma",
    )

    def __attrs_post_init__(self) -> None:
        for name in self.FIELDS[:-1]:
            value = check_float(name, getattr(self, name), min=0.0)
            object.__setattr__(self, name, value)
        if self.beta_c <= 0.0:
            raise ValueError(f"beta_c must be > 0, got {self.beta_c!r}")
        gamma = check_float("gamma", self.gamma, min=GAMMA_RANGE[0], max=GAMMA_RANGE[1])
        object.__setattr__(self, "gamma", gamma)

    def to_dict(self) -> dict[str, float]:
        """Return the parameters as a JSON-ready mapping of name to float."""
        return {name: float(getattr(self, name)) for name in self.FIELDS}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PerfParams:
        """Build from a mapping with exactly the keys of :meth:`to_dict`."""
        return cls(**_from_mapping("PerfParams", cls.FIELDS, data))

    def astuple(self) -> tuple[float, ...]:
        """Return the parameters in field order."""
        return tuple(float(getattr(self, name)) for name in self.FIELDS)


@attrs.frozen
class GradParams:
    """Gradient statistics at the initial batch size: ``sqr`` = |E g|^2, ``var`` = E|g - E g|^2.

    Both are finite and non-negative. Estimators can return negative values; clamp
    them before building this.
    """

    sqr: float
    var: float

    FIELDS: ClassVar[tuple[str, ...]] = ("sqr", "var")

    def __attrs_post_init__(self) -> None:
        for name in self.FIELDS:
            object.__setattr__(self, name, check_float(name, getattr(self, name), min=0.0))

    def to_dict(self) -> dict[str, float]:
        """Return the statistics as a JSON-ready mapping of name to float."""
        return {"sqr": float(self.sqr), "var": float(self.var)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GradParams:
        """Build from a mapping with exactly the keys ``sqr`` and ``var``."""
        return cls(**_from_mapping("GradParams", cls.FIELDS, data))


def _to_params(cls: Any, name: str, value: Any) -> Any:
    """``value`` as ``cls``: itself, a mapping as from ``to_dict``, or its values in
    field order; raise naming ``name``."""
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        return cls.from_dict(value)
    fields = cls.FIELDS
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ArgumentTypeError(
            f"{name} must be a {cls.__name__}, a mapping or a sequence of its "
            f"{len(fields)} values, got {value!r}"
        )
    if len(value) != len(fields):
        raise ValueError(
            f"{name} must have {len(fields)} values ({', '.join(fields)}), "
            f"got {len(value)}: {value!r}"
        )
    return cls(*value)


def to_perf_params(value: PerfParams | Sequence[float] | Mapping[str, Any]) -> PerfParams:
    """Return ``value`` as :class:`PerfParams`: itself, a mapping as from ``to_dict``, or
    a sequence of the seven values in field order."""
    params: PerfParams = _to_params(PerfParams, "perf_params", value)
    return params


def to_grad_params(value: GradParams | Sequence[float] | Mapping[str, Any]) -> GradParams:
    """Return ``value`` as :class:`GradParams`: itself, a mapping as from ``to_dict``, or
    a pair ``(sqr, var)``."""
    params: GradParams = _to_params(GradParams, "grad_params", value)
    return params


def check_init_batch_size(value: Any) -> int:
    """Return ``value`` as an int >= 1, or raise naming ``init_batch_size``."""
    return check_int("init_batch_size", value, min=1)
