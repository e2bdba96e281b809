"""Fitting :class:`PerfParams` to measured step times (:func:`fit_perf_params`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import scipy.optimize

from adaptdl.core.goodput.model import ARRAYS, check_topology, log_optim_time
from adaptdl.core.goodput.params import GAMMA_RANGE, PARAM_FLOOR, PerfParams
from adaptdl.core.validate import FloatArray, as_real_array, check_reals

# Weight of the pull of gamma towards 1: the alphas and betas are easier to fit
# when compute and communication add up, so prefer that unless the data disagree.
_GAMMA_PULL = 1e-3
# Prior for network parameters across nodes when no multi-node step was observed:
# crossing nodes costs at least this much more than staying within one node.
_INTER_NODE_PRIOR = 1.1
_THETA_MAX = math.log(1e6)
# Values of gamma whose least-squares starts are compared before the descent.
_GAMMA_STARTS = (1.0, 1.5, 2.5, 4.0, 7.0, 10.0)
# How much a fit with the optimiser step's own cost (alpha_o) must lower the RMS log
# errors of the step times to replace the fit without it: 1% of a step, below which
# the two predict alike (and a fit of noise is no reason for another parameter).
_ALPHA_O_GAIN = 0.01


@attrs.frozen
class _Observations:
    """Validated observations sorted into single-replica, intra-node and inter-node runs."""

    bsz: FloatArray
    log_accum: FloatArray
    log_optim: FloatArray
    n_single: int  # observations [0, n_single) have one replica: no network time
    n_intra: int  # the next n_intra synchronise within one node, the rest across nodes
    extra: FloatArray  # max(replicas - 2, 0) of the multi-replica observations
    # 1.0 where the accumulation time was estimated from the optimiser steps (optim
    # minus sync: it holds the optimiser step's alpha_o too), 0.0 where measured.
    estimated: FloatArray
    # Where a multi-replica configuration measured its accumulation: the positions,
    # and the log of its optimiser micro-batch's time less its synchronisation wait
    # (T_c + alpha_o: what tells alpha_o from the network's alpha).
    apart: npt.NDArray[np.intp]
    log_apart: FloatArray

    @property
    def n(self) -> int:
        return int(self.bsz.shape[0])

    def objective(self, theta: FloatArray) -> tuple[float, FloatArray]:
        """RMS log errors of both step times plus the gamma pull, and the gradient.

        ``theta``: the logs of the alphas and betas, gamma, and (an eighth entry,
        where the data identify it) the log of ``alpha_o``; without it ``alpha_o`` is
        0 and every value is as the model without it computes.
        """
        a = np.exp(theta[:6])
        gamma = float(theta[6])
        with_o = theta.shape[0] == 8
        n, k, m = self.n, self.n_single, self.n_intra
        compute = a[0] + a[1] * self.bsz
        log_c = np.log(compute)
        extra = self.extra
        network = np.concatenate([a[4] + a[5] * extra[:m], a[2] + a[3] * extra[m:]])
        log_n = np.log(network)
        log_cm = log_c[k:]
        log_o, z = log_optim_time(ARRAYS, log_cm, log_n, gamma)
        log_overlap = np.concatenate([log_c[:k], log_o])
        if with_o:
            alpha_o = math.exp(float(theta[7]))
            optim = np.exp(log_overlap) + alpha_o
            accum = compute + alpha_o * self.estimated
            apart = compute[self.apart] + alpha_o
            err1 = np.log(accum) - self.log_accum
            err2 = np.log(optim) - self.log_optim
            err3 = np.log(apart) - self.log_apart
            n1 = n + err3.shape[0]  # the compute times: accumulation, and optim less sync
            rms1 = math.sqrt((float(err1 @ err1) + float(err3 @ err3)) / n1 + 1e-18)
        else:
            err1 = log_c - self.log_accum
            err2 = log_overlap - self.log_optim
            n1 = n
            rms1 = math.sqrt(float(err1 @ err1) / n + 1e-18)
        rms2 = math.sqrt(float(err2 @ err2) / n + 1e-18)
        value = rms1 + rms2 + _GAMMA_PULL * (gamma - 1.0) ** 2
        d1 = err1 / (n1 * rms1)
        d2 = err2 / (n * rms2)
        grad = np.empty(theta.shape[0])
        if with_o:
            # d log(accum) / d log T_c and d log T_o / d log(overlap): below 1 by
            # alpha_o's share.
            d3 = err3 / (n1 * rms1)
            grad[7] = alpha_o * (
                float(d1 @ (self.estimated / accum))
                + float(d2 @ (1.0 / optim))
                + float(d3 @ (1.0 / apart))
            )
            d1_c = d1 * (compute / accum)
            d1_c[self.apart] += d3 * (compute[self.apart] / apart)
            d2 = d2 * (np.exp(log_overlap) / optim)
        else:
            d1_c = d1
        d2m = d2[k:]
        share_n = 1.0 / (1.0 + np.exp(-z))  # d log T_o / d log T_n
        dlog_c = d1_c + d2
        dlog_c[k:] -= d2m * share_n
        dlog_n = d2m * share_n / network
        per_c = dlog_c / compute
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
        array = as_real_array(name, value)
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
    nodes = _check_column("num_nodes", arrays, min=1.0, integer=True)
    replicas = _check_column("num_replicas", arrays, min=1.0, integer=True)
    check_topology(ARRAYS, nodes, replicas)
    bsz = _check_column("atomic_bsz", arrays, min=0.0, exclusive=True)
    accum = _check_column("accum_step_time", arrays, min=0.0, exclusive=True)
    optim = _check_column("optim_step_time", arrays, min=0.0, exclusive=True)
    return nodes, replicas, bsz, accum, optim


def _check_column(
    name: str, arrays: Mapping[str, FloatArray], *, min: float, **kwargs: bool
) -> FloatArray:
    checked = check_reals(name, arrays[name], min=min, **kwargs)
    assert isinstance(checked, np.ndarray)  # 1-D: checked above
    return checked


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
    accum_measured: npt.ArrayLike | None = None,
    optim_less_sync: npt.ArrayLike | None = None,
    *,
    initial: PerfParams | None = None,
) -> PerfParams:
    """Fit :class:`PerfParams` to observed step times (one entry per observation).

    Minimises the RMS log error of the accumulation step times against ``T_c`` plus
    that of the optimiser step times against ``T_o`` (bounded L-BFGS-B on the log
    of every alpha and beta, analytic gradient). ``accum_measured`` (bools; None:
    none) tells which accumulation times were measured on accumulation micro-batches;
    the others were estimated from the optimiser steps (their time less their
    synchronisation), which hold the optimiser step's ``alpha_o`` too, so they are
    compared with ``T_c + alpha_o``. ``optim_less_sync`` (seconds; None: not known)
    is that time for every observation: where a multi-replica configuration
    measured its accumulation, it is compared with ``T_c + alpha_o`` too, which tells
    ``alpha_o`` from the network's ``alpha_r`` / ``alpha_n`` (on one replica the
    optimiser step's time does). The descent starts from whichever fits best of
    weighted least-squares starts at several values of gamma and ``initial`` (for
    example the last fit), if given. Parameters that the data cannot identify take
    priors:

    * one atomic batch size: ``alpha_c`` is fixed to half the compute time;
    * no multi-replica step within a node (across nodes): ``alpha_r`` (``alpha_n``)
      stays at the floor; likewise ``beta_r`` (``beta_n``) without more than two
      replicas there (an optimistic model, so the scheduler tries the configuration);
    * no multi-node step: afterwards ``alpha_n, beta_n >= 1.1 * (alpha_r, beta_r)``;
    * no multi-replica step at all: ``gamma = 1``;
    * no measured accumulation time: ``alpha_o = 0`` (the optimiser step cannot be
      told from the compute it ends; the decision tries an accumulated step,
      `Profiler.optimistic_fit`). With some, the fit with ``alpha_o`` replaces the
      one without (0) only where it lowers the objective by 0.01 (1% RMS log error):
      a fit of the model without it, to data it explains, is unchanged by them.

    Runs in a few milliseconds with single-threaded BLAS; threaded OpenBLAS on a
    busy machine slows L-BFGS-B's tiny vector operations about tenfold
    (``OPENBLAS_NUM_THREADS=1`` avoids it).
    """
    nodes, replicas, bsz, accum, optim = _check_observations(
        num_nodes, num_replicas, atomic_bsz, accum_step_time, optim_step_time
    )
    measured = _check_measured(accum_measured, bsz.shape[0])
    less_sync = _check_less_sync(optim_less_sync, bsz.shape[0])
    group = np.where(replicas == 1, 0, np.where(nodes == 1, 1, 2))
    order = np.argsort(group, kind="stable")
    group, replicas = group[order], replicas[order]
    apart = np.flatnonzero(measured[order] & (group > 0) & (less_sync[order] > 0.0))
    obs = _Observations(
        bsz=bsz[order],
        log_accum=np.log(accum[order]),
        log_optim=np.log(optim[order]),
        n_single=int(np.count_nonzero(group == 0)),
        n_intra=int(np.count_nonzero(group == 1)),
        extra=np.maximum(replicas[group > 0] - 2.0, 0.0),
        estimated=np.where(measured[order], 0.0, 1.0),
        apart=apart,
        log_apart=np.log(less_sync[order][apart]),
    )
    without, theta = _descend(obs, group, replicas, False, initial)
    if not measured.any():
        return without
    # Where what the data show of alpha_o (a median) is under half the gain's share
    # of a step, a fit with it would move a typical log error by less than that and
    # rarely lower both RMS terms by the gain: the second descent (as costly as the
    # first) is skipped. The simulator's models, whose optimiser step costs only its
    # compute, never pay for it.
    guess, step = _alpha_o_guess(obs)
    if guess <= 0.5 * _ALPHA_O_GAIN * step:
        return without
    # The model without the optimiser step's own cost stands unless the data ask for
    # it: a fit with it must lower the RMS log errors (both judged on every time,
    # the optimisers' less their sync included) by _ALPHA_O_GAIN.
    fitted, theta_with = _descend(obs, group, replicas, True, initial)
    error = obs.objective(np.append(theta, math.log(PARAM_FLOOR)))[0]
    error_with = obs.objective(theta_with)[0]
    return fitted if error_with < error - _ALPHA_O_GAIN else without


def _descend(
    obs: _Observations,
    group: npt.NDArray[np.int64],
    replicas: FloatArray,
    with_o: bool,
    initial: PerfParams | None,
) -> tuple[PerfParams, FloatArray]:
    """The fit (with ``alpha_o`` or without: 0) and its ``theta``."""
    intra, inter = group == 1, group == 2
    floor = math.log(PARAM_FLOOR)
    size = 8 if with_o else 7
    lower = np.array([floor] * 6 + [GAMMA_RANGE[0]] + [floor] * (size - 7))
    upper = np.array([_THETA_MAX] * 6 + [GAMMA_RANGE[1]] + [_THETA_MAX] * (size - 7))
    pinned: dict[int, float] = {}
    if np.unique(obs.bsz).shape[0] == 1:
        # Half the compute time (with alpha_o: as measured, an estimate holds alpha_o).
        known = obs.log_accum[obs.estimated == 0.0] if with_o else obs.log_accum
        pinned[0] = math.log(max(PARAM_FLOOR, float(np.exp(np.mean(known))) / 2))
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
        tail = [math.log(max(params[7], PARAM_FLOOR))] if with_o else []
        theta: FloatArray = np.clip(np.array([*logs, params[6], *tail]), lower, upper)
        for i, value in pinned.items():
            theta[i] = value
        return theta

    starts = [to_theta(start) for start in _starts(obs, pinned, with_o)]
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
    values.append(float(np.exp(theta[7])) if with_o else 0.0)  # alpha_o
    return PerfParams(*values), theta


def _check_less_sync(value: npt.ArrayLike | None, n: int) -> FloatArray:
    """``optim_less_sync`` as n times > 0 (None: n zeros, none known)."""
    if value is None:
        return np.zeros(n)
    array = as_real_array("optim_less_sync", value)
    if array.shape != (n,):
        raise ValueError(
            f"optim_less_sync must hold {n} times, one per observation, or be None; "
            f"got shape {array.shape}"
        )
    checked = check_reals("optim_less_sync", array, min=0.0, exclusive=True)
    assert isinstance(checked, np.ndarray)
    return checked


def _check_measured(value: npt.ArrayLike | None, n: int) -> npt.NDArray[np.bool_]:
    """``accum_measured`` as n bools (None: none measured)."""
    if value is None:
        return np.zeros(n, dtype=bool)
    array = np.asarray(value)
    if array.shape != (n,) or array.dtype != np.bool_:
        raise ValueError(
            f"accum_measured must be {n} bools, one per observation, or None; got {value!r}"
        )
    return array


def _alpha_o_guess(obs: _Observations) -> tuple[float, float]:
    """What the measured accumulation shows of the optimiser step's own cost, and the
    median optimiser micro-batch it is part of (seconds; the rows that measured it)."""
    accum = np.exp(obs.log_accum)
    optim = np.exp(obs.log_optim)
    measured = obs.estimated == 0.0
    excess = optim[measured] - accum[measured]
    single = measured[: obs.n_single]
    if single.any():  # one replica: the excess is alpha_o
        guess = float(np.median(excess[: int(np.count_nonzero(single))]))
    elif obs.apart.shape[0]:  # several: the optimiser step less sync, over compute
        guess = float(np.median(np.exp(obs.log_apart) - accum[obs.apart]))
    else:  # several, sync unknown: it holds synchronisation too
        guess = 0.5 * float(np.median(excess))
    return guess, float(np.median(optim[measured]))


def _starts(
    obs: _Observations, pinned: Mapping[int, float], with_o: bool
) -> list[tuple[float, ...]]:
    """Weighted least-squares starting points of the fit, one per trial gamma (and,
    where ``alpha_o`` is fitted, per trial ``alpha_o``: none, and the optimiser
    steps' excess over the measured accumulation)."""
    accum = np.exp(obs.log_accum)
    optim = np.exp(obs.log_optim)
    trials = [0.0]
    if with_o:
        trials.append(max(PARAM_FLOOR, _alpha_o_guess(obs)[0]))
    starts: list[tuple[float, ...]] = []
    for alpha_o in trials:
        # The compute times the accumulation times show (an estimate holds alpha_o).
        compute_seen = np.maximum(accum - alpha_o * obs.estimated, PARAM_FLOOR)
        overlapped = np.maximum(optim - alpha_o, PARAM_FLOOR)
        at = _starts_at(obs, pinned, compute_seen, overlapped)
        starts += [(*start, alpha_o) for start in at]
    return starts


def _starts_at(
    obs: _Observations, pinned: Mapping[int, float], accum: FloatArray, optim_all: FloatArray
) -> list[tuple[float, ...]]:
    """The starts of :func:`_starts` for given compute and overlapped optimiser times."""
    if 0 in pinned:
        alpha_c = math.exp(pinned[0])
        beta_c = max(PARAM_FLOOR, float(np.median((accum - alpha_c) / obs.bsz)))
    else:
        alpha_c, beta_c = _weighted_line(obs.bsz, accum)
    k, m = obs.n_single, obs.n_intra
    compute = (alpha_c + beta_c * obs.bsz)[k:]
    optim = optim_all[k:]
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
