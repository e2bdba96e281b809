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
    ``alpha_o`` (>= 0, last, default 0) is the optimiser step's own fixed cost, paid
    once per step however many micro-batches it accumulates; 0 is the model without
    it, and a mapping or sequence without it (written before it existed) means 0.
    """

    alpha_c: float
    beta_c: float
    alpha_n: float
    beta_n: float
    alpha_r: float
    beta_r: float
    gamma: float
    alpha_o: float = 0.0

    FIELDS: ClassVar[tuple[str, ...]] = (
        "alpha_c",
        "beta_c",
        "alpha_n",
        "beta_n",
        "alpha_r",
        "beta_r",
        "gamma",
        "alpha_o",
    )
    #: The fields before ``alpha_o``: what documents written before it hold.
    FIELDS_V1: ClassVar[tuple[str, ...]] = FIELDS[:7]

    def __attrs_post_init__(self) -> None:
        for name in (*self.FIELDS[:6], "alpha_o"):
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
        """Build from a mapping with exactly the keys of :meth:`to_dict`, or with those
        but ``alpha_o`` (a document written before it: 0)."""
        old = isinstance(data, Mapping) and "alpha_o" not in data
        names = cls.FIELDS_V1 if old else cls.FIELDS
        return cls(**_from_mapping("PerfParams", names, data))

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
    # PerfParams also takes its values before alpha_o (the original's seven).
    lengths = {len(fields), len(getattr(cls, "FIELDS_V1", fields))}
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ArgumentTypeError(
            f"{name} must be a {cls.__name__}, a mapping or a sequence of its "
            f"{len(fields)} values, got {value!r}"
        )
    if len(value) not in lengths:
        counts = " or ".join(str(n) for n in sorted(lengths))
        raise ValueError(
            f"{name} must have {counts} values ({', '.join(fields)}), got {len(value)}: {value!r}"
        )
    return cls(*value)


def to_perf_params(value: PerfParams | Sequence[float] | Mapping[str, Any]) -> PerfParams:
    """Return ``value`` as :class:`PerfParams`: itself, a mapping as from ``to_dict``, or
    a sequence of its values in field order (the first seven: ``alpha_o`` is 0)."""
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
