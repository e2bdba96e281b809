"""The throughput and efficiency model, on one configuration or on arrays of them.

Throughput, all times in seconds:

* one accumulation (compute) micro-batch: ``T_c = alpha_c + beta_c * atomic_bsz``;
* gradient synchronisation: ``T_n = 0`` for one replica, else
  ``alpha_r + beta_r * max(replicas - 2, 0)`` inside one node and
  ``alpha_n + beta_n * max(replicas - 2, 0)`` across nodes (optionally with the
  count held at a largest one past which the model has not been measured:
  `GoodputFunction.network_flat_beyond`);
* the optimiser micro-batch, whose backward pass overlaps synchronisation, then
  the optimiser step itself: ``T_o = (T_c ** gamma + T_n ** gamma) ** (1 / gamma)
  + alpha_o``, ``gamma`` in [1, 10], at every number of replicas. ``alpha_o`` is
  what a step costs once however many micro-batches it accumulates (``optimizer.step``,
  ``zero_grad``, the adaptive step's own work); with it, accumulation can pay on one
  replica too (without it, ``T_n = 0`` there and ``k`` accumulation steps give
  exactly the samples per second of none). ``alpha_o = 0`` is the model without it;
  the fit identifies it only from measured accumulation micro-batches
  (:func:`~adaptdl.core.goodput.fit.fit_perf_params`);
* a step with ``k`` accumulation steps runs ``k`` micro-batches that only
  accumulate, then the optimiser one: ``k * T_c + T_o`` for
  ``replicas * atomic_bsz * (k + 1)`` samples.

Efficiency: with gradient statistics measured at the initial batch size ``M0``
(``sqr``, the squared norm of the true gradient, and ``var``, the variance of a
gradient estimate at batch size ``M0``), the gradient noise scale is
``B_noise = M0 * var / sqr`` samples, and a total batch size ``M >= M0`` has
efficiency ``(B_noise + M0) / (B_noise + M) = (var + sqr) / (var + sqr * M / M0)``,
computed as the AdaScale gain ratio over the scale ``M / M0`` (`gain_ratio`, the
one definition; the steps' gain, `adaptdl.core.stats.scaling.adascale_gain`, is it).
It is 1 at ``M0``, non-increasing, and taken as 1 below ``M0`` (a smaller batch is
not credited with more progress per sample than the initial one). Limits:
``sqr = 0 < var`` (pure noise) gives 1 everywhere, ``var = 0`` gives ``M0 / M``
(no noise: a larger batch makes no more progress per step), and so does
``sqr = var = 0`` (no information: assume nothing is gained by scaling).

Every formula is written once against a small math backend: :data:`FLOATS` runs it
on Python floats (one configuration, a few microseconds), :data:`ARRAYS` on numpy
arrays that broadcast (many configurations at once).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from typing import Any, Protocol

import attrs
import numpy as np
import numpy.typing as npt

from adaptdl.core.goodput.params import GradParams, PerfParams
from adaptdl.core.validate import FloatArray, check_reals

__all__ = ["compute_time", "optim_step_time"]


class Math(Protocol):
    """What the model's formulas call: :data:`FLOATS` or :data:`ARRAYS`.

    Values are Python floats and bools, or numpy arrays that broadcast; the
    functions act elementwise, ``where`` selects, ``any`` asks whether any holds.
    """

    def exp(self, x: Any, /) -> Any: ...
    def log(self, x: Any, /) -> Any: ...
    def log1p(self, x: Any, /) -> Any: ...
    def expm1(self, x: Any, /) -> Any: ...
    def abs(self, x: Any, /) -> Any: ...
    def maximum(self, a: Any, b: Any, /) -> Any: ...
    def minimum(self, a: Any, b: Any, /) -> Any: ...
    def floor(self, x: Any, /) -> Any: ...
    def clip(self, x: Any, lo: Any, hi: Any, /) -> Any: ...
    def where(self, cond: Any, a: Any, b: Any, /) -> Any: ...
    def any(self, x: Any, /) -> Any: ...
    def indices(self, mask: Any, /) -> Iterable[int]: ...
    def item(self, x: Any, i: int, /) -> float: ...
    def put(self, x: Any, i: int, value: float, /) -> Any: ...
    def distinct_open(self, x: Any, done: Any, /) -> Iterable[float]: ...
    def quiet(self) -> contextlib.AbstractContextManager[Any]: ...


_NOTHING = contextlib.nullcontext()  # stateless, so one serves every call


class _Floats:
    """The functions the model needs, on Python floats: one configuration, no numpy
    call overhead. ``exp`` and ``log`` give inf and -inf where math would raise."""

    # (Defaults bind the math functions: these run thousands of times per search.)
    @staticmethod
    def exp(x: float, _exp: Any = math.exp, _inf: float = math.inf) -> float:
        return _exp(x) if x < 709.0 else _inf

    @staticmethod
    def log(x: float, _log: Any = math.log, _inf: float = math.inf) -> float:
        return _log(x) if x > 0.0 else -_inf

    log1p = staticmethod(math.log1p)
    expm1 = staticmethod(math.expm1)
    abs = staticmethod(abs)
    maximum = staticmethod(max)
    minimum = staticmethod(min)

    @staticmethod
    def floor(x: float) -> float:
        return float(math.floor(x))

    @staticmethod
    def clip(x: float, lo: float, hi: float) -> float:
        return min(max(x, lo), hi)

    @staticmethod
    def where(cond: bool, a: Any, b: Any) -> Any:
        return a if cond else b

    any = staticmethod(bool)

    @staticmethod
    def indices(mask: bool) -> list[int]:
        """The positions where ``mask`` holds: ``[0]`` or none, for one configuration."""
        return [0] if mask else []

    @staticmethod
    def item(x: float, i: int) -> float:
        return float(x)

    @staticmethod
    def put(x: float, i: int, value: float) -> float:
        return value

    @staticmethod
    def distinct_open(x: float, done: bool) -> list[float]:
        """The distinct values of ``x`` where ``done`` is false."""
        return [] if done else [x]

    @staticmethod
    def quiet() -> contextlib.AbstractContextManager[Any]:
        return _NOTHING


class _Arrays:
    """The same functions on numpy arrays that broadcast (floats mix in)."""

    exp = staticmethod(np.exp)
    log = staticmethod(np.log)
    log1p = staticmethod(np.log1p)
    expm1 = staticmethod(np.expm1)
    abs = staticmethod(np.abs)
    maximum = staticmethod(np.maximum)
    minimum = staticmethod(np.minimum)
    floor = staticmethod(np.floor)
    where = staticmethod(np.where)
    any = staticmethod(np.any)

    @staticmethod
    def clip(x: Any, lo: Any, hi: Any) -> Any:
        return np.minimum(np.maximum(x, lo), hi)  # np.clip costs more per call

    @staticmethod
    def indices(mask: Any) -> Iterable[int]:
        return [int(i) for i in np.flatnonzero(mask)]

    @staticmethod
    def item(x: Any, i: int) -> float:
        return float(x[i]) if isinstance(x, np.ndarray) else float(x)

    @staticmethod
    def put(x: FloatArray, i: int, value: float) -> FloatArray:
        x[i] = value
        return x

    @staticmethod
    def distinct_open(x: FloatArray, done: npt.NDArray[np.bool_]) -> Iterable[float]:
        return [float(v) for v in np.unique(x[~done])]

    @staticmethod
    def quiet() -> contextlib.AbstractContextManager[Any]:
        # inf and nan are expected on the way (no network time, no noise); the
        # formulas handle them.
        return np.errstate(divide="ignore", invalid="ignore", over="ignore")


FLOATS: Math = _Floats()
ARRAYS: Math = _Arrays()


def backend(*values: Any) -> Math:
    """:data:`ARRAYS` if any value is a numpy array, else :data:`FLOATS`."""
    for value in values:
        if isinstance(value, np.ndarray):
            return ARRAYS
    return FLOATS


def log_optim_time(m: Math, log_compute: Any, log_network: Any, gamma: float) -> tuple[Any, Any]:
    """Return ``log T_o`` and ``z = gamma * (log T_n - log T_c)`` (``-inf`` if no network).

    ``log_compute`` must be finite.
    """
    z = gamma * (log_network - log_compute)
    # softplus(z) = log(1 + e^z), computed without overflow.
    softplus = m.maximum(z, 0.0) + m.log1p(m.exp(-m.abs(z)))
    return log_compute + softplus / gamma, z


def log_network_time(
    m: Math, p: PerfParams, nodes: Any, replicas: Any, flat_beyond: int | None = None
) -> Any:
    """``log T_n``: ``-inf`` for one replica (nothing to synchronise). With
    ``flat_beyond``, the per-replica terms stop growing past that many replicas."""
    extra = m.maximum(replicas - 2.0, 0.0)
    if flat_beyond is not None:
        extra = m.minimum(extra, max(flat_beyond - 2.0, 0.0))
    net = m.where(nodes > 1, p.alpha_n + p.beta_n * extra, p.alpha_r + p.beta_r * extra)
    return m.log(m.where(replicas > 1, net, 0.0))


def gain_ratio(m: Math, sqr: Any, var: Any, scale: Any) -> Any:
    """The AdaScale gain ratio of a batch ``scale`` times the initial one: ``(var + sqr)
    / (var / scale + sqr)``, the initial-batch steps one step of it is worth, within
    its exact bounds ``[min(1, scale), max(1, scale)]``. The statistical efficiency
    is this over ``scale`` (Pollux's ``E = r M0 / M``): its one definition, which
    `efficiency` and `adaptdl.core.stats.scaling.adascale_gain` both take.

    Any ``scale > 0``; ``sqr, var >= 0``, not both 0 (`effective_grad`). Written in
    this form, the gain without noise (``var = 0``) is exactly 1 and the efficiency
    never exceeds 1.
    """
    gain = (var + sqr) / (var / scale + sqr)
    # Keep rounding from stepping outside the exact bounds.
    return m.clip(gain, m.minimum(scale, 1.0), m.maximum(scale, 1.0))


def efficiency(m: Math, sqr: float, var: float, init_batch_size: float, batch_size: Any) -> Any:
    """Statistical efficiency of a total batch size (see the module docstring): the gain
    ratio over the scale, a batch below the initial one counted as the initial one."""
    scale = m.maximum(batch_size, init_batch_size) / init_batch_size
    return gain_ratio(m, sqr, var, scale) / scale


def effective_grad(grad: GradParams) -> tuple[float, float]:
    """The (sqr, var) the model uses: both zero (no information) counts as no noise."""
    # Without any gradient information assume no noise: a larger batch makes no
    # more progress per step than the initial one, efficiency M0 / M.
    if grad.sqr == 0.0 and grad.var == 0.0:
        return 1.0, 0.0
    return grad.sqr, grad.var


@attrs.frozen
class Problem:
    """The model of one job at given configurations (floats, or arrays that broadcast
    against candidate batch sizes), with the math backend ``m`` that fits them."""

    m: Math
    p: PerfParams
    sqr: float
    var: float
    m0: float
    replicas: Any
    log_network: Any
    # log(sqr) - log(M0 var): -inf without signal, +inf without noise.
    log_sqr_minus_m0var: float

    def row(self, i: int) -> Problem:
        """The problem of configuration ``i`` alone, on floats that broadcast with arrays."""
        return attrs.evolve(
            self,
            m=ARRAYS,
            replicas=self.m.item(self.replicas, i),
            log_network=self.m.item(self.log_network, i),
        )

    def parts(self, b: Any, u: Any) -> tuple[Any, Any, Any, Any]:
        """Return step time S, T_c, log of T_o's overlapped part (without ``alpha_o``)
        and z at atomic size b with u micro-batches."""
        p, m = self.p, self.m
        compute = p.alpha_c + p.beta_c * b
        log_optim, z = log_optim_time(m, m.log(compute), self.log_network, p.gamma)
        step = (u - 1.0) * compute + m.exp(log_optim) + p.alpha_o
        return step, compute, log_optim, z

    def throughput(self, b: Any, u: Any) -> Any:
        """Samples per second at atomic size b with u micro-batches."""
        return self.replicas * b * u / self.parts(b, u)[0]

    def goodput(self, b: Any, u: Any) -> Any:
        """Throughput times the efficiency of the total batch size."""
        step = self.parts(b, u)[0]
        total = self.replicas * b * u
        return total / step * efficiency(self.m, self.sqr, self.var, self.m0, total)

    def psi(self, x: Any, u: Any) -> tuple[Any, Any]:
        """Return psi and d psi / dx at b = e^x, for the region total >= M0.

        psi is increasing in x, negative where goodput grows with b and zero at its
        maximum: psi = log(sqr R u b^2 S') - log(M0 var (S - b S')).
        """
        p, m = self.p, self.m
        b = m.exp(x)
        compute = p.alpha_c + p.beta_c * b
        log_c = m.log(compute)
        log_optim, z = log_optim_time(m, log_c, self.log_network, p.gamma)
        optim = m.exp(log_optim)
        log_r = log_c - log_optim  # r = T_c / T_o in (0, 1]
        w = m.exp((p.gamma - 1.0) * log_r)  # dT_o/dT_c = r^(gamma - 1)
        net_share = 1.0 / (1.0 + m.exp(-z))  # 1 - r^gamma = T_n^gamma / T_o^gamma
        d1 = p.beta_c * (u - 1.0 + w)  # S'
        # S - b S' > 0 (floored: it vanishes with alpha_c = 0 on one replica).
        # (The optimiser step's fixed cost alpha_o adds to S, not to S'.)
        rest = m.maximum(
            (u - 1.0) * p.alpha_c + p.alpha_c * w + optim * net_share + p.alpha_o, 1e-300
        )
        # S'' = beta_c^2 (gamma - 1) r^(gamma - 2) net_share / T_o, and r^(gamma - 2) / T_o
        # = w / T_c: one exponential fewer.
        d2 = p.beta_c**2 * (p.gamma - 1.0) * w * net_share / compute
        psi = self.log_sqr_minus_m0var + m.log(self.replicas * u * d1 / rest) + 2.0 * x
        dpsi = 2.0 + b * d2 * (b / rest + 1.0 / d1)
        return psi, dpsi


def make_problem(
    p: PerfParams,
    grad: GradParams,
    m0: int,
    nodes: Any,
    replicas: Any,
    m: Math | None = None,
    flat_beyond: int | None = None,
) -> Problem:
    """The :class:`Problem` of a job at (nodes, replicas), floats or arrays; ``m`` is
    the backend of the values it will meet (default: that of nodes and replicas);
    ``flat_beyond`` as in :func:`log_network_time`."""
    if m is None:
        m = backend(nodes, replicas)
    sqr, var = effective_grad(grad)
    if sqr == 0.0:
        log_ratio = -math.inf
    elif var == 0.0:
        log_ratio = math.inf
    else:
        log_ratio = math.log(sqr) - math.log(m0 * var)
    with m.quiet():
        log_network = log_network_time(m, p, nodes, replicas, flat_beyond)
    return Problem(
        m=m,
        p=p,
        sqr=sqr,
        var=var,
        m0=float(m0),
        replicas=replicas,
        log_network=log_network,
        log_sqr_minus_m0var=log_ratio,
    )


# ---------------------------------------------------------------------------
# Arguments


def check_topology(m: Math, nodes: Any, replicas: Any) -> None:
    """Raise unless every node runs a replica (``nodes <= replicas``)."""
    if m.any(nodes > replicas):
        pair = np.broadcast_arrays(nodes, replicas)
        idx = np.flatnonzero(pair[0] > pair[1])[0]
        raise ValueError(
            "num_nodes must be <= num_replicas (every node runs a replica), got "
            f"num_nodes={pair[0].flat[idx]:g} with num_replicas={pair[1].flat[idx]:g}"
        )


def check_placement(num_nodes: Any, num_replicas: Any) -> tuple[Any, Any]:
    """Checked (nodes, replicas): whole numbers >= 1, floats or float arrays."""
    nodes = check_reals("num_nodes", num_nodes, min=1.0, integer=True)
    replicas = check_reals("num_replicas", num_replicas, min=1.0, integer=True)
    check_topology(backend(nodes, replicas), nodes, replicas)
    return nodes, replicas


def check_config(
    num_nodes: Any, num_replicas: Any, atomic_bsz: Any, accum_steps: Any
) -> tuple[Any, Any, Any, Any]:
    """Checked (nodes, replicas, atomic_bsz, micro-batches = accum_steps + 1)."""
    nodes, replicas = check_placement(num_nodes, num_replicas)
    bsz = check_reals("atomic_bsz", atomic_bsz, min=0.0, exclusive=True)
    accum = check_reals("accum_steps", accum_steps, min=0.0, integer=True)
    return nodes, replicas, bsz, accum + 1.0


# ---------------------------------------------------------------------------
# The model's times, for callers that simulate a job


def compute_time(perf_params: PerfParams, atomic_bsz: Any) -> Any:
    """Compute time ``T_c`` of one micro-batch of ``atomic_bsz`` samples, in seconds.

    A float for plain numbers, else a float64 array.
    """
    bsz = check_reals("atomic_bsz", atomic_bsz, min=0.0, exclusive=True)
    return perf_params.alpha_c + perf_params.beta_c * bsz


def optim_step_time(
    perf_params: PerfParams, num_nodes: Any, num_replicas: Any, atomic_bsz: Any
) -> Any:
    """Time ``T_o`` of the micro-batch that ends in the optimiser step, in seconds.

    ``T_c`` and ``T_n`` combined by the ``gamma``-norm, plus the optimiser step's
    ``alpha_o``; a float for plain numbers, else a float64 array broadcast from the
    arguments.
    """
    nodes, replicas = check_placement(num_nodes, num_replicas)
    bsz = check_reals("atomic_bsz", atomic_bsz, min=0.0, exclusive=True)
    m = backend(nodes, replicas, bsz)
    p = perf_params
    with m.quiet():
        log_network = log_network_time(m, p, nodes, replicas)
        log_optim, _ = log_optim_time(m, m.log(p.alpha_c + p.beta_c * bsz), log_network, p.gamma)
        return m.exp(log_optim) + p.alpha_o
