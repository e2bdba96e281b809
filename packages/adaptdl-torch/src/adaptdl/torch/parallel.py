"""`AdaptiveDataParallel`: DistributedDataParallel whose gradients feed core's step contract.

What it shares with the sharded wrapper (gradient statistics, accumulation, the
learning-rate factors, metrics) is `adaptdl.torch.stepping.AdaptiveSteps`; here is
what is DDP's own: a hook on the forward pass's outputs that starts each backward
pass's bookkeeping, accumulation micro-batches run under ``no_sync`` (DDP reads
``require_backward_grad_sync`` in forward), and where a measured step finds its
norms. DDP reduces the gradients by itself, with no communication hook of ours
(its own C++ path divides each gradient as it copies it into its bucket; a Python
hook costs another pass over the gradients, and a call into Python per bucket, on
every step): on a measured step of one micro-batch per replica the replica's own
gradients are still in ``.grad`` when the backward pass's bookkeeping ends, before
DDP's callback writes the reduced ones there, so the local norms are one fused
norm per parameter group of ``.grad`` then, and the total norms the same after the
reduction. Gradient hooks, armed only for the measured steps that need them, serve
where ``.grad`` cannot: accumulation micro-batches, a preconditioned gradient,
and ``gradient_as_bucket_view=True`` (``.grad`` is then the bucket being reduced).
"""

from __future__ import annotations

from typing import Any

import torch
from adaptdl.torch._context import current_job
from adaptdl.torch.scaling_rules import ScalingRuleBase
from adaptdl.torch.state import StateDictState
from adaptdl.torch.stepping import (
    AdaptiveSteps,
    check_arguments,
    register_grad_hooks,
    set_step_attr,
)
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_leaves

__all__ = ["AdaptiveDataParallel"]


class AdaptiveDataParallel(DistributedDataParallel, AdaptiveSteps):
    """A DistributedDataParallel that adapts to the job's batch size and survives restarts.

    ``optimizer`` must hold the model's parameters. ``lr_scheduler`` and
    ``mp_scaler`` (a ``torch.amp.GradScaler``) are checkpointed with the model and
    optimiser under ``name``, and restored now if the job resumed from a checkpoint.
    ``scaling_rule`` (default `AdaScale`) scales the learning rate with the batch
    size. Other keyword arguments go to DistributedDataParallel.

    ``backward()`` must run inside an `AdaptiveDataLoader` loop: outside one it
    raises RuntimeError. A communication hook of your own (``register_comm_hook``)
    is DDP's as usual: the statistics read the gradients before it and what it
    leaves in ``.grad``.
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
        # The gradient hooks, armed only for a measured step that needs them.
        self._hook_params = [
            (i, p) for i, group in enumerate(optimizer.param_groups) for p in group["params"]
        ]
        # With its own buckets DDP copies the local gradients out of .grad and writes
        # the reduced ones back after the backward pass; as views of the buckets,
        # .grad is reduced in place meanwhile.
        self._local_in_grads = not self.gradient_as_bucket_view
        self._patch_optimizer(optimizer)
        if mp_scaler is not None:
            self._patch_scaler(mp_scaler)

    __setattr__ = set_step_attr

    # -- forward: skip gradient synchronisation on accumulation steps ------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # DDP reads this flag in forward to decide whether the backward all-reduces.
        self.require_backward_grad_sync = not self._job.accumulating()
        grad = torch.is_grad_enabled()
        if grad and self._measuring is None:
            self._plan_step(armable=True)
        output = super().forward(*inputs, **kwargs)  # type: ignore[no-untyped-call]
        if grad:
            # Each backward pass's bookkeeping starts when the outputs' gradients arrive.
            hooked = False
            for leaf in tree_leaves(output):
                if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                    leaf.register_hook(self._output_hook)  # type: ignore[no-untyped-call]
                    hooked = True
            if not hooked and not self._hook_handles:
                # Outputs torch cannot look into: the parameters' hooks start it instead.
                self._hook_handles = register_grad_hooks(self, self._hook_params)
        return output

    def _output_hook(self, grad: torch.Tensor) -> None:
        if not self._in_backward:
            self._begin_backward()

    def _will_sync(self) -> bool:
        return bool(self.require_backward_grad_sync)
