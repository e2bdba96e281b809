"""Learning-rate scaling rules for adaptive batch sizes, applied to an optimiser's groups.

The math is core's (`adaptdl.core.stats.scaling`) and so is the step's decision
(`adaptdl.core.stats.step`, the one way to a step's learning-rate factor); these
classes name the rule a model is trained with and build core's rule for the job's
initial batch size (`ScalingRuleBase.step_rule`). The learning rate the user
(or an LR scheduler) set stays the base rate; the factor only applies during
``optimizer.step()``.
"""

from __future__ import annotations

from typing import ClassVar

from adaptdl.core.stats import scaling
from adaptdl.core.validate import check_bool, check_float, check_int

__all__ = ["AdaScale", "AdamScale", "LEGWScale", "LinearScale", "ScalingRuleBase", "SqrtScale"]


class ScalingRuleBase:
    """A rule: the learning-rate factor at ``scale`` = batch size / initial batch size.

    The built-in rules name core's. A rule of one's own, as in the original AdaptDL,
    subclasses this and overrides `scale_lr`; its factor at each step's scale is
    handed to core as a value (`adaptdl.core.stats.scaling.GivenFactor`).
    """

    #: Core's rule, for rules that need no configuration.
    _core_rule: ClassVar[type[scaling.ScalingRule] | None] = None

    def scale_lr(self, scale: float) -> float:
        """The learning-rate factor at ``scale`` (total batch size over the initial
        one): override it for a rule of one's own. It is called once per optimiser
        step and must return a finite real number >= 0."""
        raise NotImplementedError(
            f"{type(self).__name__} implements no scale_lr(scale): a rule of one's own "
            "overrides it"
        )

    def _own_scale_lr(self) -> bool:
        """Whether this rule's factor is its own `scale_lr` (a user's subclass)."""
        return type(self).scale_lr is not ScalingRuleBase.scale_lr

    def core_rule_type(self) -> type[scaling.ScalingRule] | None:
        """The class of core's rule, known before the job's initial batch size (None:
        a rule core does not know, one's own `scale_lr` included)."""
        return None if self._own_scale_lr() else self._core_rule

    def core_rule(self, init_batch_size: int) -> scaling.ScalingRule:
        """Core's rule for a job whose initial batch size is ``init_batch_size``."""
        if self._core_rule is None:
            raise NotImplementedError(
                f"{type(self).__name__} names no core rule and implements no scale_lr(scale)"
            )
        return self._core_rule()

    def step_rule(self, init_batch_size: int, scale: float) -> scaling.ScalingRule:
        """Core's rule for one step at ``scale``: this rule's own `scale_lr` factor as a
        value where a subclass overrides it, else `core_rule`. Raises TypeError or
        ValueError naming the rule where `scale_lr` returns no finite real >= 0."""
        if not self._own_scale_lr():
            return self.core_rule(init_batch_size)
        value = self.scale_lr(scale)
        try:
            return scaling.GivenFactor(value)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{type(self).__name__}.scale_lr({scale!r}): {exc}") from None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class AdaScale(ScalingRuleBase):
    """AdaScale (Johnson et al., 2020): multiply the learning rate by the gain (for SGD)."""

    _core_rule = scaling.AdaScale


class AdamScale(ScalingRuleBase):
    """AdaScale for Adam-like optimisers: multiply the learning rate by ``sqrt(gain)``.

    ``preconditioned``: estimate the gradient noise (the gain, and the efficiency
    the batch-size decision weighs) of Adam's preconditioned gradient
    ``g / (sqrt(v_hat) + eps)``, as the original AdaptDL does, instead of the raw
    gradient's (the default). The preconditioner is itself measured at the
    current batch size: while ``v_hat`` holds mostly noise, the preconditioned
    noise scale weights each coordinate by its signal-to-noise ratio and reads far
    below what the same training reads at a larger batch (4-5 samples at 16 against
    27-81 at 64 on a Dyck transformer), so the decision never leaves a small initial
    batch. The raw gradient's noise scale does not depend on the batch it is
    measured at (`docs/ARCHITECTURE.md`, "The batch-size rule").
    """

    _core_rule = scaling.AdamScale

    def __init__(self, *, preconditioned: bool = False) -> None:
        self.preconditioned = check_bool("preconditioned", preconditioned)

    def __repr__(self) -> str:
        return "AdamScale(preconditioned=True)" if self.preconditioned else "AdamScale()"


class LinearScale(ScalingRuleBase):
    """Linear scaling (Goyal et al., 2017): multiply the learning rate by the scale."""

    _core_rule = scaling.LinearScale


class SqrtScale(ScalingRuleBase):
    """Square-root scaling: multiply the learning rate by ``sqrt(scale)``."""

    _core_rule = scaling.SqrtScale


class LEGWScale(ScalingRuleBase):
    """Linear-epoch gradual warmup (You et al., 2019) over ``base_warmup_epochs * scale`` epochs.

    ``data_size`` is the number of samples in one epoch. Raises ValueError for a
    negative ``base_warmup_epochs`` or a ``data_size`` below 1.
    """

    def __init__(self, base_warmup_epochs: float, data_size: int) -> None:
        self.base_warmup_epochs = check_float("base_warmup_epochs", base_warmup_epochs, min=0.0)
        self.data_size = check_int("data_size", data_size, min=1)

    def core_rule_type(self) -> type[scaling.ScalingRule]:
        return scaling.LEGWScale

    def core_rule(self, init_batch_size: int) -> scaling.ScalingRule:
        return scaling.LEGWScale(self.base_warmup_epochs, self.data_size, init_batch_size)

    def __repr__(self) -> str:
        return (
            f"LEGWScale(base_warmup_epochs={self.base_warmup_epochs}, data_size={self.data_size})"
        )
