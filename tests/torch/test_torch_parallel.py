"""AdaptiveDataParallel in one process: accumulation, statistics, LR scaling, checkpoints."""

from __future__ import annotations

import copy
import io
import math
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import TensorDataset

import adaptdl.torch as adl
import torch
from adaptdl.core.loop.boundary import Preempted
from adaptdl.core.persist.checkpoint import CheckpointError
from adaptdl.torch import _context, scaling_rules
from adaptdl.torch.parallel import AdaptiveDataParallel
from adaptdl.torch.scaling_rules import AdaScale, LinearScale
from adaptdl.torch.state import StateDictState

N = 32


def data() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, 3, generator=gen)
    return TensorDataset(torch.arange(N), x, x.sum(1, keepdim=True))


def setup(lr: float = 0.1, **kwargs: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return model, optimizer, AdaptiveDataParallel(model, optimizer, **kwargs)


def train_step(
    adp: Any, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> float:
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(adp(x), y)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def test_backward_outside_a_loader_loop_is_an_error() -> None:
    _, _, adp = setup()
    loss = adp(torch.randn(2, 3)).sum()
    with pytest.raises(RuntimeError, match="outside a dataloader loop"):
        loss.backward()


def test_is_a_distributed_data_parallel_and_forward_works_outside_loops() -> None:
    _, _, adp = setup()
    assert isinstance(adp, torch.nn.parallel.DistributedDataParallel)
    with torch.no_grad():
        assert adp(torch.zeros(1, 3)).shape == (1, 1)


def test_bad_arguments_are_refused() -> None:
    model = torch.nn.Linear(3, 1)
    with pytest.raises(ValueError, match="optimizer must be"):
        AdaptiveDataParallel(model, "sgd")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scaling_rule must be"):
        AdaptiveDataParallel(model, torch.optim.SGD(model.parameters(), lr=1), scaling_rule=2)
    with pytest.raises(ValueError, match="LBFGS re-evaluates its closure"):
        AdaptiveDataParallel(model, torch.optim.LBFGS(model.parameters()))


def test_accumulated_micro_batches_take_one_full_batch_step() -> None:
    dataset = data()
    loader = adl.AdaptiveDataLoader(dataset, batch_size=16)
    loader.autoscale_batch_size(32, (1, 16), gradient_accumulation=True)
    _context.current_job().batch_size_decision = lambda query: (4, 3)
    model, optimizer, adp = setup(scaling_rule=LinearScale())
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    steps = 0
    batch: list[torch.Tensor] = []
    for _ in adl.remaining_epochs_until(1):
        for idx, x, y in loader:
            batch.append(idx)
            helper = adl.current_dataloader()
            assert helper is not None
            optim = helper.is_optim_step()
            before = [p.detach().clone() for p in model.parameters()]
            train_step(adp, optimizer, x, y)
            changed = any(
                not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)
            )
            assert changed == optim
            if optim:
                steps += 1
                # The same step taken on the whole batch of 16 at once.
                i = torch.cat(batch)
                batch = []
                ref_opt.zero_grad()
                torch.nn.functional.mse_loss(reference(dataset[i][1]), dataset[i][2]).backward()
                ref_opt.step()
                for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                    torch.testing.assert_close(p, q)
    assert steps == 2
    gns = adp.gns
    assert gns is not None and gns.num_updates == 2  # the multi-micro-batch estimator
    assert optimizer.param_groups[0]["lr"] == 0.1  # the scaled LR applies during step only


def test_a_loop_left_after_its_first_micro_batch_leaves_nothing_in_the_next_runs_step() -> None:
    # The next run of the same loader starts at index 0 too: the stale micro-batch's
    # gradient (and loss) must still be told apart from the new run's first one.
    dataset = data()
    loader = adl.AdaptiveDataLoader(dataset, batch_size=8)
    loader.autoscale_batch_size(8, (1, 8), gradient_accumulation=True)
    _context.current_job().batch_size_decision = lambda query: (4, 1)  # 2 micro-batches
    model, optimizer, adp = setup(scaling_rule=LinearScale())
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    batch: list[torch.Tensor] = []
    for epoch in adl.remaining_epochs_until(2):
        for i, (idx, x, y) in enumerate(loader):
            if epoch == 0:
                optimizer.zero_grad()
                (1000.0 * torch.nn.functional.mse_loss(adp(x), y)).backward()
                optimizer.step()  # accumulates only
                break
            batch.append(idx)
            train_step(adp, optimizer, x, y)
            if i == 1:
                break
    whole = torch.cat(batch)
    ref_opt.zero_grad()
    torch.nn.functional.mse_loss(reference(dataset[whole][1]), dataset[whole][2]).backward()
    ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_single_micro_batch_steps_use_the_differenced_estimator_and_progress() -> None:
    loader = adl.AdaptiveDataLoader(data(), batch_size=4)
    loader.train()
    _, optimizer, adp = setup()
    for _ in adl.remaining_epochs_until(1):
        for _, x, y in loader:
            train_step(adp, optimizer, x, y)
    gns = adp.gns
    assert gns is not None
    assert gns.num_updates == N // 4 - 1 and gns.differenced
    assert adp.progress == pytest.approx(N // 4)  # gain 1 at scale 1
    assert adp.gain == pytest.approx(1.0) and adp.gain() == adp.gain  # a property, still callable


def test_lr_factor_follows_the_rule_and_restores_the_base_lr() -> None:
    loader = adl.AdaptiveDataLoader(data(), batch_size=4)
    loader.autoscale_batch_size(16, (1, 8))
    _context.current_job().batch_size_decision = lambda query: (8, 0)  # scale 2
    model, optimizer, adp = setup(lr=0.1, scaling_rule=LinearScale())
    seen = []
    for _ in adl.remaining_epochs_until(1):
        for _, x, y in loader:
            before = model.weight.detach().clone()
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(adp(x), y).backward()
            grad = model.weight.grad.detach().clone()
            optimizer.step()
            seen.append(adp.last_lr_factor)
            torch.testing.assert_close(model.weight.detach(), before - 0.2 * grad)
            break
    assert seen == [2.0]
    assert optimizer.param_groups[0]["lr"] == 0.1


class Pow(scaling_rules.ScalingRuleBase):
    """A rule of one's own, as the original AdaptDL's extension point writes it."""

    def __init__(self) -> None:
        self.scales: list[float] = []

    def scale_lr(self, scale: float) -> float:
        self.scales.append(scale)
        return scale**0.75


def test_a_rule_of_ones_own_scales_each_step_by_its_scale_lr() -> None:
    """Issue 38: ``scale_lr`` alone makes a rule; its factor at each step's scale applies
    to that step (here scale 2, then 3), and the base rate stays."""
    loader = adl.AdaptiveDataLoader(data(), batch_size=4)
    loader.autoscale_batch_size(16, (1, 12))
    splits = iter([(8, 0), (12, 0)])
    _context.current_job().batch_size_decision = lambda query: next(splits, (12, 0))
    rule = Pow()
    model, optimizer, adp = setup(lr=0.1, scaling_rule=rule)
    seen = []
    for _ in adl.remaining_epochs_until(2):
        for _, x, y in loader:
            before = model.weight.detach().clone()
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(adp(x), y).backward()
            grad = model.weight.grad.detach().clone()
            optimizer.step()
            factor = (len(x) / 4) ** 0.75
            assert adp.last_lr_factor == pytest.approx(factor)
            torch.testing.assert_close(model.weight.detach(), before - 0.1 * factor * grad)
            seen.append(len(x))
            break
    assert seen == [8, 12] and rule.scales == [2.0, 3.0]
    assert optimizer.param_groups[0]["lr"] == 0.1


def test_a_rule_of_ones_own_that_returns_no_factor_is_named() -> None:
    class Bad(scaling_rules.ScalingRuleBase):
        def scale_lr(self, scale: float) -> float:
            return -1.0

    class Nothing(scaling_rules.ScalingRuleBase):
        pass

    with pytest.raises(ValueError, match=r"Bad.scale_lr\(2.0\): factor must be"):
        Bad().step_rule(4, 2.0)
    with pytest.raises(NotImplementedError, match="Nothing names no core rule and implements"):
        Nothing().step_rule(4, 2.0)
    assert Bad().core_rule_type() is None  # report_loss refuses it (AdaScale only)


def test_default_rule_is_adascale() -> None:
    _, _, adp = setup()
    assert isinstance(adp.scaling_rule, AdaScale)


def test_grad_scaler_steps_and_skips_on_inf() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    loader = adl.AdaptiveDataLoader(data(), batch_size=8)
    loader.train()
    model, optimizer, adp = setup(mp_scaler=scaler)
    for _ in adl.remaining_epochs_until(1):
        for i, (_, x, y) in enumerate(loader):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(adp(x), y)
            if i == 1:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    assert scaler.get_scale() < 2.0**4  # the inf step was skipped and the scale backed off
    assert adp.progress == pytest.approx(N // 8 - 1)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_to_tensorboard_writes_gradient_statistics(writer: Any) -> None:
    loader = adl.AdaptiveDataLoader(data(), batch_size=4)
    loader.train()
    _, optimizer, adp = setup()
    for _ in adl.remaining_epochs_until(1):
        for _, x, y in loader:
            train_step(adp, optimizer, x, y)
    adp.to_tensorboard(writer, 3, "run")
    assert writer.scalars["run/Gradient/gain"] == (1.0, 3)
    assert writer.scalars["run/Gradient/progress"][0] == pytest.approx(N // 4)
    assert "run/Gradient/sqr" in writer.scalars and "run/Gradient/var" in writer.scalars


def test_model_optimizer_scheduler_and_scaler_restore_after_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path))

    def build() -> tuple[Any, ...]:
        adl.init_process_group("gloo")
        loader = adl.AdaptiveDataLoader(data(), batch_size=4, shuffle=True)
        loader.train()
        torch.manual_seed(1)
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1)
        adp = AdaptiveDataParallel(model, optimizer, scheduler, scaler)
        return loader, model, optimizer, scheduler, scaler, adp

    loader, model, optimizer, scheduler, scaler, adp = build()
    with pytest.raises(Preempted):
        for _ in adl.remaining_epochs_until(2):
            for step, (_, x, y) in enumerate(loader):
                optimizer.zero_grad()
                scaler.scale(torch.nn.functional.mse_loss(adp(x), y)).backward()
                scaler.step(optimizer)
                scaler.update()
                if step == 2:
                    _context.current_job().request_stop()
            scheduler.step()
    saved = (
        copy.deepcopy(model.state_dict()),
        copy.deepcopy(optimizer.state_dict()["state"]),
        scheduler.state_dict()["last_epoch"],
        scaler.get_scale(),
        adp.progress,
    )
    _context._reset()
    loader, model, optimizer, scheduler, scaler, adp = build()
    for key, value in saved[0].items():
        torch.testing.assert_close(model.state_dict()[key], value)
    for key, value in saved[1].items():
        torch.testing.assert_close(optimizer.state_dict()["state"][key], value)
    assert scheduler.state_dict()["last_epoch"] == saved[2]
    assert scaler.get_scale() == saved[3] > 8.0
    assert adp.progress == saved[4] > 0


class Evil:
    def __reduce__(self) -> Any:
        return (print, ("this must never run",))


def test_torch_state_loads_with_weights_only_and_refuses_code() -> None:
    model = torch.nn.Linear(2, 2)
    state = StateDictState("s", {"model": model})
    clone = torch.nn.Linear(2, 2)
    StateDictState("s", {"model": clone}).from_bytes(state.to_bytes())
    torch.testing.assert_close(clone.weight, model.weight)
    buffer = io.BytesIO()
    torch.save({"model": Evil()}, buffer)
    with pytest.raises(CheckpointError, match="weights_only=True"):
        state.from_bytes(buffer.getvalue())
    with pytest.raises(CheckpointError, match="no state for"):
        StateDictState("s", {"model": model, "other": clone}).from_bytes(state.to_bytes())


def test_gradients_of_a_loop_left_mid_accumulation_belong_to_no_step() -> None:
    loader = adl.AdaptiveDataLoader(data(), batch_size=16)
    loader.autoscale_batch_size(32, (1, 16), gradient_accumulation=True)
    _context.current_job().batch_size_decision = lambda query: (4, 3)
    model, optimizer, adp = setup()
    for epoch in adl.remaining_epochs_until(2):
        for i, (_, x, y) in enumerate(loader):
            optimizer.zero_grad()
            if epoch == 1:
                # The first step of the new loop starts from clean gradients.
                assert model.weight.grad is None or not model.weight.grad.any()
            torch.nn.functional.mse_loss(adp(x), y).backward()
            optimizer.step()  # a no-op on accumulation micro-batches
            if epoch == 0 and i == 1:
                break  # leaves two micro-batches accumulated in .grad
            if epoch == 1:
                break


def test_adamscale_preconditioned_measures_adam_preconditioned_gradients() -> None:
    loader = adl.AdaptiveDataLoader(data(), batch_size=8)
    loader.autoscale_batch_size(32, (1, 16), gradient_accumulation=True)
    _context.current_job().batch_size_decision = lambda query: (8, 1)  # 2 micro-batches
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.9, 0.99), eps=1e-6)
    rule = scaling_rules.AdamScale(preconditioned=True)
    adp = AdaptiveDataParallel(model, optimizer, scaling_rule=rule)
    assert adp._preconditioner(0, model.weight) is None  # no optimiser state yet
    factors = []
    for _ in adl.remaining_epochs_until(1):
        for _, x, y in loader:
            train_step(adp, optimizer, x, y)
            factors.append(adp.last_lr_factor)
    state = optimizer.state[model.weight]
    expected = (state["exp_avg_sq"] / (1 - 0.99 ** float(state["step"]))).sqrt() + 1e-6
    torch.testing.assert_close(adp._preconditioner(0, model.weight), expected)
    gns = adp.gns
    assert gns is not None and gns.num_updates == len(factors) // 2 >= 2
    assert gns.gain(2.0) > 1.0
    assert adp.last_lr_factor == pytest.approx(math.sqrt(gns.gain(2.0)))


def _step_statistics(rule: Any, optimizer_type: Any, steps: int) -> tuple[float, float]:
    """|G|^2 and tr(Sigma) after ``steps`` optimiser steps of 2 micro-batches each."""
    loader = adl.AdaptiveDataLoader(data(), batch_size=8)
    loader.autoscale_batch_size(32, (1, 16), gradient_accumulation=True)
    _context.current_job().batch_size_decision = lambda query: (8, 1)  # 2 micro-batches
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = optimizer_type(model.parameters(), lr=0.01)
    adp = AdaptiveDataParallel(model, optimizer, scaling_rule=rule)
    for _ in adl.remaining_epochs_until(1):
        for i, (_, x, y) in enumerate(loader):
            train_step(adp, optimizer, x, y)
            if i == 2 * steps - 1:
                break
    gns = adp.gns
    assert gns is not None and gns.num_updates == steps
    return gns.sqr, gns.var


def test_adamscale_measures_the_raw_gradient_by_default() -> None:
    """The statistics of the raw gradient: those AdaScale measures of the same step
    (the first: the rules' factors part the runs after it). Under Adam they differ
    from the preconditioned ones from the second step (the first has no state)."""
    assert repr(scaling_rules.AdamScale()) == "AdamScale()"
    raw = _step_statistics(scaling_rules.AdamScale(), torch.optim.SGD, 1)
    _context._reset()
    adl.init_process_group("gloo")
    plain = _step_statistics(scaling_rules.AdaScale(), torch.optim.SGD, 1)
    assert raw == pytest.approx(plain, rel=1e-12)
    _context._reset()
    adl.init_process_group("gloo")
    adam = _step_statistics(scaling_rules.AdamScale(), torch.optim.Adam, 2)
    _context._reset()
    adl.init_process_group("gloo")
    preconditioned = _step_statistics(
        scaling_rules.AdamScale(preconditioned=True), torch.optim.Adam, 2
    )
    assert adam != pytest.approx(preconditioned, rel=1e-3)
    with pytest.raises(ValueError, match="preconditioned"):
        scaling_rules.AdamScale(preconditioned="yes")  # type: ignore[arg-type]


def test_two_backward_passes_on_one_batch_add_up() -> None:
    dataset = data()
    loader = adl.AdaptiveDataLoader(dataset, batch_size=8)
    loader.train()
    model, optimizer, adp = setup(scaling_rule=LinearScale())
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in adl.remaining_epochs_until(1):
        for _, x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(adp(x), y).backward()
            adp(x).abs().mean().backward()  # a second loss term, its own backward
            optimizer.step()
            ref_opt.zero_grad()
            loss = torch.nn.functional.mse_loss(reference(x), y) + reference(x).abs().mean()
            loss.backward()
            ref_opt.step()
            for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(p, q)


def test_noise_statistics_of_several_param_groups_survive_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path))

    def build() -> tuple[Any, Any, torch.optim.Optimizer]:
        adl.init_process_group("gloo")
        loader = adl.AdaptiveDataLoader(data(), batch_size=4)
        loader.train()  # before the model, as usual: the job makes a 1-group estimator
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1)
        return loader, AdaptiveDataParallel(model, optimizer), optimizer

    loader, adp, optimizer = build()
    with pytest.raises(Preempted):
        for _ in adl.remaining_epochs_until(1):
            for step, (_, x, y) in enumerate(loader):
                train_step(adp, optimizer, x, y)
                if step == 4:
                    _context.current_job().request_stop()
    before = adp.gns.to_json()
    assert before["num_groups"] == 2 and before["num_updates"] > 0
    _context._reset()
    _, adp, _ = build()
    assert adp.gns.to_json() == before


def _train_with_accumulation(use_closure: bool) -> tuple[list[int], torch.Tensor]:
    """One epoch at 4 micro-batches per step; how often the closure ran, the weights."""
    _context._reset()
    loader = adl.AdaptiveDataLoader(data(), batch_size=16)
    loader.autoscale_batch_size(32, (1, 16), gradient_accumulation=True)
    _context.current_job().batch_size_decision = lambda query: (4, 3)
    model, optimizer, adp = setup()
    calls: list[int] = []
    for _ in adl.remaining_epochs_until(1):
        for i, (_, x, y) in enumerate(loader):

            def closure(x: torch.Tensor = x, y: torch.Tensor = y, i: int = i) -> torch.Tensor:
                calls.append(i)
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(adp(x), y)
                loss.backward()
                return loss

            if use_closure:
                loss = optimizer.step(closure)
                assert isinstance(loss, torch.Tensor)  # the closure's loss, as torch returns
            else:
                train_step(adp, optimizer, x, y)
    return calls, model.weight.detach().clone()


def test_a_closure_passed_to_step_runs_first_on_every_micro_batch() -> None:
    # Lightning steps with a closure that runs forward and backward: it must run on
    # accumulation micro-batches too, and the steps must equal a plain loop's.
    calls, with_closure = _train_with_accumulation(use_closure=True)
    assert calls == list(range(N // 4))
    _, plain = _train_with_accumulation(use_closure=False)
    torch.testing.assert_close(with_closure, plain)
