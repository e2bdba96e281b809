"""AdaptiveStrategy in one process: its checks, its epochs, accumulation, Lightning checkpoints."""

from __future__ import annotations

import collections
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

import lightning.pytorch as pl
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

import adaptdl.torch as adl
import torch
from adaptdl.torch import _context
from adaptdl.torch.lightning import (
    UNKNOWN_LENGTH,
    AdaptiveStrategy,
    TrainLoader,
    check_eval_loader,
    check_train_loader,
    check_trainer,
    step_loss,
)

N = 24
ALLOWED = {
    "accumulate_grad_batches": 1,
    "limit_train_batches": 1.0,
    "max_steps": -1,
    "val_check_interval": 1.0,
    "reload_dataloaders_every_n_epochs": 0,
    "gradient_clip_val": None,
}


@pytest.fixture(autouse=True)
def _fresh_job(fresh_torch_job: None) -> Iterator[None]:
    yield


def dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, 3, generator=gen)
    return TensorDataset(torch.arange(N), x, x.sum(1, keepdim=True))


class Data(pl.LightningDataModule):
    def __init__(self, make: Any = None) -> None:
        super().__init__()
        self.make = make or (lambda: adl.AdaptiveDataLoader(dataset(), batch_size=4, shuffle=True))

    def train_dataloader(self) -> Any:
        return self.make()


class Model(pl.LightningModule):
    def __init__(self, interval: str = "epoch", frequency: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(3, 1)
        self.interval = interval
        self.frequency = frequency
        self.seen: list[tuple[int, list[int]]] = []
        self.lrs: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, x, y = batch
        self.seen.append((self.trainer.current_epoch, idx.tolist()))
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        return torch.nn.functional.mse_loss(self.linear(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {
                "scheduler": scheduler,
                "interval": self.interval,
                "frequency": self.frequency,
            },
        }


def trainer(**kwargs: Any) -> pl.Trainer:
    options: dict[str, Any] = {
        "strategy": AdaptiveStrategy(),
        "max_epochs": 2,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": False,
        "enable_checkpointing": False,
    }
    options.update(kwargs)
    return pl.Trainer(**options)


# -- the pure checks ----------------------------------------------------------------------
def test_the_defaults_of_a_trainer_are_accepted() -> None:
    check_trainer(types.SimpleNamespace(**ALLOWED))


@given(
    st.sampled_from(
        [
            ("accumulate_grad_batches", st.integers(2, 64)),
            ("limit_train_batches", st.floats(0.01, 0.99)),
            ("limit_train_batches", st.integers(1, 100)),
            ("max_steps", st.integers(0, 10**6)),
            ("val_check_interval", st.floats(0.01, 0.99)),
            ("reload_dataloaders_every_n_epochs", st.integers(1, 10)),
            ("gradient_clip_val", st.floats(0.01, 100.0)),
        ]
    ).flatmap(lambda pair: st.tuples(st.just(pair[0]), pair[1]))
)
def test_settings_that_take_the_loop_from_adaptdl_are_refused(setting: tuple[str, Any]) -> None:
    name, value = setting
    with pytest.raises(ValueError, match=rf"Trainer\({name}=\.\.\.\).*got {value!r}"):
        check_trainer(types.SimpleNamespace(**{**ALLOWED, name: value}))


def test_a_plain_train_dataloader_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"AdaptiveDataLoader.*torch\.utils\.data\..*DataLoader"):
        check_train_loader(DataLoader(dataset()))
    loader = adl.AdaptiveDataLoader(dataset(), batch_size=4)
    assert check_train_loader(loader) is loader
    with pytest.raises(TypeError, match=r"plain.*val_dataloader"):
        check_eval_loader(loader, "val")
    check_eval_loader(DataLoader(dataset()), "val")


def test_bad_strategy_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="scaling_rule must be one of"):
        AdaptiveStrategy(scaling_rule="adascale")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="name must be a non-empty str"):
        AdaptiveStrategy(name="")
    with pytest.raises(TypeError, match="report_loss must be a bool"):
        AdaptiveStrategy(report_loss="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"target_loss=0\.3 needs report_loss=True"):
        AdaptiveStrategy(target_loss=0.3)
    assert AdaptiveStrategy(report_loss=True).target_loss is None  # none stated: the horizon
    assert AdaptiveStrategy(target_loss=0.0).target_loss == 0.0  # the old default, accepted
    loss = torch.tensor(0.5)
    assert step_loss(loss) is loss and step_loss({"loss": loss, "acc": 1}) is loss
    assert step_loss(None) is None and step_loss({}) is None  # a batch skipped
    with pytest.raises(ValueError, match=r"needs training_step to return the loss.*got 0\.5"):
        step_loss(0.5)


def test_lightning_sees_a_sized_loader_whose_length_is_never_reached() -> None:
    wrapped = TrainLoader(adl.AdaptiveDataLoader(dataset(), batch_size=4), AdaptiveStrategy())
    assert len(wrapped) == UNKNOWN_LENGTH
    assert wrapped.state_dict()["index"] == 0


# -- fits -----------------------------------------------------------------------------------
def test_each_epoch_consumes_every_sample_once_and_steps_its_scheduler() -> None:
    model = Model()
    fit = trainer()
    fit.fit(model, datamodule=Data())
    per_epoch = collections.defaultdict(list)
    for epoch, indices in model.seen:
        per_epoch[epoch] += indices
    assert sorted(per_epoch) == [0, 1]
    for indices in per_epoch.values():
        assert sorted(indices) == list(range(N))
    assert set(model.lrs[: N // 4]) == {0.1} and set(model.lrs[N // 4 :]) == {0.05}
    assert adl.finished_epochs() == 2 and fit.current_epoch == 2


class CountsValidations(Model):
    def __init__(self) -> None:
        super().__init__()
        self.validations = 0

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.validations += 1


def test_an_int_val_check_interval_of_one_validates_after_every_batch() -> None:
    # Lightning reads the int 1 as "every batch", the float 1.0 as "once an epoch".
    data = Data()
    data.val_dataloader = lambda: torch.utils.data.DataLoader(dataset(), batch_size=N)
    every = CountsValidations()
    trainer(max_epochs=1, val_check_interval=1, num_sanity_val_steps=0).fit(every, datamodule=data)
    assert every.validations == N // 4  # one per batch of 4 (the float 1.0: one per epoch)


def two_micro_batches() -> adl.AdaptiveDataLoader:
    """A loader whose job decides 2 micro-batches of 2 per optimiser step."""
    loader = adl.AdaptiveDataLoader(dataset(), batch_size=4)
    loader.autoscale_batch_size(8, (2, 4), gradient_accumulation=True)
    _context.current_job().batch_size_decision = lambda query: (2, 1)
    return loader


def test_accumulation_steps_once_per_batch_and_so_does_a_step_scheduler() -> None:
    model = Model(interval="step")
    trainer(max_epochs=1).fit(model, datamodule=Data(two_micro_batches))
    micro = N // 2
    assert len(model.seen) == micro
    assert adl.global_step() == micro // 2  # one optimiser step per 2 micro-batches
    # The per-step scheduler halves the rate once per optimiser step, not per micro-batch.
    assert model.lrs == [0.1 * 0.5 ** (i // 2) for i in range(micro)]


@pytest.mark.parametrize("accumulation", [2, 3])
def test_a_step_scheduler_with_frequency_counts_optimiser_steps(accumulation: int) -> None:
    # Lightning counts a "step" scheduler's frequency in micro-batches of the epoch
    # (batch_idx + 1); with accumulation that is neither optimiser steps nor stable.
    def make() -> adl.AdaptiveDataLoader:
        loader = adl.AdaptiveDataLoader(dataset(), batch_size=4)
        loader.autoscale_batch_size(4 * accumulation, (1, 4), gradient_accumulation=True)
        _context.current_job().batch_size_decision = lambda query: (
            max(1, 4 // accumulation),
            accumulation - 1,
        )
        return loader

    model = Model(interval="step", frequency=2)
    trainer(max_epochs=1).fit(model, datamodule=Data(make))
    micro = len(model.seen)
    assert adl.global_step() == micro // accumulation
    # Halved once per 2 optimiser steps: after optimiser steps 2, 4, ...
    assert model.lrs == [0.1 * 0.5 ** ((i // accumulation) // 2) for i in range(micro)]


def test_report_loss_reaches_the_noise_floor_once_per_optimiser_step() -> None:
    wrapped: list[Any] = []  # the AdaptiveDataParallel (not a submodule of the model)

    class Seen(Model):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            wrapped[:] = [self.trainer.strategy.model]
            return super().training_step(batch, batch_idx)

    model = Seen()
    strategy = AdaptiveStrategy(report_loss=True, target_loss=0.01)
    trainer(max_epochs=2, strategy=strategy).fit(model, datamodule=Data(two_micro_batches))
    floor = _context.current_job().metrics.floor
    # Each micro-batch is reported after its step call, so each optimiser step folds
    # the losses reported since the last one (the first step, its first micro-batch's);
    # the last micro-batch's waits for a next step.
    assert floor is not None and floor.steps == adl.global_step() > 0
    assert len(wrapped[0]._losses) == 1 and wrapped[0]._target_loss == 0.01


def test_report_loss_passes_over_the_batches_training_step_skips() -> None:
    """A batch whose training_step returns None reports no loss, and the fit goes on:
    every loss reported is one a step folds."""
    losses: list[float] = []

    class Skipping(Model):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
            loss = super().training_step(batch, batch_idx)
            if batch_idx % 2:
                return None  # Lightning skips this batch's backward and step
            losses.append(float(loss.detach()))
            return loss

    model = Skipping()
    strategy = AdaptiveStrategy(report_loss=True)
    trainer(max_epochs=1, strategy=strategy).fit(model, datamodule=Data())
    batches = len(model.seen)
    assert batches > 2 and batches % 2 == 0 and len(losses) == batches // 2
    floor = _context.current_job().metrics.floor
    # Lightning still calls optimizer.step for a skipped batch (with no gradient):
    # that step folds the loss reported the batch before, so every loss is folded,
    # the last one by the last batch's step.
    assert floor is not None and floor.steps == len(losses)


def test_report_loss_refuses_an_optimiser_without_a_noise_floor() -> None:
    class AdamModel(Model):
        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=0.01)

    with pytest.raises(ValueError, match=r"defined for torch\.optim\.SGD only, got Adam"):
        trainer(strategy=AdaptiveStrategy(report_loss=True)).fit(AdamModel(), datamodule=Data())


@pytest.mark.parametrize("setting", [{"accumulate_grad_batches": 2}, {"max_steps": 3}])
def test_fit_refuses_a_trainer_setting_adaptdl_owns(setting: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(setting))):
        trainer(**setting).fit(Model(), datamodule=Data())


def test_fit_refuses_a_plain_train_dataloader() -> None:
    with pytest.raises(TypeError, match="must return exactly one"):
        trainer().fit(Model(), datamodule=Data(lambda: DataLoader(dataset(), batch_size=4)))


def test_fit_refuses_several_train_dataloaders() -> None:
    def two() -> list[adl.AdaptiveDataLoader]:
        return [adl.AdaptiveDataLoader(dataset(), batch_size=4) for _ in range(2)]

    with pytest.raises(ValueError, match="returned several"):
        trainer().fit(Model(), datamodule=Data(two))


class SaveAndStop(pl.Callback):
    """Save a Lightning checkpoint after batch ``at`` of epoch 0, then stop the fit."""

    def __init__(self, path: Path, at: int) -> None:
        self.path, self.at = path, at

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.current_epoch == 0 and args[-1] == self.at:
            trainer.save_checkpoint(self.path)
            raise KeyError("stop here")


class SaveInValidation(pl.Callback):
    """Save a Lightning checkpoint in the first validation of epoch 0, then stop the fit."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_validation_end(self, trainer: Any, *args: Any) -> None:
        if trainer.current_epoch == 0 and not trainer.sanity_checking:
            trainer.save_checkpoint(self.path)
            raise KeyError("stop here")


class WithValidation(Data):
    def val_dataloader(self) -> Any:
        return DataLoader(dataset(), batch_size=8)


class Validated(Model):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass


@pytest.mark.parametrize("where", ["after a batch", "in a validation mid-epoch"])
def test_a_lightning_checkpoint_resumes_the_loader_mid_epoch(tmp_path: Path, where: str) -> None:
    # Mid-epoch validation runs while the loader's next batch is already fetched:
    # the checkpoint must count only the batches trained.
    path = tmp_path / "mid.ckpt"
    first = Validated()
    options: dict[str, Any] = {"callbacks": [SaveAndStop(path, at=2)]}
    if where != "after a batch":
        options = {"callbacks": [SaveInValidation(path)], "val_check_interval": 2}
    with pytest.raises(KeyError, match="stop here"):
        trainer(**options).fit(first, datamodule=WithValidation())
    _context._reset()  # a new job, without an AdaptDL checkpoint
    second = Validated()
    trainer(max_epochs=1).fit(second, datamodule=WithValidation(), ckpt_path=path)
    epoch0 = [i for _, indices in first.seen for i in indices]
    epoch0 += [i for epoch, indices in second.seen if epoch == 0 for i in indices]
    assert sorted(epoch0) == list(range(N))  # the first batches before, the rest after
    assert len(first.seen) < N // 4


def test_a_finished_fit_relaunched_trains_nothing_and_keeps_lightnings_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path / "adaptdl"))
    monkeypatch.chdir(tmp_path)  # ModelCheckpoint writes Lightning's own .ckpt here
    first = Model()
    trainer(enable_checkpointing=True).fit(first, datamodule=Data())
    saved = first.linear.weight.detach().clone()
    _context._reset()  # the relaunch: the job restores its final checkpoint
    second = Model()
    fit = trainer(enable_checkpointing=True)
    fit.fit(second, datamodule=Data())
    assert second.seen == []  # both epochs had finished
    assert fit.current_epoch == 2 and fit.global_step == 2 * N // 4
    torch.testing.assert_close(second.linear.weight.detach(), saved)
    # ModelCheckpoint's state (the file it wrote) came back with Lightning's.
    assert fit.checkpoint_callback is not None
    assert Path(
        fit.checkpoint_callback.last_model_path or fit.checkpoint_callback.best_model_path
    ).exists()
