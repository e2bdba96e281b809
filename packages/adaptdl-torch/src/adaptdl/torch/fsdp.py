"""`AdaptiveFSDP`: adaptive batch size and elastic restarts for models sharded by FSDP2.

For a model too large for one device, shard it with torch's ``fully_shard``
(FSDP2) as usual, then hand it and its optimiser to `AdaptiveFSDP`; it does for
the sharded model what `AdaptiveDataParallel` does for a replicated one (it shares
`adaptdl.torch.stepping.AdaptiveSteps`):

* the gradient-noise statistics: the local gradient of each micro-batch is
  measured on the unsharded parameters (FSDP2 all-gathers them for the forward
  and backward passes; a hook on each sees the replica's own gradient before the
  reduce-scatter), and the reduced gradient's squared norm is the sum over
  replicas of each shard's squared norm (one ``all_reduce`` of one number per
  parameter group), under `AdamScale(preconditioned=True)` of the preconditioned
  gradient;
* accumulation micro-batches run with ``set_requires_gradient_sync(False)``: the
  gradients sum locally and only the step's last micro-batch reduce-scatters;
* the learning-rate scaling rules, bf16 (``MixedPrecisionPolicy``) and a GradScaler,
  exactly as for `AdaptiveDataParallel`;
* checkpoints: every replica writes its own shards of the model and optimiser with
  torch's distributed checkpoint into the job's atomic checkpoint
  (`adaptdl.torch.sharded_state.ShardedState`), and a restart at any other number of
  replicas reshards them.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from adaptdl.torch._context import current_job
from adaptdl.torch.collective import collective_timeout
from adaptdl.torch.scaling_rules import ScalingRuleBase
from adaptdl.torch.sharded_state import AsyncShardedState, ShardedState
from adaptdl.torch.state import StateDictState
from adaptdl.torch.stepping import (
    AdaptiveSteps,
    _cpu,
    _norm,
    _norms,
    _sum_sqr_norms,
    check_arguments,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

__all__ = ["AdaptiveFSDP"]


class AdaptiveFSDP(AdaptiveSteps):
    """Adapts a model already sharded by ``fully_shard`` and its optimiser to the job.

    ``model`` must be an ``FSDPModule`` (``fully_shard`` applied to its root, and
    usually to each block first); ``optimizer`` must hold its (sharded) parameters.
    ``lr_scheduler`` and ``mp_scaler`` are checkpointed beside the sharded model and
    optimiser under ``name``, and everything is restored now, resharded, if the
    job resumed from a checkpoint. ``scaling_rule`` defaults to `AdaScale`;
    under `AdamScale(preconditioned=True)` each replica's local gradient is divided
    by Adam's whole preconditioner, gathered from the sharded optimiser state one
    parameter at a time in the backward pass (one all-gather of ``exp_avg_sq`` per
    micro-batch), and the reduced gradient's shards by the replica's own shard of
    it; a plain `AdamScale` measures the raw gradient and gathers nothing.

    That all-gather costs, per parameter and per micro-batch, as much traffic as
    gathering the parameter itself (``exp_avg_sq`` has its shape), on top of
    FSDP2's own. And being a collective run from each parameter's gradient hook,
    it needs every parameter to receive a gradient on every replica in every
    micro-batch: a trainable parameter one replica leaves unused (a branch not
    taken, an expert not routed to) leaves the others waiting in its all-gather
    until the collective timeout. Use a plain `AdamScale` or `AdaScale` for such models.

    With ``async_checkpoint``, a checkpoint stalls training only while each
    replica copies its shards aside in host memory (a second copy of them, held
    until written); they are written in the background and the checkpoint
    appears, whole, once every replica's files are. The next checkpoint, the
    end of training and a stop wait for it first.

    Call the model as usual (or this object, which calls it); ``backward()`` must
    run inside an `AdaptiveDataLoader` loop.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scaling_rule: ScalingRuleBase | None = None,
        lr_scheduler: Any = None,
        mp_scaler: Any = None,
        name: str = "adaptdl-fsdp",
        async_checkpoint: bool = False,
    ) -> None:
        check_arguments(optimizer, scaling_rule, mp_scaler)
        if not isinstance(async_checkpoint, bool):
            raise TypeError(f"async_checkpoint must be a bool, got {async_checkpoint!r}")
        if not isinstance(model, FSDPModule):
            raise ValueError(
                "model must be sharded by torch.distributed.fsdp.fully_shard (an FSDPModule), "
                f"got {type(model).__name__}; for a replicated model use AdaptiveDataParallel"
            )
        job = current_job()
        self._init_steps(job, optimizer, lr_scheduler, mp_scaler, scaling_rule, name)
        self._sync = True
        in_optimizer = {
            id(p): index
            for index, group in enumerate(optimizer.param_groups)
            for p in group["params"]
        }
        self._group_of = {
            fqn: in_optimizer[id(p)]
            for fqn, p in model.named_parameters()
            if id(p) in in_optimizer
        }
        # The sharded parameters by name (FSDP2 registers them between passes): an
        # unsharded parameter's gradient hook finds its optimiser state through them.
        self._sharded = dict(model.named_parameters())
        self._hooked: set[int] = set()
        self._unsharded: list[torch.Tensor] = []
        # Registered before the optimiser is patched: restoring may initialise its state.
        if async_checkpoint:
            timeout = collective_timeout(job.config)
            job.register(
                AsyncShardedState(name, model, optimizer, self.plain_optimizer, timeout=timeout)
            )
        else:
            job.register(ShardedState(name, model, optimizer, self.plain_optimizer))
        job.register(
            StateDictState(
                f"{name}-extras", {"lr_scheduler": lr_scheduler, "mp_scaler": mp_scaler}
            )
        )
        self.module: torch.nn.Module = model
        self.module.register_forward_pre_hook(self._set_sync)
        for fqn, module in self.module.named_modules():
            if isinstance(module, FSDPModule):
                # After FSDP2's own pre-forward hook (prepended): the parameters are unsharded.
                hook = functools.partial(self._hook_unsharded, fqn)
                torch.nn.Module.register_forward_pre_hook(module, hook)  # type: ignore[arg-type]
        self._patch_optimizer(optimizer)
        if mp_scaler is not None:
            self._patch_scaler(mp_scaler)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward pass."""
        return self.module(*args, **kwargs)

    def _set_sync(self, module: torch.nn.Module, args: Any) -> None:
        self._sync = not self._job.accumulating()
        module.set_requires_gradient_sync(self._sync)  # type: ignore[operator]
        if self._measuring is None and torch.is_grad_enabled():
            self._plan_step(armable=True)

    def _hook_unsharded(self, fqn: str, module: torch.nn.Module, args: Any) -> None:
        # FSDP2 keeps one unsharded parameter object per parameter for the model's
        # life (its storage is freed and refilled), so each is hooked once.
        for name, param in module.named_parameters(prefix=fqn):
            if isinstance(param, DTensor) or id(param) in self._hooked or not param.requires_grad:
                continue
            group = self._group_of.get(name)
            if group is None:
                continue
            hook = functools.partial(self._grad_hook, group, self._sharded.get(name, param))
            param.register_hook(hook)  # type: ignore[no-untyped-call]
            self._hooked.add(id(param))
            self._unsharded.append(param)

    def _grad_hook(self, group: int, param: torch.Tensor, grad: torch.Tensor) -> None:
        """``grad`` is the unsharded gradient of sharded ``param``: this replica's, unreduced."""
        if not self._in_backward:
            self._begin_backward()
        if not self._hook_local:
            # An unmeasured step (the same on every replica), or one replica and one
            # micro-batch: the local gradient is the step's.
            return
        start = _cpu()
        precond = AdaptiveSteps._preconditioner(self, group, param)
        if isinstance(precond, DTensor):
            # Collective, in the same hook order on every replica: the whole
            # preconditioner, one parameter at a time, for the whole local gradient.
            precond = precond.full_tensor()
        self._local_parts[group].append(_norm(grad if precond is None else grad / precond))
        self._stat_cost += _cpu() - start

    def _preconditioner(self, group: int, param: torch.Tensor) -> torch.Tensor | None:
        """Adam's preconditioner of this replica's shard of ``param`` (see AdaptiveSteps)."""
        precond = super()._preconditioner(group, param)
        return precond.to_local() if isinstance(precond, DTensor) else precond

    def _drop_local_gradients(self) -> None:
        # Accumulation without synchronisation leaves the gradients on the unsharded
        # parameters (or, under a reduce dtype, in FSDP2's own accumulator), where
        # the optimiser's zero_grad does not reach.
        for param in self._unsharded:
            param.grad = None
        for module in self.module.modules():
            state = getattr(module, "_get_fsdp_state", lambda: None)()
            group = getattr(state, "_fsdp_param_group", None)
            for fsdp_param in getattr(group, "fsdp_params", ()):
                fsdp_param.unsharded_accumulated_grad = None

    def _will_sync(self) -> bool:
        return self._sync

    def _local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        return grad.to_local() if isinstance(grad, DTensor) else grad

    def _total_norms(self, groups: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Per group, the norm of the full gradient: on one replica its shards' norms
        (the shards are the whole), else the square root of the shard-local squares
        summed over the replicas' shards."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return super()._total_norms(groups)
        squares = [_sum_sqr_norms(_norms(g)) for g in self._preconditioned(groups)]
        device = next((t.device for g in groups for t in g), torch.device("cpu"))
        if dist.get_backend() == "nccl" and device.type == "cpu":
            device = torch.device("cuda", torch.cuda.current_device())
        summed = torch.stack([t.to(device) for t in squares])
        dist.all_reduce(summed)
        return [[t.sqrt()] for t in summed.unbind()]
