"""`AdaptiveFSDP`: adaptive batch size and elastic restarts for models sharded by FSDP2.

For a model too large for one device, shard it with torch's ``fully_shard``
(FSDP2) as usual, then hand it and its optimiser to `AdaptiveFSDP`; it does for
the sharded model what `AdaptiveDataParallel` does for a replicated one (it shares
`adaptdl.torch.stepping.AdaptiveSteps`):

* the gradient-noise statistics, on the steps core has measured: a replica's
  local gradient is measured where FSDP2 flattens it for the reduce-scatter (one
  norm per ``fully_shard`` module, however many tensors it holds, through the
  module's reduce-scatter communication, wrapped for the step), and the reduced
  gradient's squared norm is the sum over replicas of each shard's squared norm
  (one fused norm of the local shards per parameter group, one ``all_reduce`` of
  one number per group). Where a module's flat gradient cannot serve (its
  parameters in several optimiser groups, accumulation micro-batches, a
  preconditioned gradient under `AdamScale(preconditioned=True)`, a reduce dtype
  FSDP2 divides before reducing), gradient hooks on the unsharded parameters
  measure each one, armed only for those steps;
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
import math
from collections.abc import Sequence
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
    _sqr,
    _sum_sqr_norms,
    check_arguments,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

__all__ = ["AdaptiveFSDP"]

#: Dtypes FSDP2 reduce-scatters without dividing the input first (it pre-divides
#: others against overflow, which would scale the norm measured there).
_UNDIVIDED = (torch.float32, torch.bfloat16)


class _MeasuredReduceScatter:
    """A ``fully_shard`` module's reduce-scatter, wrapped for one measured step: the
    squared norm of the flat local gradient it is handed goes to ``steps`` (as the
    local norm of optimiser group ``group``), then ``inner`` reduces it."""

    def __init__(self, inner: Any, steps: AdaptiveFSDP, group: int) -> None:
        self.inner = inner
        self.steps = steps
        self.group = group

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        tensor: torch.Tensor = self.inner.allocate(size, dtype=dtype, device=device)
        return tensor

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        self.steps._measure_flat(self.group, input_tensor)
        return self.inner(output_tensor, input_tensor, group, op, async_op)


def _holders(grad: torch.Tensor | None) -> int:
    """How many replicas hold the same values as this one's part of ``grad``: the
    product of the sizes of its mesh's replicated dimensions (HSDP's replicate
    dimension); 1 for a plain tensor."""
    if not isinstance(grad, DTensor):
        return 1
    mesh = grad.device_mesh
    return math.prod(
        mesh.size(i) for i, place in enumerate(grad.placements) if place.is_replicate()
    )


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
        # FSDP2's parameter groups (one per ``fully_shard`` module, usually): per group,
        # its trainable parameters as (optimiser group, sharded parameter, FSDPParam),
        # and the optimiser group its flat gradient belongs to (None: not one alone).
        self._fsdp_groups: list[tuple[Any, list[tuple[int, torch.Tensor, Any]], int | None]] = []
        # The unsharded parameters seen (FSDP2 keeps one object per parameter for the
        # model's life, its storage freed and refilled) and those armed this step.
        self._unsharded: list[torch.Tensor] = []
        self._seen: set[int] = set()
        self._armed: set[int] = set()
        # The reduce-scatter communications replaced for the step under way.
        self._wrapped_comms: list[tuple[Any, Any]] = []
        self._flat_dtype_ok = True  # whether every flat gradient of the step could be measured
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
        # Each backward pass's bookkeeping starts when the outputs' gradients arrive.
        self.module.register_forward_hook(self._hook_outputs)
        in_optimizer = {
            id(p): index
            for index, group in enumerate(optimizer.param_groups)
            for p in group["params"]
        }
        world = dist.get_world_size() if dist.is_initialized() else 1
        fused = True
        for module in self.module.modules():
            if not isinstance(module, FSDPModule):
                continue
            groups = module._get_fsdp_state()._fsdp_param_groups
            for param_group in groups:
                params: list[tuple[int, torch.Tensor, Any]] = [
                    (in_optimizer.get(id(fp.sharded_param), -1), fp.sharded_param, fp)
                    for fp in param_group.fsdp_params
                    if fp.sharded_param.requires_grad
                ]
                owners = {index for index, _, _ in params}
                owner = owners.pop() if len(owners) == 1 and -1 not in owners else None
                self._fsdp_groups.append((param_group, params, owner))
                # The flat gradient is the whole local gradient only where the module
                # reduce-scatters over every replica (not HSDP's replicas) by itself.
                size = getattr(param_group.mesh_info, "shard_mesh_size", None)
                fused &= len(groups) == 1 and size == world and (owner is not None or not params)
            # After FSDP2's own pre-forward hook (prepended): the parameters are unsharded.
            end = len(self._fsdp_groups)
            hook = functools.partial(self._hook_unsharded, end - len(groups), end)
            torch.nn.Module.register_forward_pre_hook(module, hook)
        self._fused_norms = fused and world > 1
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

    def _hook_unsharded(self, first: int, end: int, module: torch.nn.Module, args: Any) -> None:
        """Arm the gradient hooks of ``module``'s unsharded parameters (its FSDP2
        parameter groups are ``_fsdp_groups[first:end]``) for a step that measures them."""
        for _, params, _ in self._fsdp_groups[first:end]:
            for group, sharded, fsdp_param in params:
                if not hasattr(fsdp_param, "_unsharded_param"):
                    continue  # not gathered (yet)
                param = fsdp_param.unsharded_param
                if id(param) not in self._seen:
                    self._seen.add(id(param))
                    self._unsharded.append(param)
                if not self._hook_local or group < 0 or id(param) in self._armed:
                    continue
                self._armed.add(id(param))
                hook = functools.partial(self._grad_hook, group, sharded)
                self._hook_handles.append(param.register_hook(hook))

    def _hook_outputs(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        hooked = False
        for leaf in tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(self._output_hook)  # type: ignore[no-untyped-call]
                hooked = True
        if not hooked:
            # Outputs torch cannot look into: the parameters' hooks start it instead.
            for param in self._unsharded:
                if id(param) not in self._armed:
                    self._armed.add(id(param))
                    hook = functools.partial(self._grad_hook, -1, param)
                    self._hook_handles.append(param.register_hook(hook))  # type: ignore[no-untyped-call]

    def _output_hook(self, grad: torch.Tensor) -> None:
        if not self._in_backward:
            self._begin_backward()

    def _arm_hooks(self, armable: bool) -> bool:
        # Each module's pre-forward arms its own parameters' hooks (`_hook_unsharded`),
        # after the root's plans the step: too late once the backward pass started.
        return armable

    def _arm_buckets(self) -> None:
        """Wrap each module's reduce-scatter for the step under way (see `_measure_flat`)."""
        if self._wrapped_comms:
            return
        for param_group, _, owner in self._fsdp_groups:
            if owner is None:
                continue
            inner = param_group._reduce_scatter_comm
            param_group._reduce_scatter_comm = _MeasuredReduceScatter(inner, self, owner)
            self._wrapped_comms.append((param_group, inner))

    def _disarm(self) -> None:
        super()._disarm()
        self._armed = set()
        for param_group, inner in self._wrapped_comms:
            param_group._reduce_scatter_comm = inner
        self._wrapped_comms = []

    def _buckets_whole(self) -> bool:
        whole, self._flat_dtype_ok = self._flat_dtype_ok, True
        return whole

    def _measure_flat(self, group: int, flat: torch.Tensor) -> None:
        """Add the squared norm of a module's flat local gradient (padding is zeros) to
        the local norms of optimiser group ``group``."""
        if not self._buckets_local:
            return
        start = _cpu()
        if flat.dtype not in _UNDIVIDED:
            # FSDP2 divided it first: measured by the hooks from the next step on.
            self._flat_dtype_ok = self._fused_norms = False
        else:
            self._bucket_local.append((group, _sqr(flat)))
        self._stat_cost += _cpu() - start

    def _grad_hook(self, group: int, param: torch.Tensor, grad: torch.Tensor) -> None:
        """``grad`` is the unsharded gradient of sharded ``param``: this replica's, unreduced
        (``group`` -1: a hook that only starts the backward pass's bookkeeping)."""
        if not self._in_backward:
            self._begin_backward()
        if not self._hook_local or group < 0:
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

    def _total_squares(self, groups: list[list[torch.Tensor]]) -> tuple[list[torch.Tensor], bool]:
        """Per group, the squared norm of this replica's shards of the reduced gradient:
        a part, which core sums over the replicas with the local norms (no collective
        here); on one replica the shards are the whole.

        Under HSDP each shard is held by every replica of the mesh's replicate
        dimension, so each replica's part counts its shards' squares over that many:
        summed over the replicas, every shard counts once.
        """
        squares = []
        for grads, params in zip(self._preconditioned(groups), self._grad_params(), strict=True):
            norms = _norms(grads)
            holders = [_holders(p.grad) for p in params]
            if any(h > 1 for h in holders):
                norms = [n / h**0.5 for n, h in zip(norms, holders, strict=True)]
            squares.append(_sum_sqr_norms(norms))
        return squares, self._job.topology.num_replicas > 1
