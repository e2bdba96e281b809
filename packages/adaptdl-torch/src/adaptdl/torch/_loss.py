"""What `AdaptiveSteps.report_loss` checks and reads of torch objects: the loss's value
and the optimiser's rates for core's noise floor (`adaptdl.core.stats.floor`)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch
from adaptdl.core.stats.floor import check_rule, sgd_rate
from adaptdl.torch.scaling_rules import ScalingRuleBase


def check_loss(loss: Any) -> torch.Tensor | float:
    """``loss`` kept for the step: a float, or a one-element tensor detached (its value
    is read at the optimiser step, before the update, once the step's statistics have
    waited for the device). TypeError or ValueError names anything else."""
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise ValueError(
                "loss must be the batch's mean loss, a tensor of one element, got a tensor "
                f"of shape {tuple(loss.shape)}"
            )
        return loss.detach()
    if isinstance(loss, bool) or not isinstance(loss, numbers.Real):
        raise TypeError(f"loss must be a tensor or a real number, got {loss!r}")
    return float(loss)


def check_floor_optimizer(optimizer: torch.optim.Optimizer, rule: ScalingRuleBase) -> None:
    """ValueError unless the noise floor is defined for ``optimizer`` under ``rule``:
    torch.optim.SGD (without Nesterov), under a rule core's `check_rule` allows."""
    if not isinstance(optimizer, torch.optim.SGD):
        raise ValueError(
            "report_loss credits SGD's noise floor, which is defined for torch.optim.SGD "
            f"only, got {type(optimizer).__name__}: under Adam the noise's weight in the "
            "update is the preconditioner, not a rate (do not report the loss there)"
        )
    if any(group.get("nesterov", False) for group in optimizer.param_groups):
        raise ValueError("report_loss needs SGD without Nesterov momentum, got nesterov=True")
    check_rule(rule.core_rule_type(), repr(rule))


def floor_rates(optimizer: torch.optim.Optimizer, lrs: Sequence[Any] | None = None) -> list[float]:
    """Per parameter group, SGD's rate (`sgd_rate`) at the base learning rates ``lrs``
    (default: the groups' own; a tensor rate is read as a number)."""
    groups = optimizer.param_groups
    rates = [group["lr"] for group in groups] if lrs is None else lrs
    return [
        sgd_rate(float(lr), float(group.get("momentum", 0.0)), float(group.get("dampening", 0.0)))
        for group, lr in zip(groups, rates, strict=True)
    ]


def mean_loss(losses: Sequence[torch.Tensor | float]) -> float:
    """The mean of the finite losses reported since the last step (its micro-batches');
    NaN if none is. One read from the device for all the tensors among them."""
    tensors = [x.reshape(()).float() for x in losses if isinstance(x, torch.Tensor)]
    values = [float(x) for x in losses if not isinstance(x, torch.Tensor)]
    if tensors:
        values += torch.stack(tensors).tolist()
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan
