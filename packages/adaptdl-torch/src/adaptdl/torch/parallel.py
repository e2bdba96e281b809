"""`AdaptiveDataParallel`: DistributedDataParallel whose gradients feed core's step contract.

What it shares with the sharded wrapper (gradient statistics, accumulation, the
learning-rate factors, metrics) is `adaptdl.torch.stepping.AdaptiveSteps`; here is
what is DDP's own: a communication hook that measures each flattened bucket before
and after its all-reduce (on the steps core has measured), the gradient hooks armed
only where a bucket cannot serve (accumulation micro-batches, a preconditioned
gradient), a hook on the forward pass's outputs that starts each backward pass's
bookkeeping, and accumulation micro-batches run under ``no_sync`` (DDP reads
``require_backward_grad_sync`` in forward).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from adaptdl.torch._context import current_job
from adaptdl.torch.scaling_rules import ScalingRuleBase
from adaptdl.torch.state import StateDictState
from adaptdl.torch.stepping import (
    AdaptiveSteps,
    _cpu,
    _norms,
    _sqr,
    check_arguments,
    register_grad_hooks,
)
from torch._C._distributed_c10d import GradBucket
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
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
    runs inside the wrapper's, which measures the bucket before it and the tensor
    its future returns; a built-in one (``register_builtin_comm_hook``) cannot be
    combined with it.
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
        self._group_of = {id(p): i for i, p in self._hook_params}
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        # One group holding every trainable parameter: a bucket's norm is that group's.
        self._whole_buckets = self._num_groups == 1 and all(
            id(p) in self._group_of for p in trainable
        )
        self._user_hook: tuple[object, Callable[..., Any]] | None = None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        self._alone = dist.get_world_size(group) == 1
        # A lambda: DDP checks the hook's annotations, which are strings in this module.
        hook = lambda state, bucket: self._comm_hook(state, bucket)  # noqa: E731
        DistributedDataParallel.register_comm_hook(self, None, hook)
        self._fused_norms = True
        self._patch_optimizer(optimizer)
        if mp_scaler is not None:
            self._patch_scaler(mp_scaler)

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

    # -- the buckets' norms --------------------------------------------------------------
    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """Have ``hook(state, bucket)`` reduce the buckets, inside the wrapper's own
        communication hook (which measures the bucket before it and its result after)."""
        self._check_comm_hook(hook)  # type: ignore[no-untyped-call]
        if self._user_hook is not None:
            raise RuntimeError("register_comm_hook can only be called once")
        self._user_hook = (state, hook)

    def _comm_hook(self, state: object, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        if not self._in_backward:
            self._begin_backward()
        if self._buckets_local:
            # Before the reduction, which divides the bucket in place.
            self._measure_bucket(self._bucket_local, bucket, bucket.buffer())
        user = self._user_hook
        if user is not None:
            fut: torch.futures.Future[torch.Tensor] = user[1](user[0], bucket)
        elif self._alone:
            # One replica: the mean is the bucket itself (no pass dividing it by 1).
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
        else:
            fut = allreduce_hook(self.process_group, bucket)
        if not (self._measuring and not self._preconditions()):
            return fut

        def measure_total(done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            reduced = done.value()
            self._measure_bucket(self._bucket_total, bucket, reduced)
            return reduced

        return fut.then(measure_total)

    def _measure_bucket(
        self, parts: list[tuple[int, torch.Tensor]], bucket: GradBucket, flat: torch.Tensor
    ) -> None:
        """Add the squared norm of ``flat`` (``bucket``'s gradients, flattened), per group,
        to ``parts``: one norm for a bucket of one group, else one fused call per group."""
        start = _cpu()
        if self._whole_buckets:
            parts.append((0, _sqr(flat)))
        else:
            params = bucket.parameters()
            sizes = [p.numel() for p in params]
            pieces = torch.split(flat, sizes) if sum(sizes) == flat.numel() else bucket.gradients()
            rows: dict[int, list[torch.Tensor]] = {}
            for param, piece in zip(params, pieces, strict=True):
                group = self._group_of.get(id(param))
                if group is not None:  # a parameter outside the optimiser: not its gradient
                    rows.setdefault(group, []).append(piece)
            for group, row in rows.items():
                parts.append((group, torch.stack(_norms(row)).double().square().sum()))
        self._stat_cost += _cpu() - start
