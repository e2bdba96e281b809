"""`AdaptiveDataParallel`: DistributedDataParallel whose gradients feed core's step contract.

What it shares with the sharded wrapper (gradient statistics, accumulation, the
learning-rate factors, metrics) is `adaptdl.torch.stepping.AdaptiveSteps`; here is
what is DDP's own: the hooks on every parameter, and accumulation micro-batches
run under ``no_sync`` (DDP reads ``require_backward_grad_sync`` in forward).
"""

from __future__ import annotations

from typing import Any

import torch
from adaptdl.torch._context import current_job
from adaptdl.torch.scaling_rules import ScalingRuleBase
from adaptdl.torch.state import StateDictState
from adaptdl.torch.stepping import AdaptiveSteps, check_arguments, register_grad_hooks
from torch.nn.parallel import DistributedDataParallel

__all__ = ["AdaptiveDataParallel"]


class AdaptiveDataParallel(DistributedDataParallel, AdaptiveSteps):
    """A DistributedDataParallel that adapts to the job's batch size and survives restarts.

    ``optimizer`` must hold the model's parameters. ``lr_scheduler`` and
    ``mp_scaler`` (a ``torch.amp.GradScaler``) are checkpointed with the model and
    optimiser under ``name``, and restored now if the job resumed from a checkpoint.
    ``scaling_rule`` (default `AdaScale`) scales the learning rate with the batch
    size. Other keyword arguments go to DistributedDataParallel.

    ``backward()`` must run inside an `AdaptiveDataLoader` loop: outside one it
    raises RuntimeError.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any = None,
        mp_scaler: Any = None,
        scaling_rule: ScalingRuleBase | None = None,
        name: str = "adaptdl-dataparallel",
        **kwargs: Any,
    ) -> None:
        check_arguments(optimizer, scaling_rule, mp_scaler)
        job = current_job()
        super().__init__(model, **kwargs)
        self._init_steps(job, optimizer, lr_scheduler, mp_scaler, scaling_rule, name)
        self._state = StateDictState(
            name,
            {
                "model": self.module,
                "optimizer": optimizer,
                "lr_scheduler": lr_scheduler,
                "mp_scaler": mp_scaler,
            },
        )
        job.register(self._state)
        register_grad_hooks(
            self,
            [(i, p) for i, group in enumerate(optimizer.param_groups) for p in group["params"]],
        )
        self._patch_optimizer(optimizer)
        if mp_scaler is not None:
            self._patch_scaler(mp_scaler)

    # -- forward: skip gradient synchronisation on accumulation steps ------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # DDP reads this flag in forward to decide whether the backward all-reduces.
        self.require_backward_grad_sync = not self._job.accumulating()
        return super().forward(*inputs, **kwargs)  # type: ignore[no-untyped-call]

    def _will_sync(self) -> bool:
        return bool(self.require_backward_grad_sync)
