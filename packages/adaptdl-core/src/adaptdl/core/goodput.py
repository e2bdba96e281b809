"""The Pollux goodput model: throughput x statistical efficiency.

A job's *goodput* at a configuration (nodes, replicas, atomic batch size,
accumulation steps) is its throughput in samples per second times the
statistical efficiency of its total batch size, the progress one sample makes
relative to a sample at the initial batch size (Qiao et al., OSDI 2021).

Throughput model, all times in seconds:

* one accumulation (compute) micro-batch: ``T_c = alpha_c + beta_c * atomic_bsz``;
* gradient synchronisation: ``T_n = 0`` for one replica, else
  ``alpha_r + beta_r * max(replicas - 2, 0)`` inside one node and
  ``alpha_n + beta_n * max(replicas - 2, 0)`` across nodes;
* the optimiser micro-batch, whose backward pass overlaps synchronisation:
  ``T_o = (T_c ** gamma + T_n ** gamma) ** (1 / gamma)``, ``gamma`` in [1, 10];
* a step with ``k`` accumulation steps runs ``k`` micro-batches that only
  accumulate, then the optimiser one: ``k * T_c + T_o`` for
  ``replicas * atomic_bsz * (k + 1)`` samples.

Efficiency model: with gradient statistics measured at the initial batch size
``M0`` (``sqr``, the squared norm of the true gradient, and ``var``, the
variance of a gradient estimate at batch size ``M0``), the gradient noise scale
is ``B_noise = M0 * var / sqr`` samples, and a total batch size ``M >= M0`` has
efficiency ``(B_noise + M0) / (B_noise + M) = (var + sqr) / (var + sqr * M / M0)``.
It is 1 at ``M0``, non-increasing, and taken as 1 below ``M0`` (a smaller batch is
not credited with more progress per sample than the initial one). Limits:
``sqr = 0 < var`` (pure noise) gives 1 everywhere, ``var = 0`` gives ``M0 / M``
(no noise: a larger batch makes no more progress per step), and so does
``sqr = var = 0`` (no information: assume nothing is gained by scaling).

The optimiser (:meth:`GoodputFunction.optimize`) searches integers, never a grid.
For a fixed number ``u = accum_steps + 1`` of micro-batches, goodput is
quasiconcave in the atomic batch size ``b`` (``b`` over a convex, positive,
increasing function), so the best integer is a neighbour of the real maximiser,
found by safeguarded Newton on the stationarity condition and confirmed by a
local search: exact. Over ``u``, two facts bound the scan: for a fixed local
batch ``u * b``, fewer and larger micro-batches are never slower (triangle
inequality of the ``gamma``-norm); hence no ``u`` below ``floor(m* / bmax)``
can win (``m*`` maximises the envelope over local batch sizes), and no ``u' >= u``
can beat the best real ``b`` at ``u`` without atomic bounds. The scan stops once
that bound is no better than the best found (up to rounding): exact again.
Configurations it cannot settle in a few rounds are searched exhaustively over
``b`` (the best ``u`` for a given ``b`` has a closed form).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs
import numpy as np
import numpy.typing as npt
import scipy.optimize

from adaptdl.core._validate import ArgumentTypeError, check_float, check_int

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

#: Smallest value a fitted alpha or beta can take: the model's times stay positive.
PARAM_FLOOR = 1e-8
#: Range of the compute/communication overlap exponent.
GAMMA_RANGE = (1.0, 10.0)

# Relative margin of floating-point rounding in goodput comparisons over numbers
# of accumulation steps: the scan stops once no larger number can beat the best
# found by more, and a tie within it goes to fewer steps.
_ACCUM_TOLERANCE = 1e-12
# Numbers of accumulation steps examined per round, and rounds at most.
_ACCUM_BLOCK = 2
_ACCUM_ROUNDS = 8


def _from_mapping(cls_name: str, names: tuple[str, ...], data: Any) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise ArgumentTypeError(
            f"{cls_name}.from_dict needs a mapping, got {data!r} ({type(data).__name__})"
        )
    missing = [n for n in names if n not in data]
    extra = sorted(str(k) for k in data if k not in names)
    if missing or extra:
        raise ValueError(
            f"{cls_name}.from_dict needs exactly the keys {list(names)}; "
            f"missing {missing}, unexpected {extra}"
        )
    return {n: data[n] for n in names}


@attrs.frozen
class PerfParams:
    """Parameters of the throughput model (seconds; see the module docstring).

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


def _to_perf_params(value: PerfParams | Sequence[float] | Mapping[str, Any]) -> PerfParams:
    if isinstance(value, PerfParams):
        return value
    if isinstance(value, Mapping):
        return PerfParams.from_dict(value)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ArgumentTypeError(
            f"perf_params must be a PerfParams or a sequence of 7 numbers, got {value!r}"
        )
    if len(value) != len(PerfParams.FIELDS):
        raise ValueError(f"perf_params must have 7 values, got {len(value)}: {value!r}")
    return PerfParams(*value)


def _to_grad_params(value: GradParams | Sequence[float] | Mapping[str, Any]) -> GradParams:
    if isinstance(value, GradParams):
        return value
    if isinstance(value, Mapping):
        return GradParams.from_dict(value)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ArgumentTypeError(
            f"grad_params must be a GradParams or a sequence (sqr, var), got {value!r}"
        )
    if len(value) != 2:
        raise ValueError(f"grad_params must have 2 values (sqr, var), got {value!r}")
    return GradParams(*value)


def _check_init_batch_size(value: Any) -> int:
    return check_int("init_batch_size", value, min=1)


# ---------------------------------------------------------------------------
# Array arguments


def _as_real_array(name: str, value: Any) -> FloatArray:
    try:
        array = np.asarray(value)
    except Exception as exc:  # ragged nested sequences and the like
        raise ArgumentTypeError(f"{name} must be a number or an array of numbers: {exc}") from None
    if array.dtype == np.bool_ or not (
        np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.floating)
    ):
        raise ArgumentTypeError(
            f"{name} must be a real number or an array of them, got dtype {array.dtype}"
        )
    return array.astype(np.float64, copy=False)


def _describe_bad(array: FloatArray, bad: npt.NDArray[np.bool_]) -> str:
    return repr(array[bad].flat[0].item())


def _check_array(
    name: str, value: Any, *, min: float, integer: bool = False, exclusive: bool = False
) -> FloatArray:
    array = _as_real_array(name, value)
    bad = ~np.isfinite(array)
    if bad.any():
        raise ValueError(f"{name} must be finite, got {_describe_bad(array, bad)}")
    bad = array <= min if exclusive else array < min
    if bad.any():
        op = ">" if exclusive else ">="
        raise ValueError(f"{name} must be {op} {min}, got {_describe_bad(array, bad)}")
    if integer:
        bad = array != np.floor(array)
        if bad.any():
            raise ValueError(f"{name} must be whole numbers, got {_describe_bad(array, bad)}")
    return array


def _check_plain(
    name: str, value: Any, *, min: float, integer: bool = False, exclusive: bool = False
) -> float | None:
    """:func:`_check_array` for a plain scalar, fast; None if ``value`` is not one."""
    if isinstance(value, bool | np.bool_) or not isinstance(
        value, int | float | np.integer | np.floating
    ):
        return None
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {number!r}")
    if number <= min if exclusive else number < min:
        raise ValueError(f"{name} must be {'>' if exclusive else '>='} {min}, got {number!r}")
    if integer and number != math.floor(number):
        raise ValueError(f"{name} must be whole numbers, got {number!r}")
    return number


def _check_count(name: str, value: Any) -> float | None:
    return _check_plain(name, value, min=1.0, integer=True)


def _check_topology(nodes: FloatArray, replicas: FloatArray) -> None:
    bad = nodes > replicas
    if bad.any():
        pair = np.broadcast_arrays(nodes, replicas)
        idx = np.flatnonzero(np.broadcast_to(bad, pair[0].shape))[0]
        raise ValueError(
            "num_nodes must be <= num_replicas (every node runs a replica), got "
            f"num_nodes={pair[0].flat[idx]:g} with num_replicas={pair[1].flat[idx]:g}"
        )


def _is_scalar(*values: Any) -> bool:
    return all(np.ndim(v) == 0 for v in values)


# ---------------------------------------------------------------------------
# Model pieces, without argument checks, on float arrays that broadcast.


def _network_time(p: PerfParams, nodes: FloatArray, replicas: FloatArray) -> FloatArray:
    extra = np.maximum(replicas - 2.0, 0.0)
    inter = p.alpha_n + p.beta_n * extra
    intra = p.alpha_r + p.beta_r * extra
    net = np.where(nodes > 1, inter, intra)
    return np.where(replicas > 1, net, 0.0)


class _ArrayMath:
    """The few functions the model needs, on numpy arrays."""

    exp = staticmethod(np.exp)
    log = staticmethod(np.log)
    log1p = staticmethod(np.log1p)
    expm1 = staticmethod(np.expm1)
    abs = staticmethod(np.abs)
    maximum = staticmethod(np.maximum)
    minimum = staticmethod(np.minimum)
    floor = staticmethod(np.floor)


class _ScalarMath:
    """The same on Python floats, much faster for one configuration; never raises."""

    @staticmethod
    def exp(x: float) -> float:
        return math.exp(x) if x < 709.0 else math.inf

    @staticmethod
    def log(x: float) -> float:
        return math.log(x) if x > 0.0 else -math.inf

    log1p = staticmethod(math.log1p)
    expm1 = staticmethod(math.expm1)
    abs = staticmethod(abs)
    maximum = staticmethod(max)
    minimum = staticmethod(min)
    floor = staticmethod(math.floor)


_ARRAY_MATH = _ArrayMath()
_SCALAR_MATH = _ScalarMath()


def _log_optim_time(m: Any, log_compute: Any, log_network: Any, gamma: float) -> tuple[Any, Any]:
    """Return ``log T_o`` and ``z = gamma * (log T_n - log T_c)`` (``-inf`` if no network).

    ``m`` is ``_ARRAY_MATH`` or ``_SCALAR_MATH``; ``log_compute`` must be finite.
    """
    z = gamma * (log_network - log_compute)
    # softplus(z) = log(1 + e^z), computed without overflow.
    softplus = m.maximum(z, 0.0) + m.log1p(m.exp(-m.abs(z)))
    return log_compute + softplus / gamma, z


def _safe_log(x: FloatArray) -> FloatArray:
    with np.errstate(divide="ignore"):
        return np.log(x)


def _efficiency(m: Any, sqr: float, var: float, init_batch_size: float, batch_size: Any) -> Any:
    scale = m.maximum(batch_size, init_batch_size) / init_batch_size
    return (var + sqr) / (var + sqr * scale)


def _effective_grad(grad: GradParams) -> tuple[float, float]:
    # Without any gradient information (both zero) assume no noise: a larger batch
    # makes no more progress per step than the initial one, efficiency M0 / M.
    if grad.sqr == 0.0 and grad.var == 0.0:
        return 1.0, 0.0
    return grad.sqr, grad.var


@attrs.frozen
class _Problem:
    """Constants of the optimiser: per-configuration values (numpy arrays that broadcast
    against candidates, with ``m = _ARRAY_MATH``, or floats with ``_SCALAR_MATH``)."""

    m: Any
    p: PerfParams
    sqr: float
    var: float
    m0: float
    replicas: Any
    log_network: Any
    # log(sqr) - log(M0 var): -inf without signal, +inf without noise.
    log_sqr_minus_m0var: float

    def subset(self, rows: IntArray, ndim: int = 2) -> _Problem:
        """The same problem for some configurations, shaped to broadcast with ndim axes."""
        shape = (len(rows),) + (1,) * (ndim - 1)
        return attrs.evolve(
            self,
            replicas=self.replicas[rows].reshape(shape),
            log_network=self.log_network[rows].reshape(shape),
        )

    def parts(self, b: Any, u: Any) -> tuple[Any, Any, Any, Any]:
        """Return step time S, T_c, log T_o and z at atomic size b with u micro-batches."""
        p, m = self.p, self.m
        compute = p.alpha_c + p.beta_c * b
        log_optim, z = _log_optim_time(m, m.log(compute), self.log_network, p.gamma)
        step = (u - 1.0) * compute + m.exp(log_optim)
        return step, compute, log_optim, z

    def goodput(self, b: Any, u: Any) -> Any:
        step = self.parts(b, u)[0]
        total = self.replicas * u * b
        return total / step * _efficiency(self.m, self.sqr, self.var, self.m0, total)

    def psi(self, x: Any, u: Any) -> tuple[Any, Any]:
        """Return psi and d psi / dx at b = e^x, for the region total >= M0.

        psi is increasing in x, negative where goodput grows with b and zero at its
        maximum: psi = log(sqr R u b^2 S') - log(M0 var (S - b S')).
        """
        p, m = self.p, self.m
        b = m.exp(x)
        compute = p.alpha_c + p.beta_c * b
        log_c = m.log(compute)
        log_optim, z = _log_optim_time(m, log_c, self.log_network, p.gamma)
        optim = m.exp(log_optim)
        log_r = log_c - log_optim  # r = T_c / T_o in (0, 1]
        w = m.exp((p.gamma - 1.0) * log_r)  # dT_o/dT_c = r^(gamma - 1)
        net_share = 1.0 / (1.0 + m.exp(-z))  # 1 - r^gamma = T_n^gamma / T_o^gamma
        d1 = p.beta_c * (u - 1.0 + w)  # S'
        # S - b S' > 0 (floored: it vanishes with alpha_c = 0 on one replica).
        rest = m.maximum((u - 1.0) * p.alpha_c + p.alpha_c * w + optim * net_share, 1e-300)
        d2 = p.beta_c**2 * (p.gamma - 1.0) * m.exp((p.gamma - 2.0) * log_r) * net_share / optim
        psi = self.log_sqr_minus_m0var + m.log(self.replicas * u * d1 / rest) + 2.0 * x
        dpsi = 2.0 + b * d2 * (b / rest + 1.0 / d1)
        return psi, dpsi


def _make_problem(
    p: PerfParams, grad: GradParams, m0: int, nodes: Any, replicas: Any, *, scalar: bool = False
) -> _Problem:
    sqr, var = _effective_grad(grad)
    if sqr == 0.0:
        log_ratio = -math.inf
    elif var == 0.0:
        log_ratio = math.inf
    else:
        log_ratio = math.log(sqr) - math.log(m0 * var)
    if scalar:
        extra = max(replicas - 2.0, 0.0)
        if replicas == 1:
            log_network: Any = -math.inf
        elif nodes > 1:
            log_network = _SCALAR_MATH.log(p.alpha_n + p.beta_n * extra)
        else:
            log_network = _SCALAR_MATH.log(p.alpha_r + p.beta_r * extra)
    else:
        log_network = _safe_log(_network_time(p, nodes, replicas))
    return _Problem(
        m=_SCALAR_MATH if scalar else _ARRAY_MATH,
        p=p,
        sqr=sqr,
        var=var,
        m0=float(m0),
        replicas=float(replicas) if scalar else replicas,
        log_network=log_network,
        log_sqr_minus_m0var=log_ratio,
    )


def _argmax_continuous(
    prob: _Problem, u: FloatArray, lo: FloatArray, hi: FloatArray
) -> FloatArray:
    """Return the real b in [lo, hi] (0 < lo <= hi) that maximises goodput at u micro-batches.

    Goodput is quasiconcave in b: it is b over the product of the step time (convex,
    increasing: a norm of affine functions plus an affine one) and
    ``var + sqr * max(total, M0) / M0`` (convex, non-decreasing). Its maximiser is
    the root of the increasing function psi, clipped to the range; below the kink
    total = M0 the efficiency is 1 and goodput increases with b.
    """
    kink = prob.m0 / (prob.replicas * u)
    left = np.minimum(np.maximum(lo, kink), hi)
    xl, xr = np.log(left), np.log(hi)
    # Start from the maximiser of the additive model (gamma = 1: T_o = T_c + T_n).
    p = prob.p
    with np.errstate(invalid="ignore", divide="ignore"):
        additive = u * p.alpha_c + np.exp(prob.log_network)
        x = 0.5 * (
            np.log(additive) - prob.log_sqr_minus_m0var - np.log(prob.replicas * u * u * p.beta_c)
        )
    x = np.clip(np.nan_to_num(x), xl, xr)
    values, slopes = prob.psi(np.stack([xl, xr, x]), np.broadcast_to(u, (3, *x.shape)))
    psi_l, psi_r = values[0], values[1]
    result = np.where(psi_l >= 0, xl, xr)
    inside = (psi_l < 0) & (psi_r > 0)
    if inside.any():
        # Safeguarded Newton in log space: bisect the bracket where a step leaves it.
        f, fp = values[2], slopes[2]
        lo_x, hi_x = xl, xr
        active = inside
        for _ in range(100):
            neg = f < 0
            lo_x = np.where(neg, x, lo_x)
            hi_x = np.where(neg, hi_x, x)
            step = f / fp
            x_new = x - step
            outside = (x_new < lo_x) | (x_new > hi_x)
            x_new = np.where(outside, 0.5 * (lo_x + hi_x), x_new)
            done = ((np.abs(step) < 1e-10) & ~outside) | (hi_x - lo_x < 1e-10) | (f == 0)
            x = np.where(active, x_new, x)
            active = active & ~done
            if not active.any():
                break
            f, fp = prob.psi(x, u)
        result = np.where(inside, x, result)
    return np.exp(result)


def _best_integer(
    prob: _Problem, u: FloatArray, lo: FloatArray, hi: FloatArray
) -> tuple[FloatArray, FloatArray]:
    """Return the best goodput and integer b in [lo, hi] (integers, lo <= hi) at u micro-batches.

    Exact: goodput is unimodal in b, so the best integer is a neighbour of the real
    maximiser; a local search confirms it.
    """
    centre = np.clip(np.floor(_argmax_continuous(prob, u, lo, hi)), lo, hi)
    offsets = np.array([-1.0, 0.0, 1.0, 2.0]).reshape((4,) + (1,) * centre.ndim)
    cand = np.clip(centre + offsets, lo, hi)
    values = prob.goodput(cand, u)
    best = np.argmax(values, axis=0)
    b = np.take_along_axis(cand, best[None], axis=0)[0]
    g = np.take_along_axis(values, best[None], axis=0)[0]
    # The maximum sits at an end of the window only if the real maximiser was off by
    # more than one: walk on in that direction while goodput improves.
    direction = np.where((best == 0) & (b > lo), -1.0, np.where((best == 3) & (b < hi), 1.0, 0.0))
    while direction.any():
        nxt = np.clip(b + direction, lo, hi)
        g_next = prob.goodput(nxt, u)
        better = (direction != 0) & (g_next > g)
        b = np.where(better, nxt, b)
        g = np.where(better, g_next, g)
        direction = np.where(better & (nxt > lo) & (nxt < hi), direction, 0.0)
    return g, b


def _argmax_scalar(prob: _Problem, u: float, lo: float, hi: float) -> float:
    """:func:`_argmax_continuous` for one configuration, on Python floats."""
    left = float(min(max(lo, prob.m0 / (prob.replicas * u)), hi))
    xl, xr = math.log(left), math.log(hi)
    p = prob.p
    additive = u * p.alpha_c + prob.m.exp(prob.log_network)
    guess = 0.5 * (
        math.log(additive) - prob.log_sqr_minus_m0var - math.log(prob.replicas * u * u * p.beta_c)
    )
    # Safeguarded Newton on [xl, xr]; psi is increasing, so once an end is reached
    # with psi pointing outwards, the end is the answer.
    x = min(max(guess, xl), xr)
    left_checked = right_checked = False
    for _ in range(100):
        f, fp = prob.psi(x, u)
        if f == 0.0:
            break
        if f < 0.0:
            if x >= xr:
                return hi
            xl, left_checked = x, True
        else:
            if x <= xl:
                return left
            xr, right_checked = x, True
        step = f / fp
        x_new = x - step
        if not xl <= x_new <= xr:
            # Leaving the bracket: try the end once, else bisect.
            if x_new > xr and not right_checked:
                x_new, right_checked = xr, True
            elif x_new < xl and not left_checked:
                x_new, left_checked = xl, True
            else:
                x_new = 0.5 * (xl + xr)
        elif abs(step) < 1e-10:
            x = x_new
            break
        x = x_new
        if xr - xl < 1e-10:
            break
    return math.exp(x)


def _best_integer_scalar(prob: _Problem, u: float, lo: int, hi: int) -> tuple[float, int]:
    """:func:`_best_integer` for one configuration (lo <= hi), on Python floats."""
    centre = min(max(math.floor(_argmax_scalar(prob, u, lo, hi)), lo), hi)
    best_b, best_g = centre, prob.goodput(float(centre), u)
    for direction in (-1, 1):
        b = centre + direction
        while lo <= b <= hi:
            g = prob.goodput(float(b), u)
            if not g > best_g:
                break
            best_b, best_g = b, g
            b += direction
    return best_g, best_b


def _optimize_one(
    search: _Search, nodes: float, replicas: float, accumulation: bool
) -> tuple[float, int, int]:
    """The search of :class:`_Search` for one configuration, on Python floats."""
    prob = search.prob
    r = int(replicas)
    m_max, bmin, bmax = search.m_max, search.bmin, search.bmax
    floor_total = int(search.floor_total[0])
    if r * bmin > m_max:
        return 0.0, 0, 0

    def solve(u: int) -> tuple[float, int]:
        lo = max(bmin, -(-floor_total // (r * u)))
        hi = min(bmax, m_max // (r * u))
        if lo > hi:
            return -math.inf, 0
        return _best_integer_scalar(prob, float(u), lo, hi)

    if not accumulation:
        g, b = solve(1)
        return max(g, 0.0), b, 0
    u_max = m_max // (r * bmin)
    u = _first_micro_batches(prob, float(replicas), floor_total, m_max, bmin, bmax)
    best = (-math.inf, 0, 1)
    # One number of micro-batches at a time, as many as the vectorised scan's rounds.
    for _ in range(_ACCUM_ROUNDS * _ACCUM_BLOCK):
        g, b = solve(u)
        if g > best[0] * (1.0 + _ACCUM_TOLERANCE):
            best = (g, b, u)
        u += 1
        if u > u_max:
            break
        per_step = replicas * u
        b_rel = _argmax_scalar(prob, u, max(floor_total, 1) / per_step, m_max / per_step)
        if prob.goodput(b_rel, float(u)) <= best[0] * (1.0 + _ACCUM_TOLERANCE):
            break
    else:
        fallback = search.by_atomic(0)
        if fallback[0] > best[0] * (1.0 + _ACCUM_TOLERANCE):
            best = (fallback[0], int(fallback[1]), int(fallback[2]))
    return max(best[0], 0.0), best[1], best[2] - 1


def _first_micro_batches(
    prob: _Problem, replicas: Any, floor_total: Any, m_max: int, bmin: int, bmax: int
) -> Any:
    """Micro-batches below which no configuration can win (fact 1 of the search)."""
    m = prob.m
    p = prob.p
    # Envelope at b = bmax: step time a0 + a1 * m, with a0 the time that
    # synchronisation adds to T_o and a1 the compute time per sample.
    compute = p.alpha_c + p.beta_c * bmax
    log_optim, _ = _log_optim_time(m, math.log(compute), prob.log_network, p.gamma)
    a0 = compute * m.expm1(log_optim - math.log(compute))
    a1 = compute / bmax
    if prob.sqr == 0.0:
        m_peak = math.inf + 0.0 * a0
    else:
        m_peak = (a0 * prob.var * prob.m0 / (a1 * prob.sqr * replicas)) ** 0.5
    # Below the kink at total M0 the envelope increases, unless nothing is
    # synchronised (a0 = 0): then it is flat there, and fewer steps tie.
    kink = (a0 > 0) * (prob.m0 / replicas)
    m_lo = m.maximum(m.maximum(floor_total / replicas, bmin), kink)
    m_star = m.minimum(m.maximum(m_lo, m_peak), m_max / replicas)
    first = m.floor(m_star / bmax * (1.0 - 1e-9))
    if m is _SCALAR_MATH:
        return max(1, int(first))
    return np.maximum(1, first).astype(np.int64)


def _ceil_div(a: IntArray, b: IntArray) -> IntArray:
    return -(-a // b)


def _reachable_one(r: int, m0: int, m_max: int, bmin: int, bmax: int, accumulation: bool) -> bool:
    """Whether some admissible configuration of r replicas has a total in [m0, m_max]."""
    lo, hi = -(-m0 // r), m_max // r  # range of the local batch size u * b
    if max(lo, bmin) <= min(hi, bmax):
        return True  # one micro-batch
    if not accumulation or hi < max(lo, bmin):
        return False
    # A run of bmin consecutive local batches holds a multiple of bmin.
    if hi - lo + 1 >= bmin:
        return True
    u = np.arange(2, hi // bmin + 1, dtype=np.int64)
    fits = np.maximum(bmin, _ceil_div(np.int64(lo), u)) <= np.minimum(bmax, hi // u)
    return bool(fits.any())


def _reachable(
    replicas: IntArray, m0: int, m_max: int, bmin: int, bmax: int, accumulation: bool
) -> npt.NDArray[np.bool_]:
    """Whether some admissible configuration has a total batch size in [m0, m_max]."""
    n_lo = _ceil_div(np.full_like(replicas, m0), replicas)
    n_hi = m_max // replicas
    reach = np.maximum(n_lo, bmin) <= np.minimum(n_hi, bmax)
    if accumulation:
        reach |= (n_lo <= n_hi) & (n_hi - n_lo + 1 >= bmin)
        for r in np.unique(replicas[~reach]):
            if _reachable_one(int(r), m0, m_max, bmin, bmax, accumulation):
                reach[replicas == r] = True
    return reach


@attrs.frozen
class GoodputFunction:
    """Goodput of one job: throughput (samples/s) times statistical efficiency.

    ``perf_params`` and ``grad_params`` also accept sequences in field order or
    mappings as produced by ``to_dict``. Every method broadcasts numpy arrays of
    configurations and returns Python scalars for scalar arguments.
    """

    perf_params: PerfParams = attrs.field(converter=_to_perf_params)
    grad_params: GradParams = attrs.field(converter=_to_grad_params)
    init_batch_size: int = attrs.field(converter=_check_init_batch_size)

    def __call__(
        self,
        num_nodes: npt.ArrayLike,
        num_replicas: npt.ArrayLike,
        atomic_bsz: npt.ArrayLike,
        accum_steps: npt.ArrayLike,
    ) -> Any:
        """Same as :meth:`evaluate`."""
        return self.evaluate(num_nodes, num_replicas, atomic_bsz, accum_steps)

    def evaluate(
        self,
        num_nodes: npt.ArrayLike,
        num_replicas: npt.ArrayLike,
        atomic_bsz: npt.ArrayLike,
        accum_steps: npt.ArrayLike,
    ) -> Any:
        """Return goodput = throughput x efficiency of the total batch size."""
        one = self._scalar_problem(num_nodes, num_replicas, atomic_bsz, accum_steps)
        if one is not None:
            prob, bsz_one, micro = one
            return float(prob.goodput(bsz_one, micro))
        nodes, replicas, bsz, accum = self._check_config(
            num_nodes, num_replicas, atomic_bsz, accum_steps
        )
        total = replicas * bsz * (accum + 1.0)
        value = self._throughput(nodes, replicas, bsz, accum) * self._efficiency(total)
        return _output(value, num_nodes, num_replicas, atomic_bsz, accum_steps)

    def throughput(
        self,
        num_nodes: npt.ArrayLike,
        num_replicas: npt.ArrayLike,
        atomic_bsz: npt.ArrayLike,
        accum_steps: npt.ArrayLike,
    ) -> Any:
        """Return samples per second: total batch size over ``k * T_c + T_o``."""
        one = self._scalar_problem(num_nodes, num_replicas, atomic_bsz, accum_steps)
        if one is not None:
            prob, bsz_one, micro = one
            return float(prob.replicas * micro * bsz_one / prob.parts(bsz_one, micro)[0])
        nodes, replicas, bsz, accum = self._check_config(
            num_nodes, num_replicas, atomic_bsz, accum_steps
        )
        value = self._throughput(nodes, replicas, bsz, accum)
        return _output(value, num_nodes, num_replicas, atomic_bsz, accum_steps)

    def efficiency(self, batch_size: npt.ArrayLike) -> Any:
        """Return the statistical efficiency of a total batch size, in (0, 1].

        1 at and below the initial batch size (smaller batches are not credited with
        more than one initial-batch sample's progress per sample), non-increasing above.
        """
        total = _check_array("batch_size", batch_size, min=0.0, exclusive=True)
        return _output(self._efficiency(total), batch_size)

    def optimize(
        self,
        num_nodes: npt.ArrayLike,
        num_replicas: npt.ArrayLike,
        max_batch_size: int | None = None,
        atomic_bsz_range: tuple[int | None, int | None] | None = None,
        accumulation: bool = False,
    ) -> tuple[Any, Any, Any]:
        """Return (goodput, atomic_bsz, accum_steps) of the best admissible configuration.

        Admissible: integers ``min <= atomic_bsz <= max`` for ``atomic_bsz_range =
        (min, max)`` (``None`` ends mean 1 and ``max_batch_size``), ``accum_steps``
        0 unless ``accumulation``, total batch size at most ``max_batch_size``
        (default: the initial batch size) and at least the initial batch size
        whenever some admissible configuration reaches it. Where no configuration
        is admissible (``num_replicas * min > max_batch_size``) the result is
        (0.0, 0, 0).

        The result is the exact optimum over every admissible integer pair, up to
        floating-point rounding (see the module docstring for why).
        """
        one_nodes = _check_count("num_nodes", num_nodes)
        one_replicas = _check_count("num_replicas", num_replicas)
        if one_nodes is not None and one_replicas is not None:
            nodes = np.float64(one_nodes)
            replicas = np.float64(one_replicas)
        else:
            nodes = _check_array("num_nodes", num_nodes, min=1.0, integer=True)
            replicas = _check_array("num_replicas", num_replicas, min=1.0, integer=True)
        _check_topology(nodes, replicas)
        m0 = self.init_batch_size
        m_max = m0 if max_batch_size is None else check_int("max_batch_size", max_batch_size)
        if m_max < m0:
            raise ValueError(
                f"max_batch_size must be >= init_batch_size ({m0}), got {max_batch_size!r}"
            )
        bmin, bmax = _check_bsz_range(atomic_bsz_range, m_max)
        if not isinstance(accumulation, (bool, np.bool_)):
            raise ArgumentTypeError(f"accumulation must be a bool, got {accumulation!r}")
        if one_nodes is not None and one_replicas is not None:
            return self._optimize_scalar(
                one_nodes, one_replicas, m_max, bmin, bmax, bool(accumulation)
            )
        shape = np.broadcast_shapes(nodes.shape, replicas.shape)
        nodes = np.broadcast_to(nodes, shape).ravel()
        replicas = np.broadcast_to(replicas, shape).ravel()
        goodput, bsz, accum = self._optimize(
            nodes, replicas, m_max, bmin, bmax, bool(accumulation)
        )
        return goodput.reshape(shape), bsz.reshape(shape), accum.reshape(shape)

    # -- internals ---------------------------------------------------------

    def _scalar_problem(
        self, num_nodes: Any, num_replicas: Any, atomic_bsz: Any, accum_steps: Any
    ) -> tuple[_Problem, float, float] | None:
        """For plain scalar arguments, checked: the one-configuration problem, b and u."""
        nodes = _check_count("num_nodes", num_nodes)
        replicas = _check_count("num_replicas", num_replicas)
        if nodes is None or replicas is None:
            return None
        if nodes > replicas:
            _check_topology(np.float64(nodes), np.float64(replicas))
        bsz = _check_plain("atomic_bsz", atomic_bsz, min=0.0, exclusive=True)
        accum = _check_plain("accum_steps", accum_steps, min=0.0, integer=True)
        if bsz is None or accum is None:
            return None
        prob = _make_problem(
            self.perf_params, self.grad_params, self.init_batch_size, nodes, replicas, scalar=True
        )
        return prob, bsz, accum + 1.0

    def _check_config(
        self, num_nodes: Any, num_replicas: Any, atomic_bsz: Any, accum_steps: Any
    ) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray]:
        nodes = _check_array("num_nodes", num_nodes, min=1.0, integer=True)
        replicas = _check_array("num_replicas", num_replicas, min=1.0, integer=True)
        _check_topology(nodes, replicas)
        bsz = _check_array("atomic_bsz", atomic_bsz, min=0.0, exclusive=True)
        accum = _check_array("accum_steps", accum_steps, min=0.0, integer=True)
        return nodes, replicas, bsz, accum

    def _throughput(
        self, nodes: FloatArray, replicas: FloatArray, bsz: FloatArray, accum: FloatArray
    ) -> FloatArray:
        p = self.perf_params
        compute = p.alpha_c + p.beta_c * bsz
        network = _network_time(p, nodes, replicas)
        log_optim, _ = _log_optim_time(_ARRAY_MATH, np.log(compute), _safe_log(network), p.gamma)
        step: FloatArray = accum * compute + np.exp(log_optim)
        return replicas * bsz * (accum + 1.0) / step

    def _efficiency(self, total: FloatArray) -> FloatArray:
        sqr, var = _effective_grad(self.grad_params)
        value: FloatArray = _efficiency(_ARRAY_MATH, sqr, var, float(self.init_batch_size), total)
        return value

    def _optimize_scalar(
        self, nodes: float, replicas: float, m_max: int, bmin: int, bmax: int, accumulation: bool
    ) -> tuple[float, int, int]:
        m0 = self.init_batch_size
        reach = _reachable_one(int(replicas), m0, m_max, bmin, bmax, accumulation)
        search = _Search(
            prob=_make_problem(
                self.perf_params, self.grad_params, m0, nodes, replicas, scalar=True
            ),
            r_int=np.array([int(replicas)], dtype=np.int64),
            floor_total=np.array([m0 if reach else 0], dtype=np.int64),
            m_max=m_max,
            bmin=bmin,
            bmax=bmax,
        )
        return _optimize_one(search, nodes, replicas, accumulation)

    def _optimize(
        self,
        nodes: FloatArray,
        replicas: FloatArray,
        m_max: int,
        bmin: int,
        bmax: int,
        accumulation: bool,
    ) -> tuple[FloatArray, IntArray, IntArray]:
        m0 = self.init_batch_size
        r_int = replicas.astype(np.int64)
        feasible = r_int * bmin <= m_max
        reach = _reachable(r_int, m0, m_max, bmin, bmax, accumulation)
        # Lower bound on the total batch size: the initial one where reachable.
        search = _Search(
            prob=_make_problem(self.perf_params, self.grad_params, m0, nodes, replicas),
            r_int=r_int,
            floor_total=np.where(reach, m0, 0).astype(np.int64),
            m_max=m_max,
            bmin=bmin,
            bmax=bmax,
        )
        if accumulation:
            goodput, bsz, micro = search.with_accumulation()
        else:
            goodput, bsz, micro = search.without_accumulation()
        goodput = np.where(feasible, goodput, 0.0)
        bsz_out = np.where(feasible, bsz, 0).astype(np.int64)
        accum = np.where(feasible, micro - 1, 0).astype(np.int64)
        return goodput, bsz_out, accum


def _output(value: FloatArray, *args: Any) -> Any:
    if _is_scalar(*args):
        return float(value)
    return value


def _check_bsz_range(atomic_bsz_range: Any, m_max: int) -> tuple[int, int]:
    if atomic_bsz_range is None:
        return 1, m_max
    if isinstance(atomic_bsz_range, (str, bytes)) or not isinstance(atomic_bsz_range, Sequence):
        raise ArgumentTypeError(
            f"atomic_bsz_range must be a pair (min, max) or None, got {atomic_bsz_range!r}"
        )
    if len(atomic_bsz_range) != 2:
        raise ValueError(
            f"atomic_bsz_range must be a pair (min, max), got {len(atomic_bsz_range)} values"
        )
    lo, hi = atomic_bsz_range
    bmin = 1 if lo is None else check_int("atomic_bsz_range[0]", lo, min=1)
    bmax = m_max if hi is None else check_int("atomic_bsz_range[1]", hi, min=bmin)
    return bmin, bmax


@attrs.frozen
class _Search:
    """The integer search of :meth:`GoodputFunction.optimize` over flat configurations."""

    prob: _Problem
    r_int: IntArray
    floor_total: IntArray
    m_max: int
    bmin: int
    bmax: int

    def bounds(self, u: IntArray, rows: IntArray) -> tuple[IntArray, IntArray]:
        """Integer range of the atomic batch size at u micro-batches (rows x candidates)."""
        per_step = self.r_int[rows, None] * u
        lo = np.maximum(self.bmin, _ceil_div(self.floor_total[rows, None], per_step))
        hi = np.minimum(self.bmax, self.m_max // per_step)
        return lo, hi

    def solve(self, u: IntArray, rows: IntArray) -> tuple[FloatArray, FloatArray]:
        """Best goodput (-inf if none) and atomic batch size at each u, for the given rows."""
        lo, hi = self.bounds(u, rows)
        ok = lo <= hi
        prob = self.prob.subset(rows)
        g, b = _best_integer(prob, u.astype(float), lo.astype(float), np.maximum(lo, hi))
        return np.where(ok, g, -np.inf), b

    def without_accumulation(self) -> tuple[FloatArray, FloatArray, FloatArray]:
        n = self.r_int.shape[0]
        rows = np.arange(n)
        g, b = self.solve(np.ones((n, 1), dtype=np.int64), rows)
        return g[:, 0], b[:, 0], np.ones(n)

    def with_accumulation(self) -> tuple[FloatArray, FloatArray, FloatArray]:
        # Scan u = accum_steps + 1 upwards from the first count that can win, a
        # block of counts per round, until the bound on all larger counts is no
        # better than the best found (the module docstring gives the reasons).
        prob = self.prob
        replicas = prob.replicas
        n = replicas.shape[0]
        u_max = self.m_max // (self.r_int * self.bmin)
        start = _first_micro_batches(
            prob, replicas, self.floor_total, self.m_max, self.bmin, self.bmax
        )

        best_g = np.full(n, -np.inf)
        best_b = np.zeros(n)
        best_u = np.ones(n)
        rows = np.arange(n)
        block = np.arange(_ACCUM_BLOCK, dtype=np.int64)[None, :]
        for _ in range(_ACCUM_ROUNDS):
            u = start[rows, None] + block
            g, b = self.solve(u, rows)
            g = np.where(u <= u_max[rows, None], g, -np.inf)
            top = g.max(axis=1, keepdims=True)
            j = np.argmax(g >= top - np.abs(top) * _ACCUM_TOLERANCE, axis=1)  # fewest steps
            pick = np.arange(len(rows))
            gj = g[pick, j]
            better = gj > best_g[rows] * (1.0 + _ACCUM_TOLERANCE)
            sel = rows[better]
            best_g[sel] = gj[better]
            best_b[sel] = b[pick, j][better]
            best_u[sel] = u[pick, j][better]
            # Upper bound on goodput at every u >= u_next micro-batches.
            u_next = start[rows] + _ACCUM_BLOCK
            per_step = replicas[rows] * u_next
            lo = np.maximum(self.floor_total[rows], 1) / per_step
            hi = self.m_max / per_step
            sub = prob.subset(rows, ndim=1)
            uf = u_next.astype(float)
            bound = sub.goodput(_argmax_continuous(sub, uf, lo, hi), uf)
            more = (u_next <= u_max[rows]) & (bound > best_g[rows] * (1.0 + _ACCUM_TOLERANCE))
            rows = rows[more]
            if len(rows) == 0:
                break
            start[rows] += _ACCUM_BLOCK
        else:
            # Not settled by the scan (sparse admissible pairs, nearly flat goodput):
            # search those configurations exactly, atomic batch size by batch size.
            for row in rows:
                g1, b1, u1 = self.by_atomic(int(row))
                if g1 > best_g[row] * (1.0 + _ACCUM_TOLERANCE):
                    best_g[row], best_b[row], best_u[row] = g1, b1, u1
        return np.maximum(best_g, 0.0), best_b, best_u

    def by_atomic(self, row: int) -> tuple[float, float, float]:
        """Exact best (goodput, atomic_bsz, micro-batches) of one configuration.

        For a fixed atomic batch size b, goodput is u over a convex function of the
        number u of micro-batches (step time (u - 1) T_c + T_o is affine in u), so
        the best u is a neighbour of a closed-form real maximiser.
        """
        if self.prob.m is _SCALAR_MATH:
            prob = attrs.evolve(
                self.prob,
                m=_ARRAY_MATH,
                replicas=np.array([self.prob.replicas]),
                log_network=np.array([self.prob.log_network]),
            )
        else:
            prob = self.prob.subset(np.array([row]), ndim=1)
        r = int(self.r_int[row])
        hi_b = min(self.bmax, self.m_max // r)
        b = np.arange(self.bmin, hi_b + 1, dtype=np.int64)
        if len(b) == 0:
            return -math.inf, 0.0, 1.0
        u_lo = np.maximum(1, _ceil_div(np.int64(self.floor_total[row]), r * b))
        u_hi = self.m_max // (r * b)
        bf = b.astype(float)
        step1, compute, _, _ = prob.parts(bf, np.ones_like(bf))
        extra = step1 - compute  # time synchronisation adds to the optimiser step
        with np.errstate(divide="ignore", invalid="ignore"):
            peak = np.sqrt(extra * prob.var * prob.m0 / (compute * prob.sqr * r * bf))
        peak = np.where(np.isnan(peak), np.inf, peak)
        u_real = np.clip(np.maximum(peak, prob.m0 / (r * bf)), u_lo, np.maximum(u_lo, u_hi))
        # Without synchronisation time more micro-batches never help: fewest steps.
        u_real = np.where(extra > 0, u_real, u_lo)
        cand = np.clip(np.stack([np.floor(u_real), np.ceil(u_real)]), u_lo, np.maximum(u_lo, u_hi))
        values = np.where(u_lo <= u_hi, prob.goodput(bf, cand), -np.inf)
        i, j = np.unravel_index(np.argmax(values), values.shape)
        return float(values[i, j]), float(bf[j]), float(cand[i, j])


# ---------------------------------------------------------------------------
# Fitting the throughput model to measured step times

# Weight of the pull of gamma towards 1: the alphas and betas are easier to fit
# when compute and communication add up, so prefer that unless the data disagree.
_GAMMA_PULL = 1e-3
# Prior for network parameters across nodes when no multi-node step was observed:
# crossing nodes costs at least this much more than staying within one node.
_INTER_NODE_PRIOR = 1.1
_THETA_MAX = math.log(1e6)
# Values of gamma whose least-squares starts are compared before the descent.
_GAMMA_STARTS = (1.0, 1.5, 2.5, 4.0, 7.0, 10.0)


@attrs.frozen
class _Observations:
    """Validated observations sorted into single-replica, intra-node and inter-node runs."""

    bsz: FloatArray
    log_accum: FloatArray
    log_optim: FloatArray
    n_single: int  # observations [0, n_single) have one replica: no network time
    n_intra: int  # the next n_intra synchronise within one node, the rest across nodes
    extra: FloatArray  # max(replicas - 2, 0) of the multi-replica observations

    @property
    def n(self) -> int:
        return int(self.bsz.shape[0])

    def objective(self, theta: FloatArray) -> tuple[float, FloatArray]:
        """RMS log errors of both step times plus the gamma pull, and the gradient."""
        a = np.exp(theta[:6])
        gamma = float(theta[6])
        n, k, m = self.n, self.n_single, self.n_intra
        compute = a[0] + a[1] * self.bsz
        log_c = np.log(compute)
        err1 = log_c - self.log_accum
        extra = self.extra
        network = np.concatenate([a[4] + a[5] * extra[:m], a[2] + a[3] * extra[m:]])
        log_n = np.log(network)
        log_cm = log_c[k:]
        log_o, z = _log_optim_time(_ARRAY_MATH, log_cm, log_n, gamma)
        err2 = np.concatenate([log_c[:k], log_o]) - self.log_optim
        rms1 = math.sqrt(float(err1 @ err1) / n + 1e-18)
        rms2 = math.sqrt(float(err2 @ err2) / n + 1e-18)
        value = rms1 + rms2 + _GAMMA_PULL * (gamma - 1.0) ** 2
        d1 = err1 / (n * rms1)
        d2 = err2 / (n * rms2)
        d2m = d2[k:]
        share_n = 1.0 / (1.0 + np.exp(-z))  # d log T_o / d log T_n
        dlog_c = d1 + d2
        dlog_c[k:] -= d2m * share_n
        dlog_n = d2m * share_n / network
        per_c = dlog_c / compute
        grad = np.empty(7)
        grad[0] = a[0] * float(per_c.sum())
        grad[1] = a[1] * float(per_c @ self.bsz)
        grad[2] = a[2] * float(dlog_n[m:].sum())
        grad[3] = a[3] * float(dlog_n[m:] @ extra[m:])
        grad[4] = a[4] * float(dlog_n[:m].sum())
        grad[5] = a[5] * float(dlog_n[:m] @ extra[:m])
        dgamma = ((1.0 - share_n) * log_cm + share_n * log_n - log_o) / gamma
        grad[6] = float(d2m @ dgamma) + 2.0 * _GAMMA_PULL * (gamma - 1.0)
        return value, grad


def _check_observations(
    num_nodes: Any, num_replicas: Any, atomic_bsz: Any, accum_step_time: Any, optim_step_time: Any
) -> tuple[FloatArray, ...]:
    named = {
        "num_nodes": num_nodes,
        "num_replicas": num_replicas,
        "atomic_bsz": atomic_bsz,
        "accum_step_time": accum_step_time,
        "optim_step_time": optim_step_time,
    }
    arrays: dict[str, FloatArray] = {}
    for name, value in named.items():
        array = _as_real_array(name, value)
        if array.ndim != 1:
            raise ValueError(
                f"{name} must be a 1-D sequence of observations, got shape {array.shape}"
            )
        if array.shape[0] == 0:
            raise ValueError(f"{name} must hold at least one observation, got none")
        arrays[name] = array
    lengths = {name: a.shape[0] for name, a in arrays.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"all observation arrays must have the same length, got {lengths}")
    nodes = _check_array("num_nodes", arrays["num_nodes"], min=1.0, integer=True)
    replicas = _check_array("num_replicas", arrays["num_replicas"], min=1.0, integer=True)
    _check_topology(nodes, replicas)
    bsz = _check_array("atomic_bsz", arrays["atomic_bsz"], min=0.0, exclusive=True)
    accum = _check_array("accum_step_time", arrays["accum_step_time"], min=0.0, exclusive=True)
    optim = _check_array("optim_step_time", arrays["optim_step_time"], min=0.0, exclusive=True)
    return nodes, replicas, bsz, accum, optim


def _weighted_line(x: FloatArray, y: FloatArray) -> tuple[float, float]:
    """Least-squares line y ~ a + b x in relative error, both coefficients >= the floor."""
    w = 1.0 / y
    if np.ptp(x) > 0:
        design = np.stack([w, w * x], axis=1)
        (a, b), *_ = np.linalg.lstsq(design, np.ones_like(y), rcond=None)
        if a >= PARAM_FLOOR and b >= PARAM_FLOOR:
            return float(a), float(b)
        if a < PARAM_FLOOR:  # through the origin
            wx = w * x
            return PARAM_FLOOR, max(PARAM_FLOOR, float(wx.sum() / (wx @ wx)))
    return max(PARAM_FLOOR, float(np.median(y))), PARAM_FLOOR


def fit_perf_params(
    num_nodes: npt.ArrayLike,
    num_replicas: npt.ArrayLike,
    atomic_bsz: npt.ArrayLike,
    accum_step_time: npt.ArrayLike,
    optim_step_time: npt.ArrayLike,
    *,
    initial: PerfParams | None = None,
) -> PerfParams:
    """Fit :class:`PerfParams` to observed step times (one entry per observation).

    Minimises the RMS log error of the accumulation step times against ``T_c`` plus
    that of the optimiser step times against ``T_o`` (bounded L-BFGS-B on the log
    of every alpha and beta, analytic gradient). The descent starts from whichever
    fits best of weighted least-squares starts at several values of gamma and
    ``initial`` (for example the last fit), if given. Parameters that the data
    cannot identify take priors:

    * one atomic batch size: ``alpha_c`` is fixed to half the compute time;
    * no multi-replica step within a node (across nodes): ``alpha_r`` (``alpha_n``)
      stays at the floor; likewise ``beta_r`` (``beta_n``) without more than two
      replicas there (an optimistic model, so the scheduler tries the configuration);
    * no multi-node step: afterwards ``alpha_n, beta_n >= 1.1 * (alpha_r, beta_r)``;
    * no multi-replica step at all: ``gamma = 1``.

    Runs in a few milliseconds with single-threaded BLAS; threaded OpenBLAS on a
    busy machine slows L-BFGS-B's tiny vector operations about tenfold
    (``OPENBLAS_NUM_THREADS=1`` avoids it).
    """
    nodes, replicas, bsz, accum, optim = _check_observations(
        num_nodes, num_replicas, atomic_bsz, accum_step_time, optim_step_time
    )
    group = np.where(replicas == 1, 0, np.where(nodes == 1, 1, 2))
    order = np.argsort(group, kind="stable")
    group, replicas = group[order], replicas[order]
    obs = _Observations(
        bsz=bsz[order],
        log_accum=np.log(accum[order]),
        log_optim=np.log(optim[order]),
        n_single=int(np.count_nonzero(group == 0)),
        n_intra=int(np.count_nonzero(group == 1)),
        extra=np.maximum(replicas[group > 0] - 2.0, 0.0),
    )
    intra, inter = group == 1, group == 2
    floor = math.log(PARAM_FLOOR)
    lower = np.array([floor] * 6 + [GAMMA_RANGE[0]])
    upper = np.array([_THETA_MAX] * 6 + [GAMMA_RANGE[1]])
    pinned: dict[int, float] = {}
    if np.unique(bsz).shape[0] == 1:
        pinned[0] = math.log(max(PARAM_FLOOR, float(np.exp(np.mean(obs.log_accum))) / 2))
    if not intra.any():
        pinned[4] = floor
    if not (intra & (replicas > 2)).any():
        pinned[5] = floor
    if not inter.any():
        pinned[2] = floor
    if not (inter & (replicas > 2)).any():
        pinned[3] = floor
    if obs.n_single == obs.n:
        pinned[6] = 1.0
    for i, value in pinned.items():
        lower[i] = upper[i] = value

    def to_theta(params: Sequence[float]) -> FloatArray:
        logs = [math.log(max(v, PARAM_FLOOR)) for v in params[:6]]
        theta: FloatArray = np.clip(np.array([*logs, params[6]]), lower, upper)
        for i, value in pinned.items():
            theta[i] = value
        return theta

    starts = [to_theta(start) for start in _starts(obs, pinned)]
    if initial is not None:
        starts.append(to_theta(initial.astuple()))
    # One descent, from the start that already fits best: a warm start from the
    # last fit usually wins, a poor one never does.
    theta0 = min(starts, key=lambda theta: obs.objective(theta)[0])
    best = scipy.optimize.minimize(
        obs.objective,
        theta0,
        jac=True,
        method="L-BFGS-B",
        bounds=scipy.optimize.Bounds(lower, upper),
    )
    theta = np.clip(best.x, lower, upper)
    values = [float(v) for v in np.exp(theta[:6])] + [float(theta[6])]
    if not inter.any():
        values[2] = max(values[2], _INTER_NODE_PRIOR * values[4])
        values[3] = max(values[3], _INTER_NODE_PRIOR * values[5])
    return PerfParams(*values)


def _starts(obs: _Observations, pinned: Mapping[int, float]) -> list[tuple[float, ...]]:
    """Weighted least-squares starting points of the fit, one per trial gamma."""
    accum = np.exp(obs.log_accum)
    if 0 in pinned:
        alpha_c = math.exp(pinned[0])
        beta_c = max(PARAM_FLOOR, float(np.median((accum - alpha_c) / obs.bsz)))
    else:
        alpha_c, beta_c = _weighted_line(obs.bsz, accum)
    k, m = obs.n_single, obs.n_intra
    compute = (alpha_c + beta_c * obs.bsz)[k:]
    optim = np.exp(obs.log_optim[k:])
    ratio = np.maximum(optim / compute, 1.0 + 1e-3)
    starts = []
    for gamma in _GAMMA_STARTS if k < obs.n else (1.0,):
        # The network times that explain the optimiser steps at this gamma.
        network = compute * (ratio**gamma - 1.0) ** (1.0 / gamma)
        params = [alpha_c, beta_c]
        for part in (slice(m, None), slice(0, m)):  # inter-node, then intra-node
            x, y = obs.extra[part], network[part]
            params += list(_weighted_line(x, y)) if len(y) else [PARAM_FLOOR, PARAM_FLOOR]
        starts.append((*params, gamma))
    return starts
