"""Learning-rate scaling rules for adaptive batch sizes, applied to an optimiser's groups.

The math is core's (`adaptdl.core.scaling`); these classes feed it the job's gain,
scale and progress and say by how much each parameter group's learning rate is
multiplied at the optimiser step. The learning rate the user (or an LR scheduler)
set stays the base rate; the factor only applies during ``optimizer.step()``.
"""

from __future__ import annotations

from typing import Any

from adaptdl.core import scaling
from adaptdl.core._validate import check_float, check_int
from adaptdl.core.gns import GradientNoiseScale

__all__ = ["AdaScale", "AdamScale", "LEGWScale", "LinearScale", "ScalingRuleBase", "SqrtScale"]


class ScalingRuleBase:
    """A rule: the learning-rate factor at ``scale`` = batch size / initial batch size."""

    def _core(self, init_batch_size: int) -> Any:
        raise NotImplementedError

    def lr_factor(self, gns: GradientNoiseScale, scale: float) -> float:
        """The multiplier of every group's base learning rate for a step at ``scale``."""
        rule = self._core(gns.init_batch_size)
        return float(rule.lr_factor(gns.gain(scale), scale, gns.progress))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class AdaScale(ScalingRuleBase):
    """AdaScale (Johnson et al., 2020): multiply the learning rate by the gain (for SGD)."""

    def _core(self, init_batch_size: int) -> Any:
        return scaling.AdaScale()


class AdamScale(ScalingRuleBase):
    """AdaScale for Adam-like optimisers: multiply the learning rate by ``sqrt(gain)``."""

    def _core(self, init_batch_size: int) -> Any:
        return scaling.AdamScale()


class LinearScale(ScalingRuleBase):
    """Linear scaling (Goyal et al., 2017): multiply the learning rate by the scale."""

    def _core(self, init_batch_size: int) -> Any:
        return scaling.LinearScale()


class SqrtScale(ScalingRuleBase):
    """Square-root scaling: multiply the learning rate by ``sqrt(scale)``."""

    def _core(self, init_batch_size: int) -> Any:
        return scaling.SqrtScale()


class LEGWScale(ScalingRuleBase):
    """Linear-epoch gradual warmup (You et al., 2019) over ``base_warmup_epochs * scale`` epochs.

    ``data_size`` is the number of samples in one epoch. Raises ValueError for a
    negative ``base_warmup_epochs`` or a ``data_size`` below 1.
    """

    def __init__(self, base_warmup_epochs: float, data_size: int) -> None:
        self.base_warmup_epochs = check_float("base_warmup_epochs", base_warmup_epochs, min=0.0)
        self.data_size = check_int("data_size", data_size, min=1)

    def _core(self, init_batch_size: int) -> Any:
        return scaling.LEGWScale(self.base_warmup_epochs, self.data_size, init_batch_size)

    def __repr__(self) -> str:
        return (
            f"LEGWScale(base_warmup_epochs={self.base_warmup_epochs}, data_size={self.data_size})"
        )
