"""Hugging Face Accelerate with AdaptDL: elastic, exactly-once, adaptive training loops.

An Accelerate program keeps its ``Accelerator`` and its loop; it builds its training
loader as an `AdaptiveDataLoader`, loops over ``remaining_epochs_until(N)`` and
prepares with this module's `prepare` instead of ``accelerator.prepare``::

    accelerator = Accelerator()
    loader = AdaptiveDataLoader(dataset, batch_size=64, shuffle=True)  # total batch size
    model, optimizer, loader, scheduler = adaptdl.torch.accelerate.prepare(
        accelerator, model, optimizer, loader, scheduler
    )
    for epoch in remaining_epochs_until(EPOCHS):
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(loss_fn(model(x), y))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()

What `prepare` does, and why:

* ``accelerator.prepare`` rebuilds a DataLoader around its own sampler, sharded by
  Accelerate's process index, which would read other samples than core's `Shard`
  after a restart at another size. An `AdaptiveDataLoader` is therefore returned
  as it is (marked as prepared, so that a later ``accelerator.prepare`` leaves it
  alone too) and registered with ``accelerator.register_for_checkpointing``, so
  that ``save_state``/``load_state`` carry its position. Other DataLoaders
  (evaluation) are Accelerate's.
* The model is placed and given Accelerate's mixed-precision autocast by
  Accelerate, then wrapped in `AdaptiveDataParallel` (not Accelerate's
  DistributedDataParallel), which measures the gradients for the adaptive batch
  size and applies the scaling rule (AdaScale by default). The wrapped model,
  Accelerate's optimizer and scheduler are the ones ``save_state`` saves.
* The loader decides gradient accumulation (its ``accumulation_steps``);
  ``accelerator.sync_gradients`` follows it, set at each forward pass of the
  model, so Accelerate's optimizer, scheduler and ``accumulate`` step only on
  the loader's optimiser-step micro-batches. Accelerate's own
  ``gradient_accumulation_steps`` must stay 1 (``accelerator.backward`` would
  divide the loss by it, and `AdaptiveDataParallel` already averages the
  accumulated gradients): another value is refused.
* The scheduler steps once per optimiser step whatever the number of replicas
  (Accelerate's ``split_batches`` stepping): the loader's batch size is already
  the total over all replicas.

SIGTERM stops the job as in a plain loop: a checkpoint at the next optimiser-step
boundary, then exit status 143 on every replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from adaptdl.torch._context import current_job
from adaptdl.torch.data import AdaptiveDataLoaderMixin
from adaptdl.torch.parallel import AdaptiveDataParallel
from adaptdl.torch.scaling_rules import ScalingRuleBase
from adaptdl.torch.state import register_state as _register_job_state
from torch.utils.data import DataLoader

try:
    from accelerate import Accelerator
except ImportError as exc:  # an optional extra: say how to get it
    raise ImportError(
        "adaptdl.torch.accelerate needs Hugging Face Accelerate: "
        "pip install 'adaptdl-torch[accelerate]'"
    ) from exc

__all__ = ["prepare", "register_state"]

# Accelerate's data-parallel modes, where each process holds the whole model. The
# others shard it (DeepSpeed, FSDP, Megatron-LM) or run on XLA, which this
# integration does not drive.
_SUPPORTED = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_HPU")


def prepare(
    accelerator: Accelerator,
    *objects: Any,
    scaling_rule: ScalingRuleBase | None = None,
    name: str = "adaptdl-dataparallel",
) -> tuple[Any, ...]:
    """``accelerator.prepare(*objects)`` for a training loop fed by an `AdaptiveDataLoader`.

    ``objects`` are what ``accelerator.prepare`` takes, in any order: exactly one
    model (``torch.nn.Module``) and one optimiser, at most one LR scheduler, and any
    number of DataLoaders. Returns them prepared, as a tuple in the same
    order: each `AdaptiveDataLoader` (or other `AdaptiveDataLoaderMixin` loader)
    unchanged, the model wrapped in `AdaptiveDataParallel` (``scaling_rule`` and
    ``name`` are its arguments), the optimiser and schedulers Accelerate's. If the
    job resumed from a checkpoint, the model, optimiser and first scheduler are
    restored now (a second scheduler would be in no checkpoint). See the module
    docstring for what each gets.

    Raises TypeError when ``accelerator`` is not an ``accelerate.Accelerator`` or
    the model is already wrapped for data parallelism; ValueError when the
    objects do not hold exactly one model and one optimiser or hold several LR
    schedulers, when the
    accelerator's ``gradient_accumulation_steps`` is not 1, when it runs a mode
    that shards the model (DeepSpeed, FSDP, Megatron-LM) or XLA, or when its
    processes are not the job's replicas.
    """
    if not isinstance(accelerator, Accelerator):
        raise TypeError(
            f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}"
        )
    _check_accelerator(accelerator)
    models = [o for o in objects if isinstance(o, torch.nn.Module)]
    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    if len(models) != 1 or len(optimizers) != 1:
        raise ValueError(
            "adaptdl.torch.accelerate.prepare needs exactly one model (torch.nn.Module) and one "
            f"optimizer (torch.optim.Optimizer) among its objects, got {len(models)} models and "
            f"{len(optimizers)} optimizers; prepare other models with accelerator.prepare"
        )
    model, optimizer = models[0], optimizers[0]
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            f"the model is already a {type(model).__name__}: pass the plain module, which "
            "prepare wraps in AdaptiveDataParallel"
        )
    schedulers = [o for o in objects if isinstance(o, torch.optim.lr_scheduler.LRScheduler)]
    if len(schedulers) > 1:
        raise ValueError(
            f"adaptdl.torch.accelerate.prepare takes at most one LR scheduler, got "
            f"{len(schedulers)}: AdaptDL's checkpoint holds one (chain them with "
            "torch.optim.lr_scheduler.ChainedScheduler or SequentialLR)"
        )
    wrapped = _prepare_model(accelerator, model, optimizer, schedulers, scaling_rule, name)
    accelerated = accelerator.prepare_optimizer(optimizer)
    prepared: list[Any] = []
    for obj in objects:
        if obj is model:
            prepared.append(wrapped)
        elif obj is optimizer:
            prepared.append(accelerated)
        elif isinstance(obj, AdaptiveDataLoaderMixin):
            prepared.append(_keep_loader(accelerator, obj))
        elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
            prepared.append(_prepare_scheduler(accelerator, obj))
        elif isinstance(obj, DataLoader):
            prepared.append(accelerator.prepare_data_loader(obj))
        else:
            prepared.append(accelerator.prepare(obj))
    return tuple(prepared)


def register_state(accelerator: Accelerator, name: str, obj: Any) -> None:
    """Put ``obj`` in the job's checkpoint (as `adaptdl.torch.register_state` does) and in
    ``accelerator.save_state``'s (``register_for_checkpointing``).

    ``obj`` needs ``state_dict()`` and ``load_state_dict()``, with a state dict of
    None, bool, int, float, str, tensors and lists, tuples and dicts of them. It
    is restored now if the job resumed from a checkpoint that holds ``name``.
    Raises what `adaptdl.torch.register_state` raises.
    """
    if not isinstance(accelerator, Accelerator):
        raise TypeError(
            f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}"
        )
    _register_job_state(name, obj)
    accelerator.register_for_checkpointing(obj)


def _check_accelerator(accelerator: Accelerator) -> None:
    steps = accelerator.gradient_accumulation_steps
    if steps != 1:
        raise ValueError(
            f"Accelerator(gradient_accumulation_steps={steps}) conflicts with AdaptDL: the "
            "AdaptiveDataLoader decides the accumulation steps (loader.accumulation_steps, "
            "adapted with autoscale_batch_size(..., gradient_accumulation=True)) and "
            "accelerator.sync_gradients follows it; leave gradient_accumulation_steps at 1 and "
            "give the loader the total batch size"
        )
    mode = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
    if mode not in _SUPPORTED:
        raise ValueError(
            f"Accelerator with distributed_type={mode} is not supported by "
            "adaptdl.torch.accelerate: it drives data-parallel modes only "
            f"({', '.join(_SUPPORTED)}); for a sharded model use adaptdl.torch.AdaptiveFSDP "
            "without Accelerate"
        )
    topology = current_job().topology
    if (accelerator.num_processes, accelerator.process_index) != (
        topology.num_replicas,
        topology.rank,
    ):
        raise ValueError(
            f"the Accelerator runs process {accelerator.process_index} of "
            f"{accelerator.num_processes} but the AdaptDL job is replica {topology.rank} of "
            f"{topology.num_replicas}: launch with torchrun, one process per replica"
            + (
                " (without GPUs Accelerate sees torchrun's processes only with "
                "Accelerator(cpu=True))"
                if accelerator.num_processes == 1
                else ""
            )
        )


def _prepare_model(
    accelerator: Accelerator,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    schedulers: Sequence[Any],
    scaling_rule: ScalingRuleBase | None,
    name: str,
) -> AdaptiveDataParallel:
    # Evaluation mode: Accelerate's device placement and autocast without its DDP.
    placed = accelerator.prepare_model(model, evaluation_mode=True)
    kwargs: dict[str, Any] = {}
    handler = getattr(accelerator, "ddp_handler", None)
    if handler is not None:
        kwargs.update(handler.to_kwargs())
    device = accelerator.device
    if device.type not in ("cpu", "meta") and device.index is not None:
        kwargs.setdefault("device_ids", [device.index])
        kwargs.setdefault("output_device", device.index)
    wrapped = AdaptiveDataParallel(
        placed,
        optimizer,
        lr_scheduler=schedulers[0] if schedulers else None,
        mp_scaler=accelerator.scaler,
        scaling_rule=scaling_rule,
        name=name,
        **kwargs,
    )

    # Set before every forward pass, so that whatever reads it (Accelerate's optimizer
    # and scheduler, the user's `if accelerator.sync_gradients:` around clipping or
    # logging) sees the loader's decision for this micro-batch.
    def follow_loader(module: torch.nn.Module, args: Any) -> None:
        accelerator.sync_gradients = not wrapped._job.accumulating()

    wrapped.register_forward_pre_hook(follow_loader)
    # Accelerate's save_state saves the models of its list: the wrapper (which it
    # unwraps like any DDP) in place of the module prepare_model listed.
    models = accelerator._models
    for i, listed in enumerate(models):
        if listed is placed:
            models[i] = wrapped
    wrapped._is_accelerate_prepared = True  # type: ignore[attr-defined]
    return wrapped


def _keep_loader(
    accelerator: Accelerator, loader: AdaptiveDataLoaderMixin
) -> AdaptiveDataLoaderMixin:
    # accelerator.prepare passes a loader marked as prepared through unchanged.
    loader._is_accelerate_prepared = True  # type: ignore[attr-defined]
    if not any(obj is loader for obj in accelerator._custom_objects):
        accelerator.register_for_checkpointing(loader)
    return loader


def _prepare_scheduler(accelerator: Accelerator, scheduler: Any) -> Any:
    prepared = accelerator.prepare_scheduler(scheduler)
    # Without split_batches Accelerate steps the scheduler once per process per
    # optimiser step (it assumes each process adds a batch); the loader's batch size
    # is the total already, so one step per optimiser step at every size.
    prepared.split_batches = True
    return prepared
