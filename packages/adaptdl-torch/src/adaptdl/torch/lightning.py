"""PyTorch Lightning on AdaptDL: `AdaptiveStrategy`, a ``Trainer`` strategy.

Pass ``Trainer(strategy=AdaptiveStrategy())``, have the ``LightningDataModule``'s
``train_dataloader()`` return an `adaptdl.torch.AdaptiveDataLoader`, and launch
with ``torchrun``: training is elastic (SIGTERM checkpoints at the next
optimiser step and exits 143; a relaunch at any number of replicas resumes
with every sample of the epoch consumed once) and the batch size adapts
(``loader.autoscale_batch_size``), with AdaScale on the learning rate.

The strategy is Lightning's ``DDPStrategy`` whose model is an
`AdaptiveDataParallel` and whose training loop is the loader's own: every
decision (batch size, accumulation, learning-rate factor, when the epoch's loop
ends, when to stop) is adaptdl.core's, exactly as without Lightning. What it adds:

- Epochs: Lightning's epoch ``e`` runs as AdaptDL's epoch ``e``
  (`adaptdl.torch.remaining_epochs_until` driven from Lightning's loop), and
  Lightning's epoch ends when the loader's loop ends (Lightning sees the loader
  as one of unknown length and fetches one batch at a time, after the previous
  one was trained).
- Accumulation: the strategy handles it (``handles_gradient_accumulation``):
  Lightning calls the optimiser every micro-batch, and the loader decides which
  micro-batches only accumulate. Lightning's ``accumulate_grad_batches`` must stay
  1 (ValueError otherwise): set the per-replica bound and allow accumulation with
  ``loader.autoscale_batch_size(max, (lo, hi), gradient_accumulation=True)``.
- LR schedulers: Lightning steps them as usual, an ``"epoch"`` one once per epoch
  and a ``"step"`` one once per optimiser step (not per accumulation
  micro-batch; a ``frequency`` counts optimiser steps); the AdaScale factor
  multiplies the scheduled rate during each step.
- SIGTERM and SIGINT are AdaptDL's (Lightning's own SIGTERM handling, which would
  exit before a checkpoint, is replaced once training starts).
- Checkpoints. AdaptDL's checkpoints (``ADAPTDL_CHECKPOINT_PATH``) are what a
  restart resumes from. Beside the model, optimiser, AMP scaler and the loader's
  position, they hold Lightning's trainer state (its checkpoint without the model
  and optimiser: loops, callbacks such as ``ModelCheckpoint``, LR schedulers,
  precision plugin, datamodule), which Lightning restores through its own
  checkpoint connector, so ``trainer.current_epoch``, ``trainer.global_step``
  and callbacks continue where they stopped. Lightning's own checkpoints
  (``ModelCheckpoint``, ``trainer.save_checkpoint``) stay ordinary Lightning
  files and hold the loader's position too (the loader is stateful for
  Lightning): ``trainer.fit(..., ckpt_path=...)`` in a job without an AdaptDL
  checkpoint resumes from one, mid-epoch included, and AdaptDL's epoch count
  follows Lightning's. When the job did restore its own checkpoint, that one is
  newer and wins: ``ckpt_path`` is then ignored, with a warning.

Not supported (each a ValueError or TypeError naming it when the ``Trainer``
starts): a training loader that is not an ``AdaptiveDataLoader``, several
training loaders, several optimisers, ``accumulate_grad_batches`` other than 1,
``limit_train_batches`` other than 1.0, a fractional ``val_check_interval``
other than 1.0, ``max_steps``, ``gradient_clip_val`` (clipping would act on
each accumulation micro-batch), ``reload_dataloaders_every_n_epochs``, and an
``AdaptiveDataLoader`` for validation, test or prediction (use a plain
``DataLoader``: the strategy turns Lightning's ``use_distributed_sampler`` off,
so every replica evaluates the whole of it unless it brings its own sampler).
``trainer.global_step`` counts Lightning's optimiser calls, one per
micro-batch; `adaptdl.torch.global_step` counts optimiser steps.

``AdaptiveStrategy(report_loss=True)`` reports each training step's loss (what
``training_step`` returns: the loss, or a dict holding it under ``"loss"``) to
`AdaptiveDataParallel.report_loss`, so that the batch-size decision credits SGD's
noise floor (``target_loss`` is passed on); only for ``torch.optim.SGD`` under
AdaScale, refused by name when the ``Trainer`` starts otherwise.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from adaptdl.core.validate import check_bool, check_float
from adaptdl.torch import _signals
from adaptdl.torch._context import current_job, init_process_group, is_initialized
from adaptdl.torch._loss import check_floor_optimizer
from adaptdl.torch.data import AdaptiveDataLoader
from adaptdl.torch.parallel import AdaptiveDataParallel
from adaptdl.torch.scaling_rules import ScalingRuleBase
from adaptdl.torch.state import register_state

try:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.optimizer import _optimizers_to_device
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "adaptdl.torch.lightning needs PyTorch Lightning: pip install 'adaptdl-torch[lightning]'"
    ) from exc

__all__ = ["AdaptiveStrategy"]

# Lightning fetches a batch ahead from a loader without a length (to know the last
# batch), which would count a batch as consumed before it was trained; a sized
# loader is fetched one batch at a time. This length is never reached: the epoch
# ends when the loader's loop does.
UNKNOWN_LENGTH = 2**40

# Lightning's checkpoint keys that AdaptDL's checkpoint holds elsewhere (the model
# wrapper's entry) or that only the program defines (hyperparameters, which may be
# objects that cannot be saved without pickle).
_HELD_ELSEWHERE = frozenset(
    {"state_dict", "optimizer_states", "hyper_parameters", "datamodule_hyper_parameters"}
)


def check_trainer(trainer: Any) -> None:
    """ValueError unless ``trainer``'s settings leave the training loop to AdaptDL."""
    settings: tuple[tuple[str, Any, Callable[[Any], bool], str], ...] = (
        (
            "accumulate_grad_batches",
            trainer.accumulate_grad_batches,
            lambda v: v == 1,
            "1 (AdaptDL decides the accumulation steps: use loader.autoscale_batch_size("
            "max_batch_size, (min_local, max_local), gradient_accumulation=True))",
        ),
        (
            "limit_train_batches",
            trainer.limit_train_batches,
            lambda v: isinstance(v, float) and v == 1.0,  # an int counts batches
            "1.0 (the loader's loop decides where an epoch ends)",
        ),
        ("max_steps", trainer.max_steps, lambda v: v == -1, "-1 (limit training by max_epochs)"),
        (
            "val_check_interval",
            trainer.val_check_interval,
            lambda v: v == 1.0 or (isinstance(v, int) and not isinstance(v, bool)),
            "1.0 or an int number of batches (an epoch's length is not known in advance)",
        ),
        (
            "gradient_clip_val",
            trainer.gradient_clip_val,
            lambda v: v is None or v == 0,
            "None (Lightning would clip each accumulation micro-batch's partial sum; clip in "
            "the LightningModule's configure_gradient_clipping only where "
            "adaptdl.torch.current_dataloader().is_optim_step())",
        ),
        (
            "reload_dataloaders_every_n_epochs",
            trainer.reload_dataloaders_every_n_epochs,
            lambda v: v == 0,
            "0 (the training loader lives for the whole fit)",
        ),
    )
    for name, value, allowed, what in settings:
        if not allowed(value):
            raise ValueError(
                f"AdaptiveStrategy needs Trainer({name}=...) to be {what}, got {value!r}"
            )


def check_train_loader(loader: object) -> AdaptiveDataLoader:
    """``loader`` if it is an `AdaptiveDataLoader`, else TypeError saying what is allowed."""
    if not isinstance(loader, AdaptiveDataLoader):
        raise TypeError(
            "AdaptiveStrategy trains on an adaptdl.torch.AdaptiveDataLoader: the "
            "LightningModule's or LightningDataModule's train_dataloader() must return "
            f"exactly one, got {type(loader).__module__}.{type(loader).__qualname__}"
        )
    return loader


def check_eval_loader(loader: object, stage: str) -> None:
    """TypeError for an `AdaptiveDataLoader` outside training (its loop needs training's)."""
    if isinstance(loader, AdaptiveDataLoader):
        raise TypeError(
            f"AdaptiveStrategy evaluates {stage} batches from plain torch DataLoaders; "
            f"{stage}_dataloader() returned an AdaptiveDataLoader, whose loop would overlap "
            "the training loader's: return a torch.utils.data.DataLoader instead"
        )


_NOTHING = object()


class _TrainIterator:
    """One epoch of the loader's loop, advanced after each batch was trained.

    Lightning asks for batch k+1 only after batch k; the loop's bookkeeping for
    batch k (samples consumed, the step boundary where a stop checkpoints) runs in
    `advance`, called once batch k's optimiser step is done, which fetches batch
    k+1 ahead or finds that the loop ended.
    """

    def __init__(self, owner: TrainLoader) -> None:
        self.owner = owner
        self.batches: Iterator[Any] | None = None
        self.ahead: Any = _NOTHING
        self.snapshot: dict[str, Any] | None = None  # the position while a batch waits
        self.ended = False

    def __iter__(self) -> _TrainIterator:
        return self

    def __next__(self) -> Any:
        if self.ahead is not _NOTHING:
            batch, self.ahead, self.snapshot = self.ahead, _NOTHING, None
            return batch
        if self.ended:
            raise StopIteration
        if self.batches is None:
            self.owner.strategy.enter_epoch()
            self.batches = iter(self.owner.loader)
        try:
            return next(self.batches)
        except StopIteration:
            self.ended = True
            raise

    def advance(self) -> bool:
        """Finish the batch handed out last; False once the loop has ended."""
        if self.batches is None or self.ended or self.ahead is not _NOTHING:
            return not self.ended
        # The position with the trained batch consumed, for a checkpoint taken while
        # the next one waits to be handed out.
        self.snapshot = self.owner.loader.state_dict()
        try:
            self.ahead = next(self.batches)
        except StopIteration:
            self.ended, self.snapshot = True, None
            return False
        return True


class TrainLoader:
    """What Lightning iterates for the training `AdaptiveDataLoader` (see `UNKNOWN_LENGTH`).

    Stateful for Lightning (``state_dict``/``load_state_dict``), so Lightning's
    own checkpoints hold the loader's position.
    """

    def __init__(self, loader: AdaptiveDataLoader, strategy: AdaptiveStrategy) -> None:
        self.loader = loader
        self.strategy = strategy
        self.iterator: _TrainIterator | None = None

    def __len__(self) -> int:
        return UNKNOWN_LENGTH

    def __iter__(self) -> _TrainIterator:
        self.iterator = _TrainIterator(self)
        return self.iterator

    def state_dict(self) -> dict[str, Any]:
        """The loader's position, counting the batches Lightning has trained on."""
        iterator = self.iterator
        if iterator is not None and iterator.snapshot is not None:
            return dict(iterator.snapshot)
        return self.loader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loader.load_state_dict(state_dict)


class _TrainerState:
    """Lightning's checkpoint, less what other entries hold, as a checkpoint entry."""

    def __init__(self, strategy: AdaptiveStrategy) -> None:
        self.strategy = strategy

    def state_dict(self) -> dict[str, Any]:
        trainer = self.strategy.trainer
        full = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        return {k: v for k, v in full.items() if k not in _HELD_ELSEWHERE}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.strategy.restored = dict(state_dict)


def step_loss(outputs: Any) -> torch.Tensor | None:
    """The loss in what ``training_step`` returned (a tensor, or a dict's ``"loss"``);
    None for a batch it skipped (None, which Lightning passes on as ``{}``);
    ValueError naming anything else."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if loss is None:
        return None
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            "AdaptiveStrategy(report_loss=True) needs training_step to return the loss, "
            f"a tensor or a dict with it under 'loss', got {outputs!r}"
        )
    return loss


class _Hooks(pl.Callback):  # type: ignore[misc,unused-ignore]
    """The strategy's per-batch and end-of-training work (a strategy has no such hooks)."""

    def __init__(self, strategy: AdaptiveStrategy) -> None:
        self.strategy = strategy

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Lightning installed its SIGTERM handler in this fit: AdaptDL's acts instead.
        _signals.reinstall()
        # The loader's loop, not a batch count, ends an epoch (see UNKNOWN_LENGTH).
        trainer.fit_loop.max_batches = float("inf")
        interval = trainer.val_check_interval
        if isinstance(interval, float) and interval == 1.0:  # an int 1: after every batch
            trainer.val_check_batch = float("inf")

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = step_loss(outputs) if self.strategy.report_loss else None
        if loss is not None:
            self.strategy.model.report_loss(loss, target_loss=self.strategy.target_loss)
        loader = self.strategy.train_loader
        iterator = loader.iterator if loader is not None else None
        if iterator is not None and not iterator.advance():
            epoch_loop = trainer.fit_loop.epoch_loop
            epoch_loop.batch_progress.is_last_batch = True
            # Lightning steps epoch schedulers after the last batch's training step,
            # before this hook, when it knows the batch is the last: it did not.
            epoch_loop.update_lr_schedulers("epoch", update_plateau_schedulers=False)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.strategy.finish_epochs(trainer)


class AdaptiveStrategy(DDPStrategy):  # type: ignore[misc,unused-ignore]
    """Lightning's DDP strategy with AdaptDL's elastic, adaptive training loop.

    ``scaling_rule`` (default `AdaScale`) scales the learning rate with the batch
    size; the model, optimiser and AMP scaler are checkpointed under ``name`` and
    Lightning's trainer state under ``name + "-trainer"``. Other keyword arguments
    go to ``DDPStrategy`` (``process_group_backend``, ``timeout``, DDP's own).
    Launch with torchrun; the job starts (`adaptdl.torch.init_process_group`) when
    the Trainer sets up its environment, unless the program started it before.
    ``report_loss`` (with ``target_loss``, None: none stated): report each training
    step's loss to `AdaptiveDataParallel.report_loss` (SGD under AdaScale only;
    the loss floor is EXPERIMENTAL).
    """

    def __init__(
        self,
        scaling_rule: ScalingRuleBase | None = None,
        name: str = "adaptdl-lightning",
        *,
        report_loss: bool = False,
        target_loss: float | None = None,
        **kwargs: Any,
    ) -> None:
        if scaling_rule is not None and not isinstance(scaling_rule, ScalingRuleBase):
            raise ValueError(
                "scaling_rule must be one of adaptdl.torch.scaling_rules (AdaScale, AdamScale, "
                f"LinearScale, SqrtScale, LEGWScale) or None, got {scaling_rule!r}"
            )
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        self.report_loss = check_bool("report_loss", report_loss)
        self.target_loss = None if target_loss is None else check_float("target_loss", target_loss)
        if target_loss not in (None, 0.0) and not report_loss:  # 0.0: the old default
            raise ValueError(f"target_loss={target_loss!r} needs report_loss=True")
        super().__init__(**kwargs)
        self.scaling_rule = scaling_rule
        self.name = name
        self.restored: dict[str, Any] | None = None
        self.train_loader: TrainLoader | None = None
        self._registered = False
        self._epochs: Iterator[int] | None = None

    # -- Lightning's strategy interface -------------------------------------------------
    @property
    def handles_gradient_accumulation(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        # Restored from AdaptDL's checkpoint, the optimiser came with the model's entry.
        return self.restored is None

    @property
    def root_device(self) -> torch.device:
        # Under torchrun on CPU, Lightning counts one device however many replicas
        # the node runs: every replica computes on the CPU.
        if self.accelerator is not None and type(self.accelerator).__name__ == "CPUAccelerator":
            return torch.device("cpu")
        device: torch.device = super().root_device
        return device

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        environment = self.cluster_environment
        if environment is not None and environment.creates_processes_externally:
            # torchrun started the replicas and decides how many there are; Lightning's
            # launcher would only check them against Trainer(devices, num_nodes),
            # which cannot follow an elastic job's size.
            self._launcher = None

    @property
    def trainer(self) -> Any:
        module = self.lightning_module
        if module is None or module._trainer is None:
            raise RuntimeError("AdaptiveStrategy is not attached to a Trainer yet")
        return module.trainer

    def setup_environment(self) -> None:
        if not is_initialized():
            init_process_group(self._process_group_backend or self._get_process_group_backend())
        super().setup_environment()
        trainer = self.trainer
        check_trainer(trainer)
        # An AdaptiveDataLoader samples for itself; Lightning must not swap its sampler.
        trainer._accelerator_connector.use_distributed_sampler = False
        self.train_loader = None  # this fit's comes with its setup_data
        if not any(isinstance(cb, _Hooks) for cb in trainer.callbacks):
            trainer.callbacks.append(_Hooks(self))
        if not self._registered:
            register_state(f"{self.name}-trainer", _TrainerState(self))
            self._registered = True
        if self.restored is not None:
            # Lightning restores modules, callbacks, loops and schedulers from it.
            trainer._checkpoint_connector._loaded_checkpoint = self.restored

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        if self.restored is not None:
            warnings.warn(
                f"ckpt_path={checkpoint_path!r} ignored: the job resumed from its AdaptDL "
                f"checkpoint ({current_job().restored_from}), which is newer",
                stacklevel=2,
            )
            return self.restored
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if "state_dict" in checkpoint:  # absent from AdaptDL's entry: the wrapper's holds it
            super().load_model_state_dict(checkpoint, strict=strict)

    def setup(self, trainer: Any) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            super().setup(trainer)
            return
        assert self.accelerator is not None
        model: Any = self.model  # type: ignore[has-type,unused-ignore]
        assert model is not None
        self.accelerator.setup(trainer)
        if self._layer_sync:
            model = self.model = self._layer_sync.apply(model)
        self.precision_plugin.convert_module(model)
        self.model_to_device()
        self.setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(
                "AdaptiveStrategy trains with exactly one optimizer, but configure_optimizers() "
                f"returned {len(self.optimizers)}"
            )
        self.setup_precision_plugin()
        self.model = AdaptiveDataParallel(
            model,
            self.optimizers[0],
            mp_scaler=getattr(self.precision_plugin, "scaler", None),
            scaling_rule=self.scaling_rule,
            name=self.name,
            device_ids=self.determine_ddp_device_ids(),
            **self._ddp_kwargs,
        )
        if self.report_loss:
            check_floor_optimizer(self.optimizers[0], self.model.scaling_rule)
        _optimizers_to_device(self.optimizers, self.root_device)
        _step_schedulers_per_optimizer_step(self.lightning_module, self.lr_scheduler_configs)

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.trainer
        if trainer.training:
            loader = check_train_loader(dataloader)
            if self.train_loader is not None and self.train_loader.loader is not loader:
                raise ValueError(
                    "AdaptiveStrategy trains on one AdaptiveDataLoader, but train_dataloader() "
                    "returned several (a collection of loaders, or another one for this fit)"
                )
            self.train_loader = TrainLoader(loader, self)
            return self.train_loader
        stage = trainer.state.stage
        check_eval_loader(dataloader, stage.dataloader_prefix if stage is not None else "eval")
        return dataloader

    # -- epochs ---------------------------------------------------------------------------
    def enter_epoch(self) -> None:
        """Run AdaptDL's epoch loop up to Lightning's current epoch (a training loop starts)."""
        trainer = self.trainer
        epoch = trainer.current_epoch
        job = current_job()
        if self._epochs is None:
            job.epoch.settle_framework_count(epoch, restored=job.restored_from is not None)
            last = trainer.max_epochs if trainer.max_epochs not in (None, -1) else 2**31
            self._epochs = job.remaining_epochs_until(last)
        # Lightning never enters an epoch at or past ``last``: an ended loop raises here.
        while job.epoch.advances_to(epoch):
            next(self._epochs, None)

    def finish_epochs(self, trainer: Any) -> None:
        """Close AdaptDL's epoch loop; after the last epoch, that writes the final checkpoint."""
        epochs, self._epochs = self._epochs, None
        if epochs is None:
            return
        if trainer.max_epochs not in (None, -1) and trainer.current_epoch >= trainer.max_epochs:
            for extra in epochs:  # the last epoch finishes: drain, final checkpoint
                raise RuntimeError(f"AdaptDL's epoch loop went on to epoch {extra}")
        else:  # stopped early (e.g. EarlyStopping): no epoch is left half-run
            epochs.close()  # type: ignore[attr-defined]


def _step_schedulers_per_optimizer_step(module: Any, configs: Sequence[Any]) -> None:
    """Have ``module``'s ``lr_scheduler_step`` count optimiser steps, not micro-batches.

    Lightning calls the optimiser, and a ``"step"`` scheduler, once per
    micro-batch (the strategy handles accumulation), and counts a scheduler's
    ``frequency`` in micro-batches of the epoch; a scheduler counts optimiser
    steps. So accumulation micro-batches are skipped, and a ``"step"`` scheduler
    of frequency ``f`` steps after every ``f``-th optimiser step of the job
    (`adaptdl.torch.global_step`, which continues across restarts); Lightning's
    own frequency check is set to 1 for it. Epoch schedulers are stepped outside
    the loader's loop, so never skipped.
    """
    every: dict[int, int] = {}
    for config in configs:
        if config.interval == "step" and config.frequency != 1:
            every[id(config.scheduler)] = config.frequency
            config.frequency = 1
    step = getattr(module.lr_scheduler_step, "adaptdl_wrapped", module.lr_scheduler_step)

    def lr_scheduler_step(scheduler: Any, metric: Any) -> None:
        job = current_job()
        if job.accumulating():
            return
        # The step just taken is not counted yet: the loader's step boundary, which
        # counts it, runs when Lightning asks for the next batch.
        if (job.global_step + 1) % every.get(id(scheduler), 1):
            return
        step(scheduler, metric)

    lr_scheduler_step.adaptdl_wrapped = step  # type: ignore[attr-defined]
    module.lr_scheduler_step = lr_scheduler_step
