"""The step timings a profiler keeps per configuration, and which of them it keeps.

`Timing` holds the count, sums and sums of squares of one kind of micro-batch
(accumulation or optimiser step), `ConfigTiming` both kinds of one configuration,
and `Sums` the running sums that `adaptdl.core.stats.profiler.Profiler` adds every
recorded micro-batch to in place. `Sums.add` applies the spike test (`SPIKE_RATIO`,
`SPIKE_AFTER`) and counts a configuration into the fit once it holds `FIT_AFTER`
optimiser steps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from adaptdl.core.validate import check_flag, check_float, check_int, check_keys

if TYPE_CHECKING:
    from adaptdl.core.stats.profiler import Profiler

__all__ = [
    "FIT_AFTER",
    "SPIKE_AFTER",
    "SPIKE_RATIO",
    "ConfigTiming",
    "Sums",
    "Timing",
    "check_times",
]

# An accumulation-step time estimated from an optimiser step (step minus sync) is
# kept at least this share of the step, so that a sync time measured as long as the
# whole step cannot make it zero or negative.
_MIN_COMPUTE_SHARE = 0.01
# A step more than this many times its configuration's mean step time so far is a
# spike, left out of the timings: an evaluation, a checkpoint or a log flush inside the
# training loop, a garbage collection, a page-in. The model is of the steady step;
# one 30 s evaluation among 500 steps of 0.1 s would otherwise add 60 ms to every step
# of whichever configuration it fell in. Jitter (contended CPUs: up to ~3x the mean)
# stays in.
SPIKE_RATIO = 4.0
# Records of a kind (accumulation, optimiser) a configuration holds before the spike
# test applies: fewer make too noisy a mean to judge by; more let a spike among a new
# configuration's first steps in more often. As many spikes in a row are no spikes:
# the level moved (longer sequences, a slower network after a restart), and the
# kind's sums start afresh from the last of them.
SPIKE_AFTER = 4
# Optimiser steps a configuration holds before it enters the throughput fit, for the
# same reason: before the spike test applies, one evaluation among a configuration's
# first steps can be most of its mean. Measured on the Dyck transformer: an evaluation
# (~0.1 s) among the first two steps at a new size made them read 57 ms against a
# steady 12; the decision at the next pass start, 0.1 s later, fitted them, rated every
# larger size slow, shrank 76 -> 20 and stayed there ~27 CPU s (its target took 55 CPU s
# against 28-36 on the other seeds). Until then the decision reads the fit without it.
FIT_AFTER = SPIKE_AFTER


@attrs.frozen
class Timing:
    """Count, sum and sum of squares of step times and of their synchronisation times
    (s), and how many records in a row were just left out as spikes (`SPIKE_RATIO`)."""

    count: int = 0
    step_sum: float = 0.0
    step_sqsum: float = 0.0
    sync_sum: float = 0.0
    sync_sqsum: float = 0.0
    spike_run: int = 0

    SUMS: ClassVar[tuple[str, ...]] = ("step_sum", "step_sqsum", "sync_sum", "sync_sqsum")
    #: The fields of schema ``adaptdl.profiler/1``.
    FIELDS_V1: ClassVar[tuple[str, ...]] = ("count", *SUMS)
    FIELDS: ClassVar[tuple[str, ...]] = (*FIELDS_V1, "spike_run")

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "count", check_int("count", self.count, min=0))
        for name in self.SUMS:
            object.__setattr__(self, name, check_float(name, getattr(self, name), min=0.0))
        run = check_int("spike_run", self.spike_run, min=0)
        object.__setattr__(self, "spike_run", run)
        if self.count == 0 and (run or any(getattr(self, n) != 0.0 for n in self.SUMS)):
            raise ValueError("a Timing with count 0 must have all sums 0 and no spike run")

    def add(self, step_time: float, sync_time: float) -> Timing:
        """Return these statistics with one more step (no spike test: `Profiler.record`
        makes it)."""
        return Timing(
            self.count + 1,
            self.step_sum + step_time,
            self.step_sqsum + step_time * step_time,
            self.sync_sum + sync_time,
            self.sync_sqsum + sync_time * sync_time,
        )

    @property
    def mean_step(self) -> float:
        """Mean step time (nan when empty)."""
        return self.step_sum / self.count if self.count else math.nan

    @property
    def mean_sync(self) -> float:
        """Mean synchronisation time (nan when empty)."""
        return self.sync_sum / self.count if self.count else math.nan

    @property
    def std_step(self) -> float:
        """Population standard deviation of the step time (nan when empty)."""
        if not self.count:
            return math.nan
        mean = self.mean_step
        return math.sqrt(max(self.step_sqsum / self.count - mean * mean, 0.0))

    def to_json(self) -> dict[str, Any]:
        """Return the statistics as JSON-ready data."""
        return {name: getattr(self, name) for name in self.FIELDS}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, v1: bool = False) -> Timing:
        """Rebuild from :meth:`to_json`'s output (``v1``: of schema
        ``adaptdl.profiler/1``, without ``spike_run``)."""
        fields = cls.FIELDS_V1 if v1 else cls.FIELDS
        data = check_keys("Timing", data, fields)
        return cls(**{name: data[name] for name in fields})


@attrs.frozen
class ConfigTiming:
    """Timings of one configuration: accumulation micro-batches and optimiser steps apart."""

    accum: Timing = Timing()
    optim: Timing = Timing()

    def accum_step_time(self) -> float | None:
        """Mean compute-only micro-batch time.

        Measured where accumulation steps were seen; otherwise estimated from the
        optimiser steps as their mean time minus their mean synchronisation time
        (at least 1% of the step); None without either.
        """
        if self.accum.count:
            return self.accum.mean_step
        return self.optim_less_sync()

    def optim_less_sync(self) -> float | None:
        """Mean optimiser micro-batch time less its mean synchronisation wait (at least
        1% of the step): its compute and the optimiser step's own cost; None if none
        seen."""
        if self.optim.count:
            step = self.optim.mean_step
            return max(step - self.optim.mean_sync, _MIN_COMPUTE_SHARE * step)
        return None

    def optim_step_time(self) -> float | None:
        """Mean optimiser micro-batch time, synchronisation included; None if none seen."""
        return self.optim.mean_step if self.optim.count else None


class Sums:
    """The running sums of one configuration, added to in place by every record.

    The per-batch path (`Profiler.recorder`) adds here, with no object built; the
    immutable `ConfigTiming` is made only when someone reads the timings. The sums
    are added in record order, so those of the records kept equal `Timing.add`'s
    exactly.
    """

    __slots__ = (
        "_profiler",
        "a_count",
        "a_run",
        "a_run_at",
        "a_step",
        "a_step_sq",
        "a_sync",
        "a_sync_sq",
        "o_count",
        "o_run",
        "o_run_at",
        "o_step",
        "o_step_sq",
        "o_sync",
        "o_sync_sq",
        "spikes",
    )

    def __init__(self, profiler: Profiler, timing: ConfigTiming) -> None:
        self._profiler = profiler
        a, o = timing.accum, timing.optim
        self.a_count, self.a_step, self.a_step_sq = a.count, a.step_sum, a.step_sqsum
        self.a_sync, self.a_sync_sq = a.sync_sum, a.sync_sqsum
        self.o_count, self.o_step, self.o_step_sq = o.count, o.step_sum, o.step_sqsum
        self.o_sync, self.o_sync_sq = o.sync_sum, o.sync_sqsum
        # A run of spikes is live while the count it was seen at stands: a kept
        # record moves the count on and so ends it, with no work on the kept path.
        # A run as long as SPIKE_AFTER or longer (a state saved under a larger one)
        # ends at the next spike, as the longest run does.
        self.a_run, self.a_run_at = min(a.spike_run, SPIKE_AFTER - 1), a.count
        self.o_run, self.o_run_at = min(o.spike_run, SPIKE_AFTER - 1), o.count
        self.spikes = 0  # records left out as spikes (this process only: not state)

    def timing(self) -> ConfigTiming:
        a_run = self.a_run if self.a_run_at == self.a_count else 0
        o_run = self.o_run if self.o_run_at == self.o_count else 0
        return ConfigTiming(
            Timing(self.a_count, self.a_step, self.a_step_sq, self.a_sync, self.a_sync_sq, a_run),
            Timing(self.o_count, self.o_step, self.o_step_sq, self.o_sync, self.o_sync_sq, o_run),
        )

    def add(self, accum_step: bool, step_time: float, sync_time: float) -> None:
        """Record one micro-batch (see `Profiler.record`); ValueError for bad times."""
        # Checked inline: this runs for every micro-batch. Anything else (an int, a numpy
        # float, nan, inf, a bad sign) takes the full check, which converts or raises.
        if (
            accum_step.__class__ is not bool
            or step_time.__class__ is not float
            or sync_time.__class__ is not float
            or not 0.0 < step_time < math.inf
            or not 0.0 <= sync_time < math.inf
        ):
            accum_step, step_time, sync_time = check_times(accum_step, step_time, sync_time)
        # A spike (see SPIKE_RATIO): compared as step * count > ratio * sum, which
        # the sums alone decide, so a restored profiler rejects exactly what this
        # one would.
        if accum_step:
            count = self.a_count
            if count >= SPIKE_AFTER and step_time * count > SPIKE_RATIO * self.a_step:
                run = self.a_run + 1 if self.a_run_at == count else 1
                if run < SPIKE_AFTER:
                    self.a_run, self.a_run_at = run, count
                    self.spikes += 1
                    return
                count = self.a_count = 0  # a moved level: afresh, from this step
                self.a_step = self.a_step_sq = self.a_sync = self.a_sync_sq = 0.0
                self.a_run = 0
            if count + 1 == FIT_AFTER:
                # Enough accumulation steps to tell the optimiser step's own cost by
                # (`Observations.accum_measured`): a full fit.
                self._profiler.new_config_since_fit = True
            self.a_count = count + 1
            self.a_step += step_time
            self.a_step_sq += step_time * step_time
            self.a_sync += sync_time
            self.a_sync_sq += sync_time * sync_time
            return
        count = self.o_count
        if count >= SPIKE_AFTER and step_time * count > SPIKE_RATIO * self.o_step:
            run = self.o_run + 1 if self.o_run_at == count else 1
            if run < SPIKE_AFTER:
                self.o_run, self.o_run_at = run, count
                self.spikes += 1
                return
            count = self.o_count = 0  # a moved level: afresh (re-enters the fit, `FIT_AFTER`)
            self.o_step = self.o_step_sq = self.o_sync = self.o_sync_sq = 0.0
            self.o_run = 0
        profiler = self._profiler
        if count + 1 == FIT_AFTER:  # the configuration enters the fit (`observations`)
            profiler.new_config_since_fit = True
        self.o_count = count + 1
        self.o_step += step_time
        self.o_step_sq += step_time * step_time
        self.o_sync += sync_time
        self.o_sync_sq += sync_time * sync_time
        profiler.steps_since_fit += 1

    def empty(self) -> bool:
        return not (self.a_count or self.o_count)


def check_times(accum_step: Any, step_time: Any, sync_time: Any) -> tuple[bool, float, float]:
    return (
        check_flag("accum_step", accum_step),
        check_float("step_time", step_time, min=0.0, min_exclusive=True),
        check_float("sync_time", sync_time, min=0.0),
    )
