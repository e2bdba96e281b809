"""Step timings by configuration and the throughput model fitted to them.

The profiler is handed every measured micro-batch: the configuration it ran in
(nodes, replicas, atomic batch size), whether it only accumulated gradients or
ended in an optimiser step, its wall time and the part of it spent waiting for
gradient synchronisation. It never reads a clock. Per configuration it keeps
counts, sums and sums of squares, so means are exact and the state is small
plain data.

From the means it fits :class:`~adaptdl.core.goodput.PerfParams` (one observation
per configuration), refitting lazily on a cadence, and builds the job's
:class:`~adaptdl.core.goodput.GoodputFunction`.

The timings themselves, and the spike test that keeps spikes out of them, are in
:mod:`adaptdl.core.stats.timings`; the scheduling hints built from a profiler are in
:mod:`adaptdl.core.decide.hints`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NamedTuple

import attrs
import numpy as np
import numpy.typing as npt

from adaptdl.core.goodput import (
    PARAM_FLOOR,
    GoodputFunction,
    GradParams,
    PerfParams,
    fit_perf_params,
)
from adaptdl.core.stats.timings import (
    FIT_AFTER,
    SPIKE_AFTER,
    SPIKE_RATIO,
    ConfigTiming,
    Sums,
    Timing,
    check_times,
)
from adaptdl.core.validate import (
    ArgumentTypeError,
    check_flag,
    check_int,
    check_keys,
    check_state,
)

# The timings and the spike test live in `timings`; users import these names from here.
__all__ = [
    "FIT_AFTER",
    "PROFILER_SCHEMA",
    "PROFILER_SCHEMA_V1",
    "SPIKE_AFTER",
    "SPIKE_RATIO",
    "ConfigTiming",
    "Key",
    "Observations",
    "Profiler",
    "Timing",
]

#: Schema tag of :meth:`Profiler.to_json`.
PROFILER_SCHEMA = "adaptdl.profiler/2"
#: The schema before the spike runs were kept; its states load with none running.
PROFILER_SCHEMA_V1 = "adaptdl.profiler/1"

Key = tuple[int, int, int]


class Observations(NamedTuple):
    """One row per configuration in the fit (`FIT_AFTER`), in the argument order of the fit.

    ``accum_measured``: whether the row's accumulation time is the mean of `FIT_AFTER`
    or more accumulation micro-batches (else it is estimated from the optimiser steps,
    or rests on fewer: too few to tell the optimiser step's own cost by).
    ``optim_less_sync``: the optimiser micro-batch's mean time less its mean
    synchronisation wait (`ConfigTiming.optim_less_sync`).
    """

    num_nodes: npt.NDArray[np.int64]
    num_replicas: npt.NDArray[np.int64]
    atomic_bsz: npt.NDArray[np.int64]
    accum_step_time: npt.NDArray[np.float64]
    optim_step_time: npt.NDArray[np.float64]
    accum_measured: npt.NDArray[np.bool_]
    optim_less_sync: npt.NDArray[np.float64]


def _check_key(num_nodes: Any, num_replicas: Any, atomic_bsz: Any) -> Key:
    nodes = check_int("num_nodes", num_nodes, min=1)
    replicas = check_int("num_replicas", num_replicas, min=1)
    if nodes > replicas:
        raise ValueError(
            f"num_nodes must be <= num_replicas ({replicas}), every node runs a replica; "
            f"got {nodes}"
        )
    return nodes, replicas, check_int("atomic_bsz", atomic_bsz, min=1)


_EMPTY = ConfigTiming()


def _timings_of(sums: Mapping[Key, Any]) -> dict[Key, ConfigTiming]:
    """The immutable view of running sums (or of timings given to the constructor),
    without configurations that hold no record."""
    out: dict[Key, ConfigTiming] = {}
    for key, row in sums.items():
        timing = row.timing() if isinstance(row, Sums) else row
        if timing != _EMPTY:
            out[key] = timing
    return out


def _timings_repr(sums: Mapping[Key, Any]) -> str:
    return repr(_timings_of(sums))


def _refit_every(value: Any) -> int:
    return check_int("refit_every", value, min=1)


def _timings(value: Any) -> dict[Key, ConfigTiming]:
    if not isinstance(value, Mapping):
        raise ArgumentTypeError(f"timings must be a mapping, got {type(value).__name__}")
    out: dict[Key, ConfigTiming] = {}
    for key, timing in value.items():
        if not isinstance(key, tuple) or len(key) != 3:
            raise ValueError(f"timings keys must be (nodes, replicas, atomic_bsz), got {key!r}")
        if not isinstance(timing, ConfigTiming):
            raise ArgumentTypeError(f"timings values must be ConfigTiming, got {timing!r}")
        out[_check_key(*key)] = timing
    return out


def _perf_params_or_none(value: Any) -> PerfParams | None:
    if value is None or isinstance(value, PerfParams):
        return value
    raise ArgumentTypeError(f"last_fit must be a PerfParams or None, got {value!r}")


@attrs.define
class Profiler:
    """Step timings keyed by (num_nodes, num_replicas, atomic_bsz), and the fit of them.

    ``refit_every``: :meth:`perf_params` refits once this many optimiser steps have
    been recorded since the last fit (starting from the last fit), or as soon as a
    configuration enters the fit with its `FIT_AFTER`-th optimiser step (from
    scratch); otherwise it returns the cached fit. The other fields are state.
    """

    refit_every: int = attrs.field(default=16, converter=_refit_every)
    # The running sums per configuration; `timings` builds the immutable view. Compared
    # (and shown) as that view, so that equal histories give equal profilers.
    _sums: dict[Key, Sums] = attrs.field(
        factory=dict,
        alias="timings",
        converter=_timings,
        eq=_timings_of,
        repr=_timings_repr,
        on_setattr=attrs.setters.NO_OP,
    )
    last_fit: PerfParams | None = attrs.field(default=None, converter=_perf_params_or_none)
    steps_since_fit: int = attrs.field(default=0)
    new_config_since_fit: bool = attrs.field(default=False)
    num_fits: int = attrs.field(default=0)

    SCHEMA: ClassVar[str] = PROFILER_SCHEMA

    def __attrs_post_init__(self) -> None:
        self._sums = {key: Sums(self, timing) for key, timing in self._sums.items()}  # type: ignore[arg-type]
        self.steps_since_fit = check_int("steps_since_fit", self.steps_since_fit, min=0)
        self.new_config_since_fit = check_flag("new_config_since_fit", self.new_config_since_fit)
        self.num_fits = check_int("num_fits", self.num_fits, min=0)

    # -- recording -----------------------------------------------------------

    def record(
        self,
        num_nodes: int,
        num_replicas: int,
        atomic_bsz: int,
        *,
        accum_step: bool,
        step_time: float,
        sync_time: float = 0.0,
    ) -> None:
        """Record one micro-batch of ``atomic_bsz`` samples per replica.

        ``accum_step``: True for a micro-batch that only accumulated gradients,
        False for one that ended in an optimiser step. ``step_time``: its wall time
        in seconds (> 0), ``sync_time`` the part of it spent waiting for gradient
        synchronisation (>= 0). A spike (more than `SPIKE_RATIO` times the mean of
        its kind in its configuration, once that holds `SPIKE_AFTER` records) is
        left out and counted in `spikes`; the `SPIKE_AFTER`-th in a row starts that
        kind's sums afresh from itself.
        """
        key = _check_key(num_nodes, num_replicas, atomic_bsz)
        accum, step, sync = check_times(accum_step, step_time, sync_time)
        self._row(key).add(accum, step, sync)

    def recorder(
        self, num_nodes: int, num_replicas: int, atomic_bsz: int
    ) -> Callable[[bool, float, float], None]:
        """`record` for one configuration, checked once: ``(accum_step, step_time, sync_time)``.

        For a loop that records every micro-batch: the configuration is checked here,
        the times at each call (ValueError as `record` raises).
        """
        return self._row(_check_key(num_nodes, num_replicas, atomic_bsz)).add

    def _row(self, key: Key) -> Sums:
        row = self._sums.get(key)
        if row is None:
            row = self._sums[key] = Sums(self, _EMPTY)
        return row

    @property
    def timings(self) -> dict[Key, ConfigTiming]:
        """The timings of every configuration recorded, as immutable values (a new dict)."""
        return _timings_of(self._sums)

    # -- reading -------------------------------------------------------------

    def timing(self, num_nodes: int, num_replicas: int, atomic_bsz: int) -> ConfigTiming | None:
        """The timings of one configuration, or None if it was never recorded."""
        row = self._sums.get(_check_key(num_nodes, num_replicas, atomic_bsz))
        return None if row is None or row.empty() else row.timing()

    def observations(self) -> Observations:
        """Mean times of every configuration that holds `FIT_AFTER` optimiser steps,
        sorted by key.

        See :meth:`ConfigTiming.accum_step_time` for configurations that never
        accumulated.
        """
        rows = []
        for key in self._fitted_keys():
            timing = self._sums[key].timing()
            optim = timing.optim_step_time()
            accum = timing.accum_step_time()
            less_sync = timing.optim_less_sync()
            if optim is not None and accum is not None and less_sync is not None:
                measured = timing.accum.count >= FIT_AFTER
                rows.append((*key, accum, optim, measured, less_sync))

        def column(i: int, dtype: type[Any]) -> Any:
            return np.array([row[i] for row in rows], dtype=dtype)

        return Observations(
            column(0, np.int64),
            column(1, np.int64),
            column(2, np.int64),
            column(3, np.float64),
            column(4, np.float64),
            column(5, np.bool_),
            column(6, np.float64),
        )

    @property
    def spikes(self) -> int:
        """Micro-batches this process left out of the timings as spikes: more than
        `SPIKE_RATIO` times their configuration's mean step of their kind, once it
        holds `SPIKE_AFTER` records. Not state: a restored profiler counts from 0."""
        return sum(row.spikes for row in self._sums.values())

    def _fitted_keys(self) -> list[Key]:
        """The configurations in the fit, those holding `FIT_AFTER` optimiser steps, sorted."""
        return sorted(key for key, row in self._sums.items() if row.o_count >= FIT_AFTER)

    @property
    def max_profiled_replicas(self) -> int:
        """The most replicas of any configuration in the fit (`FIT_AFTER`; 0 if none)."""
        return max((key[1] for key in self._fitted_keys()), default=0)

    @property
    def max_profiled_nodes(self) -> int:
        """The most nodes of any configuration in the fit (`FIT_AFTER`; 0 if none)."""
        return max((key[0] for key in self._fitted_keys()), default=0)

    def perf_params(self) -> PerfParams | None:
        """The fitted throughput model, refitted if due; None before a configuration
        holds `FIT_AFTER` optimiser steps."""
        due = (
            self.last_fit is None
            or self.new_config_since_fit
            or self.steps_since_fit >= self.refit_every
        )
        if due:
            obs = self.observations()
            if obs.num_nodes.shape[0] == 0:
                # Nothing in the fit: none yet, or the only configuration's level moved
                # and it is re-entering (`FIT_AFTER`); the last fit stands until then.
                return self.last_fit
            # A new configuration can change which parameters the data identify, so
            # it gets a full fit; new steps of known ones only refine the last fit.
            warm = self.last_fit if not self.new_config_since_fit else None
            self.last_fit = fit_perf_params(*obs, initial=warm)
            self.steps_since_fit = 0
            self.new_config_since_fit = False
            self.num_fits += 1
        return self.last_fit

    def optimistic_fit(self, accumulation: bool = False) -> tuple[PerfParams, int] | None:
        """The fit made optimistic where its data cannot speak, and the atomic size a try
        may grow from; None where they can (or before the fit has any, `observations`).

        * While the fit rests on one atomic batch size it cannot tell a step's fixed
          cost from its per-sample cost; it takes half of each (`fit_perf_params`).
          This model takes all of it as fixed (``beta_c`` at the floor, ``alpha_c``
          the fit's compute time at that size), the most a larger batch could gain.
          The size is that one.
        * With ``accumulation`` (the job may accumulate), while no configuration in the
          fit measured `FIT_AFTER` accumulation micro-batches, the fit cannot tell the
          optimiser step's own cost ``alpha_o`` from the compute it ends, and takes
          none. This model takes the compute's fixed cost as the optimiser step's
          (``alpha_o`` the fit's ``alpha_c``, which then stays at the floor), the most
          accumulation could gain. The size is the largest profiled.

        What `GoodputDecision` explores by: the measured steps of a try end it.
        """
        fit = self.perf_params()
        if fit is None:
            return None
        # The sizes the fit saw, as `fit_perf_params` tells one from several.
        obs = self.observations()
        sizes = np.unique(obs.atomic_bsz)
        if sizes.shape[0] == 0:
            return None  # the last fit stands while its configuration re-enters
        one_size = sizes.shape[0] == 1
        trial = bool(accumulation) and not bool(obs.accum_measured.any())
        if not (one_size or trial):
            return None
        optimistic = fit
        if one_size:
            compute = fit.alpha_c + fit.beta_c * int(sizes[0])
            optimistic = attrs.evolve(
                optimistic,
                alpha_c=max(compute - PARAM_FLOOR * int(sizes[0]), PARAM_FLOOR),
                beta_c=PARAM_FLOOR,
            )
        if trial:
            optimistic = attrs.evolve(
                optimistic,
                alpha_c=PARAM_FLOOR,
                alpha_o=max(optimistic.alpha_c - PARAM_FLOOR, 0.0),
            )
        return optimistic, int(sizes.max())

    def goodput_fn(
        self, grad_params: GradParams | None, init_batch_size: int
    ) -> GoodputFunction | None:
        """The job's goodput model, or None before the throughput fit has a configuration
        (`perf_params`).

        Without ``grad_params`` (no gradient statistics yet) the model assumes no
        gradient noise, so a batch larger than ``init_batch_size`` brings no gain:
        the conservative choice.
        """
        init_batch_size = check_int("init_batch_size", init_batch_size, min=1)
        if grad_params is not None and not isinstance(grad_params, GradParams):
            raise ArgumentTypeError(
                f"grad_params must be a GradParams or None, got {grad_params!r}"
            )
        perf = self.perf_params()
        if perf is None:
            return None
        grad = grad_params if grad_params is not None else GradParams(0.0, 0.0)
        return GoodputFunction(perf, grad, init_batch_size)

    # -- persistence ---------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """Return the whole state as JSON-ready data (exact: floats round-trip through JSON)."""
        return {
            "schema": self.SCHEMA,
            "refit_every": self.refit_every,
            "timings": [
                {
                    "num_nodes": key[0],
                    "num_replicas": key[1],
                    "atomic_bsz": key[2],
                    "accum": timing.accum.to_json(),
                    "optim": timing.optim.to_json(),
                }
                for key, timing in sorted(self.timings.items())
            ],
            "last_fit": self.last_fit.to_dict() if self.last_fit is not None else None,
            "steps_since_fit": self.steps_since_fit,
            "new_config_since_fit": self.new_config_since_fit,
            "num_fits": self.num_fits,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Profiler:
        """Rebuild from :meth:`to_json`'s output, or a state of ``adaptdl.profiler/1``
        (no spike runs: none running); raise ValueError on any other shape."""
        keys = (
            "schema",
            "refit_every",
            "timings",
            "last_fit",
            "steps_since_fit",
            "new_config_since_fit",
            "num_fits",
        )
        v1 = isinstance(data, Mapping) and data.get("schema") == PROFILER_SCHEMA_V1
        data = check_state("Profiler state", data, PROFILER_SCHEMA_V1 if v1 else cls.SCHEMA, keys)
        entries = data["timings"]
        if not isinstance(entries, list):
            raise ArgumentTypeError(f"timings must be a list, got {type(entries).__name__}")
        timings: dict[Key, ConfigTiming] = {}
        for entry in entries:
            entry = check_keys(
                "timings entry",
                entry,
                ("num_nodes", "num_replicas", "atomic_bsz", "accum", "optim"),
            )
            key = _check_key(entry["num_nodes"], entry["num_replicas"], entry["atomic_bsz"])
            if key in timings:
                raise ValueError(f"timings has configuration {key} twice")
            timings[key] = ConfigTiming(
                Timing.from_json(entry["accum"], v1=v1), Timing.from_json(entry["optim"], v1=v1)
            )
        last_fit = data["last_fit"]
        return cls(
            refit_every=data["refit_every"],
            timings=timings,
            last_fit=PerfParams.from_dict(last_fit) if last_fit is not None else None,
            steps_since_fit=data["steps_since_fit"],
            new_config_since_fit=data["new_config_since_fit"],
            num_fits=data["num_fits"],
        )
