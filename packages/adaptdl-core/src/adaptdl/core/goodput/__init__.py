"""The Pollux goodput model: throughput x statistical efficiency.

A job's *goodput* at a configuration (nodes, replicas, atomic batch size,
accumulation steps) is its throughput in samples per second times the
statistical efficiency of its total batch size, the progress one sample makes
relative to a sample at the initial batch size (Qiao et al., OSDI 2021).

The package, by what each module holds:

* :mod:`~adaptdl.core.goodput.params`: :class:`PerfParams` and :class:`GradParams`;
* :mod:`~adaptdl.core.goodput.model`: the throughput and efficiency formulas, once,
  for one configuration (floats) or many (arrays); :func:`compute_time` and
  :func:`optim_step_time` for callers that simulate a job;
* :mod:`~adaptdl.core.goodput.optimize`: the exact integer search over (atomic batch
  size, accumulation steps);
* :mod:`~adaptdl.core.goodput.function`: :class:`GoodputFunction`, the public face;
* :mod:`~adaptdl.core.goodput.fit`: :func:`fit_perf_params`.
"""

from __future__ import annotations

from adaptdl.core.goodput.fit import fit_perf_params
from adaptdl.core.goodput.function import GoodputFunction
from adaptdl.core.goodput.model import compute_time, optim_step_time
from adaptdl.core.goodput.params import GAMMA_RANGE, PARAM_FLOOR, GradParams, PerfParams

__all__ = [
    "GAMMA_RANGE",
    "PARAM_FLOOR",
    "GoodputFunction",
    "GradParams",
    "PerfParams",
    "compute_time",
    "fit_perf_params",
    "optim_step_time",
]
