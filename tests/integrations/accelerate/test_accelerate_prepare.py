"""adaptdl.torch.accelerate in one process: what prepare keeps, wraps, refuses and saves."""

from __future__ import annotations

import collections
import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

import adaptdl.torch as adl
import torch
from adaptdl.core.config import ENV_VARS
from adaptdl.torch import _context
from adaptdl.torch.parallel import AdaptiveDataParallel
from adaptdl.torch.scaling_rules import LinearScale

accelerate = pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from adaptdl.torch import accelerate as ada  # noqa: E402

N = 32


@contextlib.contextmanager
def fresh() -> Iterator[None]:
    """A fresh default job and fresh Accelerate state (both are per process)."""
    _context._reset()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        yield
    finally:
        _context._reset()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in (*ENV_VARS, "LOCAL_RANK", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"):
        monkeypatch.delenv(name, raising=False)
    with fresh():
        yield


def data() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, 3, generator=gen)
    return TensorDataset(torch.arange(N), x, x.sum(1, keepdim=True))


def parts(lr: float = 0.1) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return model, optimizer, scheduler


def test_prepare_keeps_the_loader_and_wraps_the_model() -> None:
    accelerator = Accelerator(cpu=True)
    loader = adl.AdaptiveDataLoader(data(), batch_size=8, shuffle=True)
    evaluation = DataLoader(data(), batch_size=8)
    model, optimizer, scheduler = parts()
    prepared = ada.prepare(accelerator, model, evaluation, optimizer, loader, scheduler)
    wrapped, eval_loader, accelerated, kept, sched = prepared
    assert kept is loader and accelerator.prepare(loader) is loader  # never re-sharded
    assert isinstance(loader.sampler, adl.ElasticSampler)
    assert eval_loader is not evaluation  # other loaders are Accelerate's
    assert isinstance(wrapped, AdaptiveDataParallel) and wrapped.module is model
    assert accelerator.prepare(wrapped) is wrapped
    assert accelerator._models == [wrapped]  # what save_state saves
    assert accelerated.optimizer is optimizer and sched.scheduler is scheduler
    assert sched.split_batches  # one scheduler step per optimiser step at any size
    assert any(obj is loader for obj in accelerator._custom_objects)


def test_a_custom_adaptive_loader_is_kept_too() -> None:
    class Custom(DataLoader, adl.AdaptiveDataLoaderMixin):  # type: ignore[type-arg]
        def __init__(self, dataset: TensorDataset) -> None:
            DataLoader.__init__(self, dataset, batch_size=4)
            adl.AdaptiveDataLoaderMixin.__init__(self, 4)

    accelerator = Accelerator(cpu=True)
    model, optimizer, _ = parts()
    loader = Custom(data())
    _, _, kept = ada.prepare(accelerator, model, optimizer, loader)
    assert kept is loader and accelerator.prepare(loader) is loader


def test_bad_input_is_refused_with_what_is_allowed() -> None:
    loader = adl.AdaptiveDataLoader(data(), batch_size=8)
    model, optimizer, _ = parts()
    with pytest.raises(TypeError, match=r"accelerator must be an accelerate\.Accelerator"):
        ada.prepare("accelerator", model, optimizer, loader)
    with pytest.raises(TypeError, match=r"accelerator must be an accelerate\.Accelerator"):
        ada.register_state(None, "name", optimizer)  # type: ignore[arg-type]
    accelerator = Accelerator(cpu=True)
    with pytest.raises(ValueError, match=r"exactly one model .* got 2 models and 1 optim"):
        ada.prepare(accelerator, model, torch.nn.Linear(1, 1), optimizer, loader)
    with pytest.raises(ValueError, match="got 1 models and 0 optimizers"):
        ada.prepare(accelerator, model, loader)
    lambdas = [torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0) for _ in "ab"]
    with pytest.raises(ValueError, match="at most one LR scheduler, got 2"):
        ada.prepare(accelerator, model, optimizer, loader, *lambdas)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    with pytest.raises(TypeError, match="already a DistributedDataParallel: pass the plain"):
        ada.prepare(accelerator, ddp, optimizer, loader)


def test_accelerate_modes_and_process_counts_other_than_the_jobs_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from accelerate.utils import DistributedType

    accelerator = Accelerator(cpu=True)
    model, optimizer, _ = parts()
    loader = adl.AdaptiveDataLoader(data(), batch_size=8)
    monkeypatch.setattr(Accelerator, "num_processes", property(lambda self: 2))
    with pytest.raises(ValueError, match="process 0 of 2 but the AdaptDL job is replica 0 of 1"):
        ada.prepare(accelerator, model, optimizer, loader)
    monkeypatch.setattr(Accelerator, "num_processes", property(lambda self: 1))
    monkeypatch.setattr(
        Accelerator, "distributed_type", property(lambda self: DistributedType.DEEPSPEED)
    )
    with pytest.raises(ValueError, match="distributed_type=DEEPSPEED is not supported"):
        ada.prepare(accelerator, model, optimizer, loader)


def test_a_conflicting_accumulation_setting_is_refused() -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model, optimizer, _ = parts()
    loader = adl.AdaptiveDataLoader(data(), batch_size=8)
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=4\) conflicts"):
        ada.prepare(accelerator, model, optimizer, loader)


@settings(max_examples=8)
@given(local=st.integers(1, 8), accum=st.integers(0, 3))
def test_accelerate_follows_the_loaders_accumulation(local: int, accum: int) -> None:
    """sync_gradients, the optimiser and the scheduler step on the loader's optimiser steps
    only, and each step is the one a plain full-batch step takes."""
    with fresh():
        dataset = data()
        accelerator = Accelerator(cpu=True)
        loader = adl.AdaptiveDataLoader(dataset, batch_size=4)
        loader.autoscale_batch_size(32, (1, 8), gradient_accumulation=True)
        _context.current_job().batch_size_decision = lambda query: (local, accum)
        model, optimizer, scheduler = parts()
        reference = copy.deepcopy(model)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        model, optimizer, loader, scheduler = ada.prepare(
            accelerator, model, optimizer, loader, scheduler, scaling_rule=LinearScale()
        )
        steps, batch, full = 0, [], True
        for _ in adl.remaining_epochs_until(1):
            for idx, x, y in loader:
                helper = adl.current_dataloader()
                assert helper is not None and helper.accumulation_steps == accum
                batch.append(idx)
                with accelerator.accumulate(model):
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    assert accelerator.sync_gradients == helper.is_optim_step()
                    accelerator.backward(loss)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                if helper.is_optim_step():
                    steps += 1
                    i = torch.cat(batch)
                    batch = []
                    # Equal micro-batches (a pass may end in a short one, whose mean
                    # of means is no full-batch mean: compared up to there).
                    full = full and len(i) == local * (accum + 1)
                    if not full:
                        continue
                    # LinearScale: the learning rate scales with the total batch size
                    # over the loader's initial one (4).
                    for group in ref_opt.param_groups:
                        group["lr"] = 0.1 * len(i) / 4
                    ref_opt.zero_grad()
                    out = reference(dataset[i][1])
                    torch.nn.functional.mse_loss(out, dataset[i][2]).backward()
                    ref_opt.step()
                    pairs = zip(model.module.parameters(), reference.parameters(), strict=True)
                    for p, q in pairs:
                        torch.testing.assert_close(p, q)
        assert steps > 0 and scheduler.scheduler.last_epoch == steps


def test_save_state_and_load_state_carry_the_loader_position(tmp_path: Path) -> None:
    def run(load: bool, stop_after: int | None) -> tuple[list[int], Any]:
        with fresh():
            accelerator = Accelerator(cpu=True)
            loader = adl.AdaptiveDataLoader(data(), batch_size=4, shuffle=True)
            model, optimizer, scheduler = parts()
            model, optimizer, loader, scheduler = ada.prepare(
                accelerator, model, optimizer, loader, scheduler
            )
            if load:
                accelerator.load_state(str(tmp_path))
            seen: list[int] = []
            for idx, x, y in loader:
                seen += idx.tolist()
                with accelerator.accumulate(model):
                    accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                if len(seen) == stop_after:
                    accelerator.save_state(str(tmp_path))
                    weights = copy.deepcopy(model.module.state_dict())
                    return seen, (weights, scheduler.scheduler.last_epoch)
            return seen, (copy.deepcopy(model.module.state_dict()), None)

    before, (saved, sched_steps) = run(load=False, stop_after=12)
    assert (tmp_path / "custom_checkpoint_0.pkl").exists()
    after, _ = run(load=True, stop_after=None)
    # Every sample of the pass once: the loaded loader went on after the saved batch.
    assert collections.Counter(before + after) == collections.Counter(range(N))
    assert sched_steps == 3
    with fresh():  # the model was restored by Accelerate too
        accelerator = Accelerator(cpu=True)
        loader = adl.AdaptiveDataLoader(data(), batch_size=4)
        model, optimizer, scheduler = parts(lr=0.5)
        model, *_ = ada.prepare(accelerator, model, optimizer, loader, scheduler)
        accelerator.load_state(str(tmp_path))
        for key, value in saved.items():
            torch.testing.assert_close(model.module.state_dict()[key], value)
        assert loader.state_dict()["index"] == 12


def test_register_state_puts_an_object_in_both_checkpoints() -> None:
    accelerator = Accelerator(cpu=True)

    class Counter:
        def __init__(self) -> None:
            self.value = 0

        def state_dict(self) -> dict[str, int]:
            return {"value": self.value}

        def load_state_dict(self, state: dict[str, int]) -> None:
            self.value = state["value"]

    counter = Counter()
    ada.register_state(accelerator, "counter", counter)
    assert accelerator._custom_objects == [counter]
    assert "counter" in [state.name for state in _context.current_job().states()]
    with pytest.raises(ValueError, match="name must be a non-empty str"):
        ada.register_state(accelerator, "", counter)
