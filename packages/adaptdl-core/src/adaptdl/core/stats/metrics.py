"""The job's training metrics as one checkpointed state: noise, progress, step timings
and (where the program reports its training loss) the noise floor's share."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from adaptdl.core.goodput import GoodputFunction, GradParams
from adaptdl.core.persist.checkpoint import JsonState
from adaptdl.core.stats.estimators import (
    DEFAULT_ESTIMATOR,
    ESTIMATORS,
    EstimatorFactory,
    estimator_factory,
)
from adaptdl.core.stats.floor import FloorConfig, LossFloor
from adaptdl.core.stats.gns import GNS_SCHEMA_WITHOUT_SPREAD, GradientNoiseScale
from adaptdl.core.stats.profiler import Profiler
from adaptdl.core.validate import check_float

# The estimator's schema before progress moved here; its JSON held the progress.
_GNS_SCHEMA_WITH_PROGRESS = "adaptdl.gns/1"


def _estimator_name(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"estimator must be a non-empty name, got {value!r}")
    return value


def _floor_config(value: Any) -> FloorConfig:
    if not isinstance(value, FloorConfig):
        raise ValueError(f"floor must be a FloorConfig, got {value!r}")
    return value


@attrs.frozen
class MetricsConfig:
    """The configuration of a job's metrics: which estimator, and the loss floor's.

    ``estimator`` names a constructor of the registry the job is given
    (`adaptdl.core.stats.estimators`; the name is checked against it where the
    `MetricsState` is made). ``floor`` configures the loss floor, an EXPERIMENTAL
    component that acts only where the program reports its training loss.
    """

    estimator: str = attrs.field(default=DEFAULT_ESTIMATOR, converter=_estimator_name)
    floor: FloorConfig = attrs.field(factory=FloorConfig, converter=_floor_config)


class MetricsState(JsonState):
    """The job's `GradientNoiseScale` (once a training loader exists), progress and `Profiler`.

    ``progress`` is the job's scale-invariant progress: optimiser steps, each
    weighted by its gain (initial-batch-size steps that would have made the same
    progress). It belongs to the job, not to the estimator: the estimator may be
    made anew (another parameter-group shape) or reset without losing it.

    ``floor`` exists once the program reports its training loss (`observe_loss`):
    the goodput model the decision reads then credits the noise floor a batch keeps
    (`adaptdl.core.stats.floor`, EXPERIMENTAL) while the losses keep coming, unless
    ``config.floor`` is disabled. `grad_params` stays the estimator's own.

    The estimator is made by the constructor ``config.estimator`` names in
    ``estimators`` (the declared factory; ValueError naming the value and the
    registered names for an unknown one).
    """

    def __init__(
        self,
        name: str = "adaptdl-metrics",
        *,
        config: MetricsConfig | None = None,
        estimators: Mapping[str, EstimatorFactory] = ESTIMATORS,
    ) -> None:
        self.name = name
        self.config = MetricsConfig() if config is None else config
        self._make_estimator = estimator_factory(self.config.estimator, estimators)
        self.gns: GradientNoiseScale | None = None
        self.progress = 0.0
        self.profiler = Profiler()
        self.floor: LossFloor | None = None
        self._loss_reporter: str | None = None  # not saved: claimed anew after a restart
        self._credited_step: int | None = None  # not saved: step counts restart with the process

    def ensure_gns(self, init_batch_size: int, num_groups: int = 1) -> GradientNoiseScale:
        """The gradient-noise estimator for this shape, made anew if needed."""
        gns = self.gns
        shape = (init_batch_size, num_groups)
        if gns is None or (gns.init_batch_size, gns.num_groups) != shape:
            gns = self._make_estimator(init_batch_size, num_groups)
            if (gns.init_batch_size, gns.num_groups) != shape:
                raise ValueError(
                    f"estimator {self.config.estimator!r} made one for (init_batch_size, "
                    f"num_groups) {(gns.init_batch_size, gns.num_groups)}, asked for {shape}"
                )
            self.gns = gns
        return gns

    def add_progress(self, gain: float, *, step: int | None = None) -> None:
        """Add one optimiser step worth ``gain`` initial-batch steps (> 0) to the progress.

        ``step`` names the job's step (its count of step boundaries): a job that
        trains several models (a GAN) steps each model's optimiser once per batch,
        and that batch is one step of progress, credited at its first commit.
        """
        gain = check_float("gain", gain, min=0.0, min_exclusive=True)
        if step is not None:
            if step == self._credited_step:
                return
            self._credited_step = step
        self.progress += gain
        if self.floor is not None:
            self.floor.idle_step()

    def grad_params(self) -> GradParams | None:
        """The estimator's statistics (None before its first update)."""
        return self.gns.grad_params() if self.gns is not None else None

    def model_grad_params(self) -> GradParams | None:
        """The noise statistics the goodput model uses (`goodput_fn`): the estimator's,
        with the floor's share credited (None before its first update)."""
        return self._credited(self.grad_params())

    def claim_loss(self, reporter: str) -> None:
        """Let ``reporter`` (a model's name) report the job's training loss: one per job,
        since the floor is the job's (a second, e.g. a GAN's other model, is a
        ValueError naming both)."""
        if self._loss_reporter not in (None, reporter):
            raise ValueError(
                f"{reporter!r} reports its training loss, but {self._loss_reporter!r} "
                "already does: the noise floor is the job's, report one model's loss"
            )
        self._loss_reporter = reporter

    def observe_loss(
        self,
        loss: float,
        rates: Sequence[float],
        batch_size: float,
        target_loss: float | None = None,
    ) -> None:
        """Fold one step's training ``loss`` into the floor (`LossFloor.observe`, made
        at the first call from ``config.floor``), at the job's progress now (None: no
        target stated). Nothing where the floor is disabled: no floor is made."""
        if not self.config.floor.enabled:
            return
        if self.floor is None:
            self.floor = self.config.floor.make()
        self.floor.observe(loss, rates, self.gns, batch_size, target_loss, self.progress)

    def floor_share(self) -> float:
        """The floor's share the decision credits at the estimate now (0 without one)."""
        return self.floor.share_at(self.grad_params()) if self.floor is not None else 0.0

    def _credited(self, params: GradParams | None) -> GradParams | None:
        return params if self.floor is None else self.floor.credit(params)

    # -- the goodput model these metrics make ------------------------------------------
    def goodput_fn(self, init_batch_size: int) -> GoodputFunction | None:
        """The goodput model fitted so far, or None before enough has been profiled.

        Its noise scale credits the floor's share, if any (`shared_params`).
        """
        return self.profiler.goodput_fn(self.model_grad_params(), init_batch_size)

    def bound_goodput_fn(self, z: float, init_batch_size: int) -> GoodputFunction | None:
        """`goodput_fn` with the noise scale at its lower confidence bound (``z`` errors).

        None where `goodput_fn` is None or there is no noise estimate yet.
        """
        bound = self._credited(self.gns.grad_params_bound(z) if self.gns is not None else None)
        return None if bound is None else self.profiler.goodput_fn(bound, init_batch_size)

    def estimate_samples(self) -> float:
        """Samples in the gradient-noise estimate since it last restarted (0: none yet)."""
        return self.gns.samples if self.gns is not None else 0.0

    def gradient_resolved(self) -> bool:
        """Whether the gradient-noise estimate resolves a gradient (True without one)."""
        gns = self.gns
        return gns is None or not gns.has_estimate or gns.resolved

    def to_json(self) -> dict[str, Any]:
        return {
            "gns": self.gns.to_json() if self.gns is not None else None,
            "progress": self.progress,
            "profiler": self.profiler.to_json(),
            "floor": self.floor.to_json() if self.floor is not None else None,
        }

    def load_json(self, data: dict[str, Any]) -> None:
        gns = data["gns"]
        progress = data.get("progress", 0.0)
        if isinstance(gns, dict) and gns.get("schema") == _GNS_SCHEMA_WITH_PROGRESS:
            # Written before progress moved out of the estimator.
            gns = {k: v for k, v in gns.items() if k != "progress"} | {
                "schema": GNS_SCHEMA_WITHOUT_SPREAD
            }
            progress = data["gns"].get("progress", 0.0)
        self.gns = GradientNoiseScale.from_json(gns) if gns is not None else None
        self.progress = check_float("progress", progress, min=0.0)
        self.profiler = Profiler.from_json(data["profiler"])
        # Absent in a checkpoint written before the floor was kept, or by a program
        # that reports no loss.
        floor = data.get("floor")
        try:
            self.floor = LossFloor.from_json(floor) if floor is not None else None
        except (TypeError, ValueError) as err:
            raise ValueError(f"the metrics state's floor: {err}") from err
        if not self.config.floor.enabled:
            self.floor = None  # checked, but a job configured without the floor credits none
