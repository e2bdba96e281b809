"""The exact integer optimiser behind :meth:`GoodputFunction.optimize`.

It searches integers, never a grid. For a fixed number ``u = accum_steps + 1`` of
micro-batches, goodput is quasiconcave in the atomic batch size ``b`` (``b`` over a
convex, positive, increasing function), so the best integer is a neighbour of the
real maximiser, found by safeguarded Newton on the stationarity condition and
confirmed by a local search: exact. Over ``u``, two facts bound the scan: for a
fixed local batch ``u * b``, fewer and larger micro-batches are never slower
(triangle inequality of the ``gamma``-norm); hence no ``u`` below
``floor(m* / bmax)`` can win (``m*`` maximises the envelope over local batch
sizes), and no ``u' >= u`` can beat the best real ``b`` at ``u`` without atomic
bounds. The scan stops once that bound is no better than the best found (up to
rounding): exact again. Configurations it cannot settle in a few rounds are
searched exhaustively over ``b`` (the best ``u`` for a given ``b`` has a closed form).

Every function runs on a :class:`~adaptdl.core.goodput.model.Problem` of one
configuration (Python floats) or of many (numpy arrays), with the same code: a
condition is a ``bool`` or a boolean array, and ``m.where`` / ``m.any`` act on either.
All integers are held as floats, exact below 2**53.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import attrs
import numpy as np

from adaptdl.core.goodput.model import Problem, log_optim_time

# Relative margin of floating-point rounding in goodput comparisons over numbers
# of accumulation steps: the scan stops once no larger number can beat the best
# found by more, and a tie within it goes to fewer steps.
_ACCUM_TOLERANCE = 1e-12
# Newton stops after a step (in log b) below this: the root is then known to about
# its square, far below what moves goodput by _ACCUM_TOLERANCE (flat at its peak).
_NEWTON_STEP = 1e-5
# Numbers of accumulation steps examined at most before the exhaustive fallback.
_ACCUM_ROUNDS = 16


def _ceil_div(a: Any, b: Any) -> Any:
    return -(-a // b)


def _argmax_continuous(prob: Problem, u: Any, lo: Any, hi: Any) -> Any:
    """Return the real b in [lo, hi] (0 < lo <= hi) that maximises goodput at u micro-batches.

    Goodput is quasiconcave in b: it is b over the product of the step time (convex,
    increasing: a norm of affine functions plus an affine one) and
    ``var + sqr * max(total, M0) / M0`` (convex, non-decreasing). Its maximiser is
    the root of the increasing function psi, clipped to the range; below the kink
    total = M0 the efficiency is 1 and goodput increases with b.
    """
    m, p = prob.m, prob.p
    left = m.minimum(m.maximum(lo, prob.m0 / (prob.replicas * u)), hi)
    xl, xr = m.log(left), m.log(hi)
    # Start from the maximiser of the additive model (gamma = 1: T_o = T_c + T_n).
    additive = u * p.alpha_c + m.exp(prob.log_network) + p.alpha_o
    guess = 0.5 * (
        m.log(additive) - prob.log_sqr_minus_m0var - m.log(prob.replicas * u * u * p.beta_c)
    )
    x = m.clip(m.where(guess == guess, guess, 0.0), xl, xr)
    # Safeguarded Newton in log space on the bracket [a, c] of the root. psi
    # increases, so psi < 0 at the right end (> 0 at the left) puts the maximiser at
    # that end. A step that leaves the bracket tries its end once (psi is then
    # evaluated there, so the end becomes known), else bisects. A configuration
    # that is done needs no freezing while others go on: at an end the step points
    # outwards and lands on the end again; at its root it moves by rounding only.
    a, c = xl, xr
    a_known = c_known = x != x  # all False, in x's shape
    active = x == x
    where, any_ = m.where, m.any  # hot loop: one configuration pays per lookup
    for _ in range(100):
        f, fp = prob.psi(x, u)
        neg = f < 0
        active = active & where(neg, x < xr, x > xl)
        if not any_(active):
            break
        a, c = where(neg, x, a), where(neg, c, x)
        a_known, c_known = a_known | neg, c_known | (f > 0)
        step = f / fp
        x = x - step
        over, under = x > c, x < a
        mid = 0.5 * (a + c)
        x = where(over, where(c_known, mid, c), where(under, where(a_known, mid, a), x))
        # Go on unless a step inside the bracket was small (Newton converges
        # quadratically: x is then within ~step**2 of the root) or the bracket is.
        active = active & ((abs(step) >= _NEWTON_STEP) | over | under) & (c - a >= 1e-10)
        if not any_(active):
            break
    # Stopped at an end: that end, exactly.
    return m.where(x >= xr, hi, m.where(x <= xl, left, m.exp(x)))


def _best_integer(prob: Problem, u: Any, lo: Any, hi: Any) -> tuple[Any, Any]:
    """Return the best goodput and integer b in [lo, hi] (integers, lo <= hi) at u micro-batches.

    Exact: goodput is unimodal in b, so the best integer is a neighbour of the real
    maximiser; a local search confirms it.
    """
    m = prob.m
    centre = m.clip(m.floor(_argmax_continuous(prob, u, lo, hi)), lo, hi)
    b, g = centre, prob.goodput(centre, u)
    for direction in (1.0, -1.0):
        # Walk on while goodput improves; leftwards only where rightwards did not.
        # (Off the range goodput may be nan: never better.)
        nxt = centre + direction
        moving = (b == centre) & (nxt >= lo) & (nxt <= hi)
        while m.any(moving):
            g_next = prob.goodput(nxt, u)
            better = moving & (g_next > g)
            b, g = m.where(better, nxt, b), m.where(better, g_next, g)
            nxt = nxt + direction
            moving = better & (nxt >= lo) & (nxt <= hi)
    return g, b


def _first_micro_batches(prob: Problem, floor_total: Any, m_max: int, bmin: int, bmax: int) -> Any:
    """Micro-batches below which no configuration can win (fact 1 of the search)."""
    m, p = prob.m, prob.p
    replicas = prob.replicas
    # Envelope at b = bmax: step time a0 + a1 * m, with a0 the time that
    # synchronisation and the optimiser step add to T_c and a1 the compute time per
    # sample.
    compute = p.alpha_c + p.beta_c * bmax
    log_optim, _ = log_optim_time(m, math.log(compute), prob.log_network, p.gamma)
    a0 = compute * m.expm1(log_optim - math.log(compute)) + p.alpha_o
    a1 = compute / bmax
    if prob.sqr == 0.0:
        m_peak: Any = math.inf
    else:
        # A subnormal sqr can underflow the product to 0: the smallest normal float
        # keeps the quotient finite (0 without variance, else past any m_max).
        denominator = m.maximum(a1 * prob.sqr * replicas, sys.float_info.min)
        m_peak = (a0 * prob.var * prob.m0 / denominator) ** 0.5
    # Below the kink at total M0 the envelope increases, unless nothing is
    # synchronised (a0 = 0): then it is flat there, and fewer steps tie.
    kink = (a0 > 0) * (prob.m0 / replicas)
    m_lo = m.maximum(m.maximum(floor_total / replicas, bmin), kink)
    m_star = m.minimum(m.maximum(m_lo, m_peak), m_max / replicas)
    return m.maximum(1.0, m.floor(m_star / bmax * (1.0 - 1e-9)))


def _reachable_by_scan(r: int, m0: int, m_max: int, bmin: int, bmax: int) -> bool:
    """Whether some u >= 2 micro-batches of an admissible b give r replicas a total in
    [m0, m_max]: the case the quick tests of :func:`_reachable` leave open."""
    lo, hi = -(-m0 // r), m_max // r  # range of the local batch size u * b
    if hi < max(lo, bmin):
        return False
    u = np.arange(2, hi // bmin + 1, dtype=np.int64)
    fits = np.maximum(bmin, _ceil_div(np.int64(lo), u)) <= np.minimum(bmax, hi // u)
    return bool(fits.any())


def _reachable(
    prob: Problem, m0: int, m_max: int, bmin: int, bmax: int, accumulation: bool
) -> Any:
    """Whether some admissible configuration has a total batch size in [m0, m_max]."""
    m, replicas = prob.m, prob.replicas
    n_lo = _ceil_div(float(m0), replicas)  # range of the local batch size
    n_hi = m_max // replicas
    reach = m.maximum(n_lo, bmin) <= m.minimum(n_hi, bmax)  # one micro-batch
    if accumulation:
        # A run of bmin consecutive local batches holds a multiple of bmin.
        reach = reach | ((n_lo <= n_hi) & (n_hi - n_lo + 1 >= bmin))
        for r in m.distinct_open(replicas, reach):
            if _reachable_by_scan(int(r), m0, m_max, bmin, bmax):
                reach = reach | (replicas == r)
    return reach


@attrs.frozen
class _Search:
    """The integer search over configurations (floats or flat arrays)."""

    prob: Problem
    floor_total: Any  # the smallest total batch size allowed: the initial one if reachable
    m_max: int
    bmin: int
    bmax: int
    u_max: Any  # the most micro-batches that fit in m_max

    def solve(self, u: Any) -> tuple[Any, Any]:
        """Best goodput (-inf if none) and atomic batch size at u micro-batches."""
        m = self.prob.m
        per_step = self.prob.replicas * u
        lo = m.maximum(self.bmin, _ceil_div(self.floor_total, per_step))
        hi = m.minimum(self.bmax, self.m_max // per_step)
        g, b = _best_integer(self.prob, u, lo, m.maximum(lo, hi))
        return m.where((lo <= hi) & (u <= self.u_max), g, -math.inf), b

    def without_accumulation(self) -> tuple[Any, Any, Any]:
        g, b = self.solve(1.0)
        return self.prob.m.maximum(g, 0.0), b, 1.0

    def with_accumulation(self) -> tuple[Any, Any, Any]:
        # Scan u = accum_steps + 1 upwards from the first count that can win
        # until the bound on all larger counts is no better than the best found
        # (the module docstring gives the reasons).
        prob, m = self.prob, self.prob.m
        u = _first_micro_batches(prob, self.floor_total, self.m_max, self.bmin, self.bmax)
        best_g, best_b, best_u = u * 0.0 - math.inf, u * 0.0, u * 0.0 + 1.0
        active = u == u  # all True, in u's shape
        for _ in range(_ACCUM_ROUNDS):
            g, b = self.solve(u)
            # Strictly better beyond rounding: a tie goes to fewer steps.
            better = active & (g > best_g * (1.0 + _ACCUM_TOLERANCE))
            best_g, best_b = m.where(better, g, best_g), m.where(better, b, best_b)
            best_u = m.where(better, u, best_u)
            u = u + 1.0
            # Upper bound on goodput at every number of micro-batches from u on.
            per_step = prob.replicas * u
            lo = m.maximum(self.floor_total, 1.0) / per_step
            bound = prob.goodput(_argmax_continuous(prob, u, lo, self.m_max / per_step), u)
            more = (u <= self.u_max) & (bound > best_g * (1.0 + _ACCUM_TOLERANCE))
            active = active & more
            if not m.any(active):
                break
        else:
            # Not settled by the scan (sparse admissible pairs, nearly flat goodput):
            # search those configurations exactly, atomic batch size by batch size.
            for i in m.indices(active):
                one = prob.row(i)
                g1, b1, u1 = _by_atomic(
                    one, m.item(self.floor_total, i), self.m_max, self.bmin, self.bmax
                )
                if g1 > m.item(best_g, i) * (1.0 + _ACCUM_TOLERANCE):
                    best_g, best_b = m.put(best_g, i, g1), m.put(best_b, i, b1)
                    best_u = m.put(best_u, i, u1)
        return m.maximum(best_g, 0.0), best_b, best_u


def _by_atomic(
    prob: Problem, floor_total: float, m_max: int, bmin: int, bmax: int
) -> tuple[float, float, float]:
    """Exact best (goodput, atomic_bsz, micro-batches) of one configuration.

    ``prob`` is one configuration on the array backend (see :meth:`Problem.row`).
    For a fixed atomic batch size b, goodput is u over a convex function of the
    number u of micro-batches (step time (u - 1) T_c + T_o is affine in u), so the
    best u is a neighbour of a closed-form real maximiser.
    """
    r = prob.replicas
    b = np.arange(bmin, min(bmax, m_max // r) + 1, dtype=np.float64)
    if len(b) == 0:
        return -math.inf, 0.0, 1.0
    u_lo = np.maximum(1.0, _ceil_div(floor_total, r * b))
    u_hi = m_max // (r * b)
    step1, compute, _, _ = prob.parts(b, np.ones_like(b))
    extra = step1 - compute  # time synchronisation and the optimiser step add to T_c
    with np.errstate(divide="ignore", invalid="ignore"):
        peak = np.sqrt(extra * prob.var * prob.m0 / (compute * prob.sqr * r * b))
    peak = np.where(np.isnan(peak), np.inf, peak)
    u_real = np.clip(np.maximum(peak, prob.m0 / (r * b)), u_lo, np.maximum(u_lo, u_hi))
    # Without time beyond T_c more micro-batches never help: fewest steps.
    u_real = np.where(extra > 0, u_real, u_lo)
    cand = np.clip(np.stack([np.floor(u_real), np.ceil(u_real)]), u_lo, np.maximum(u_lo, u_hi))
    values = np.where(u_lo <= u_hi, prob.goodput(b, cand), -np.inf)
    i, j = np.unravel_index(np.argmax(values), values.shape)
    return float(values[i, j]), float(b[j]), float(cand[i, j])


def best_config(
    prob: Problem, m_max: int, bmin: int, bmax: int, accumulation: bool
) -> tuple[Any, Any, Any]:
    """(goodput, atomic_bsz, accum_steps) of the best admissible configuration, as floats
    or float arrays; (0, 0, 0) where none is admissible (``replicas * bmin > m_max``).

    Admissible: integers ``bmin <= atomic_bsz <= bmax``, ``accum_steps`` 0 unless
    ``accumulation``, total batch size at most ``m_max`` and at least the initial one
    whenever some admissible configuration reaches it.
    """
    m = prob.m
    m0 = int(prob.m0)
    feasible = prob.replicas * bmin <= m_max
    with m.quiet():
        reach = _reachable(prob, m0, m_max, bmin, bmax, accumulation)
        search = _Search(
            prob=prob,
            floor_total=m.where(reach, float(m0), 0.0),
            m_max=m_max,
            bmin=bmin,
            bmax=bmax,
            u_max=m_max // (prob.replicas * bmin),
        )
        if accumulation:
            goodput, bsz, micro = search.with_accumulation()
        else:
            goodput, bsz, micro = search.without_accumulation()
    return (
        m.where(feasible, goodput, 0.0),
        m.where(feasible, bsz, 0.0),
        m.where(feasible, micro - 1.0, 0.0),
    )
