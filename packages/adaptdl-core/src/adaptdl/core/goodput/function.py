""":class:`GoodputFunction`: one job's goodput, its parts and its best configuration."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from adaptdl.core.goodput.model import (
    FLOATS,
    Math,
    Problem,
    backend,
    check_config,
    check_placement,
    effective_grad,
    efficiency,
    make_problem,
)
from adaptdl.core.goodput.optimize import best_config
from adaptdl.core.goodput.params import (
    GradParams,
    PerfParams,
    check_init_batch_size,
    to_grad_params,
    to_perf_params,
)
from adaptdl.core.validate import ArgumentTypeError, check_int, check_reals

#: A configuration argument: a number, or an array of them that broadcasts.
Values = npt.ArrayLike


def _check_flat_beyond(value: Any) -> int | None:
    """``network_flat_beyond``: None, or a count of replicas >= 1."""
    return None if value is None else check_int("network_flat_beyond", value, min=1)


@attrs.frozen
class GoodputFunction:
    """Goodput of one job: throughput (samples/s) times statistical efficiency.

    ``perf_params`` and ``grad_params`` also accept sequences in field order or
    mappings as produced by ``to_dict``. Every method broadcasts numpy arrays of
    configurations and returns Python scalars for scalar arguments.

    ``network_flat_beyond`` (None: off) is the most replicas the throughput model
    was fitted on: past it, the synchronisation time is held at its value there
    instead of extrapolating the per-replica slopes ``beta_r``, ``beta_n``. A slope
    fitted over a few small counts can make every larger count look slower, and a
    scheduler never tries a count its model calls slower, so the slope is never
    corrected; held flat, the model is optimistic past what was measured, the job is
    tried larger, and the fit learns from what it sees there.
    """

    perf_params: PerfParams = attrs.field(converter=to_perf_params)
    grad_params: GradParams = attrs.field(converter=to_grad_params)
    init_batch_size: int = attrs.field(converter=check_init_batch_size)
    network_flat_beyond: int | None = attrs.field(
        default=None, kw_only=True, converter=_check_flat_beyond
    )

    def evaluate(
        self, num_nodes: Values, num_replicas: Values, atomic_bsz: Values, accum_steps: Values
    ) -> Any:
        """Return goodput = throughput x efficiency of the total batch size."""
        return self._at(Problem.goodput, num_nodes, num_replicas, atomic_bsz, accum_steps)

    __call__ = evaluate

    def throughput(
        self, num_nodes: Values, num_replicas: Values, atomic_bsz: Values, accum_steps: Values
    ) -> Any:
        """Return samples per second: total batch size over ``k * T_c + T_o``."""
        return self._at(Problem.throughput, num_nodes, num_replicas, atomic_bsz, accum_steps)

    def efficiency(self, batch_size: npt.ArrayLike) -> Any:
        """Return the statistical efficiency of a total batch size, in (0, 1].

        1 at and below the initial batch size (smaller batches are not credited with
        more than one initial-batch sample's progress per sample), non-increasing above.
        """
        total = check_reals("batch_size", batch_size, min=0.0, exclusive=True)
        sqr, var = effective_grad(self.grad_params)
        m = backend(total)
        return _output(m, efficiency(m, sqr, var, float(self.init_batch_size), total))

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
        floating-point rounding (see :mod:`adaptdl.core.goodput.optimize` for why).
        Plain numbers (or 0-d arrays) give Python scalars; arrays give arrays of
        their broadcast shape (float goodput, int64 sizes and steps).
        """
        nodes, replicas = check_placement(num_nodes, num_replicas)
        m0 = self.init_batch_size
        m_max = m0 if max_batch_size is None else check_int("max_batch_size", max_batch_size)
        if m_max < m0:
            raise ValueError(
                f"max_batch_size must be >= init_batch_size ({m0}), got {max_batch_size!r}"
            )
        bmin, bmax = _check_bsz_range(atomic_bsz_range, m_max)
        if not isinstance(accumulation, (bool, np.bool_)):
            raise ArgumentTypeError(f"accumulation must be a bool, got {accumulation!r}")
        one = backend(nodes, replicas) is FLOATS
        if not one:  # the search runs on flat arrays
            shape = np.broadcast_shapes(np.shape(nodes), np.shape(replicas))
            nodes = np.broadcast_to(nodes, shape).ravel()
            replicas = np.broadcast_to(replicas, shape).ravel()
        prob = make_problem(
            self.perf_params,
            self.grad_params,
            m0,
            nodes,
            replicas,
            flat_beyond=self.network_flat_beyond,
        )
        goodput, bsz, accum = best_config(prob, m_max, bmin, bmax, bool(accumulation))
        if one:
            return float(goodput), int(bsz), int(accum)
        return (
            goodput.reshape(shape),
            bsz.astype(np.int64).reshape(shape),
            accum.astype(np.int64).reshape(shape),
        )

    def _at(self, quantity: Callable[[Problem, Any, Any], Any], *config: Values) -> Any:
        """``quantity`` of the model at a checked configuration (nodes, replicas,
        atomic_bsz, accum_steps): a float for plain numbers, else an array."""
        nodes, replicas, bsz, micro = check_config(*config)
        m = backend(nodes, replicas, bsz, micro)
        prob = make_problem(
            self.perf_params,
            self.grad_params,
            self.init_batch_size,
            nodes,
            replicas,
            m,
            flat_beyond=self.network_flat_beyond,
        )
        with m.quiet():
            return _output(m, quantity(prob, bsz, micro))


def _output(m: Math, value: Any) -> Any:
    """A float for one configuration, else the array."""
    return float(value) if m is FLOATS else value


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
