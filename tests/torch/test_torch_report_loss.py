"""`AdaptiveSteps.report_loss`: the training loss reaches core's noise floor (opt-in)."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import TensorDataset

import adaptdl.torch as adl
import torch
from adaptdl.core.loop.boundary import Preempted
from adaptdl.core.stats.estimators import ESTIMATORS
from adaptdl.core.stats.floor import FloorConfig, floor_level, floor_share, sgd_rate
from adaptdl.core.stats.gns import GradientNoiseScale
from adaptdl.core.stats.metrics import MetricsConfig
from adaptdl.core.stats.scaling import adascale_gain
from adaptdl.torch import _context
from adaptdl.torch.parallel import AdaptiveDataParallel
from adaptdl.torch.scaling_rules import AdamScale, LinearScale

N = 64


def data() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, 3, generator=gen)
    # Label noise: the gradient keeps a noise floor to credit.
    y = x.sum(1, keepdim=True) + 0.5 * torch.randn(N, 1, generator=gen)
    return TensorDataset(x, y)


def sgd(lr: float = 0.05, **options: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    return model, torch.optim.SGD(model.parameters(), lr=lr, **options)


def accumulating() -> tuple[adl.AdaptiveDataLoader, AdaptiveDataParallel, torch.optim.Optimizer]:
    """A loader whose decision is 2 micro-batches of 4 a step, and an SGD model."""
    loader = adl.AdaptiveDataLoader(data(), batch_size=4)
    loader.autoscale_batch_size(8, (1, 4), gradient_accumulation=True)
    _context.current_job().batch_size_decision = lambda query: (4, 1)
    model, opt = sgd()
    return loader, AdaptiveDataParallel(model, opt), opt


def test_report_loss_refuses_what_the_floor_does_not_cover() -> None:
    model = torch.nn.Linear(3, 1)
    adam = torch.optim.Adam(model.parameters())
    with pytest.raises(ValueError, match=r"defined for torch\.optim\.SGD only, got Adam"):
        AdaptiveDataParallel(model, adam, scaling_rule=AdamScale()).report_loss(0.5)
    _context._reset()
    model, opt = sgd(momentum=0.9, nesterov=True)
    with pytest.raises(ValueError, match="without Nesterov momentum"):
        AdaptiveDataParallel(model, opt).report_loss(0.5)
    _context._reset()
    model, opt = sgd()
    with pytest.raises(ValueError, match=r"needs the AdaScale scaling rule.*LinearScale"):
        AdaptiveDataParallel(model, opt, scaling_rule=LinearScale()).report_loss(0.5)
    _context._reset()
    model, opt = sgd()
    adp = AdaptiveDataParallel(model, opt)
    with pytest.raises(ValueError, match=r"a tensor of one element, got a tensor of shape \(2,\)"):
        adp.report_loss(torch.ones(2))
    with pytest.raises(TypeError, match="loss must be a tensor or a real number, got 'x'"):
        adp.report_loss("x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="target_loss must be finite"):
        adp.report_loss(0.5, target_loss=math.inf)
    assert adp._losses == []  # nothing refused was kept
    with pytest.raises(ValueError, match=r"inside the training loop .*got no loop"):
        adp.report_loss(0.5)


def test_report_loss_refuses_a_validation_loop_and_a_second_model() -> None:
    train = adl.AdaptiveDataLoader(data(), batch_size=4)
    train.train()
    valid = adl.AdaptiveDataLoader(data(), batch_size=8)
    model, opt = sgd()
    adp = AdaptiveDataParallel(model, opt)
    other, other_opt = sgd()
    second = AdaptiveDataParallel(other, other_opt, name="second")
    for _ in adl.remaining_epochs_until(1):
        for x, y in train:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(adp(x), y)
            loss.backward()
            opt.step()
            adp.report_loss(loss)
            with pytest.raises(ValueError, match=r"'second' reports .* already does"):
                second.report_loss(loss)
        with torch.no_grad():
            for x, y in valid:
                with pytest.raises(ValueError, match=r"inside the training loop .*got adaptdl"):
                    adp.report_loss(torch.nn.functional.mse_loss(adp(x), y))
                break


def _train(adp: Any, opt: torch.optim.Optimizer, loader: Any, epochs: int) -> list[float]:
    """Train, reporting each step's loss (a tensor) after the step; the losses."""
    losses = []
    for _ in adl.remaining_epochs_until(epochs):
        for x, y in loader:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(adp(x), y)
            loss.backward()
            opt.step()
            adp.report_loss(loss)
            losses.append(loss.item())
    return losses


def test_the_reported_losses_set_the_floor_share_at_the_base_rate(writer: Any) -> None:
    loader = adl.AdaptiveDataLoader(data(), batch_size=4)
    # Total 8 on one replica: AdaScale scales the rate by its gain (> 1) for each step.
    loader.autoscale_batch_size(8, (1, 8))
    _context.current_job().batch_size_decision = lambda query: (8, 0)
    model, opt = sgd(momentum=0.9)
    adp = AdaptiveDataParallel(model, opt)
    losses = _train(adp, opt, loader, 16)  # 128 steps, past the floor's 100
    floor = adp._job.metrics.floor
    assert floor is not None
    # A loss reported after its step is folded at the next one: all but the last.
    assert floor.steps == len(losses) - 1 and adp._losses
    expected = 0.0
    weight = 0.0
    for loss in losses[:-1]:
        expected = 0.99 * expected + 0.01 * loss
        weight = 0.99 * weight + 0.01
    assert floor.average == pytest.approx(expected / weight, rel=1e-6)
    gns = adp.gns
    assert gns is not None and gns.resolved and adp.last_lr_factor > 1.05
    # The base rate (the initial batch's), not the one scaled for the step.
    base = floor_level(sgd_rate(0.05, 0.9), gns.var, 4)
    floor0 = floor.floor0_at(adp._job.metrics.grad_params())
    assert floor0 == pytest.approx(base, rel=1e-6)
    assert floor0 != pytest.approx(base * adp.last_lr_factor, rel=1e-3)
    share = adp._job.metrics.floor_share()
    assert 0.0 < share <= 0.9
    fn = adp._job.goodput_fn()
    raw = adp._job.metrics.grad_params()
    assert fn is not None and raw is not None and fn.grad_params.var > raw.var
    adp.to_tensorboard(writer, 1)
    assert writer.scalars["Gradient/floor_share"] == (share, 1)


def test_without_a_target_the_share_reads_what_the_drift_shed_over_the_horizon() -> None:
    loader = adl.AdaptiveDataLoader(data(), batch_size=4)
    loader.autoscale_batch_size(8, (1, 8))
    _context.current_job().batch_size_decision = lambda query: (8, 0)
    model, opt = sgd(momentum=0.9)
    adp = AdaptiveDataParallel(model, opt)
    _train(adp, opt, loader, 48)  # 384 steps: the record reaches back half the progress
    floor = adp._job.metrics.floor
    assert floor is not None and floor.active
    points = floor.drift.points
    # Recorded at the job's progress, from the 100th loss on, back to half of it.
    assert points[0][0] <= adp.progress / 2 < points[1][0] and points[-1][0] < adp.progress
    drift = floor.drift_sum / floor.drift_weight
    # The target read is the drift less what it shed (not the least credit's 0), and
    # the share is larger than that of a target of 0.
    basis = floor.to_json()["basis"]
    assert basis["target_loss"] != 0.0 and basis["target_loss"] <= drift + 1e-12
    share = adp._job.metrics.floor_share()
    params = adp._job.metrics.grad_params()
    assert params is not None
    efficiency = adascale_gain(params.sqr, params.var, basis["scale"]) / basis["scale"]
    least = floor_share(floor.floor0_at(params), basis["average"], efficiency, 0.0)
    assert least < share <= 0.9


def test_the_losses_of_a_steps_micro_batches_are_averaged_into_it() -> None:
    loader, adp, opt = accumulating()
    reported: list[float] = []
    for _ in adl.remaining_epochs_until(1):
        for i, (x, _y) in enumerate(loader):
            opt.zero_grad()
            adp(x).sum().backward()
            adp.report_loss(torch.tensor(float(i)))  # before the step: folded at this one
            reported.append(float(i))
            opt.step()
    floor = adp._job.metrics.floor
    assert floor is not None and floor.steps == len(reported) // 2 > 1
    means = [(a + b) / 2 for a, b in zip(reported[::2], reported[1::2], strict=True)]
    total = weight = 0.0
    for mean in means:
        total, weight = 0.99 * total + 0.01 * mean, 0.99 * weight + 0.01
    assert floor.average == pytest.approx(total / weight)


def test_the_floor_survives_a_restart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path))

    def build() -> tuple[Any, ...]:
        adl.init_process_group("gloo")
        loader = adl.AdaptiveDataLoader(data(), batch_size=4)
        loader.train()
        model, opt = sgd(momentum=0.9)
        return loader, opt, AdaptiveDataParallel(model, opt)

    loader, opt, adp = build()
    steps = 0
    with pytest.raises(Preempted):
        for _ in adl.remaining_epochs_until(2):
            for step, (x, y) in enumerate(loader):
                steps += 1
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(adp(x), y)
                adp.report_loss(loss)  # before the step: folded at this one
                loss.backward()
                opt.step()
                if step == 5:
                    _context.current_job().request_stop()
    saved = copy.deepcopy(adp._job.metrics.floor.to_json())
    assert saved["steps"] == steps > 6  # one per step, each reported before it
    _context._reset()
    _, _, adp = build()
    floor = adp._job.metrics.floor
    assert floor.to_json() == saved
    assert not floor.active  # fewer than 100 losses: no share yet


def test_the_losses_of_micro_batches_left_unstepped_are_dropped_with_their_gradients() -> None:
    loader, adp, opt = accumulating()
    for epoch in adl.remaining_epochs_until(2):
        for i, (x, _y) in enumerate(loader):
            opt.zero_grad()
            adp(x).sum().backward()
            adp.report_loss(100.0 if epoch == 0 else 1.0)
            opt.step()
            if epoch == 0:
                break  # one micro-batch accumulated, never stepped
            if i == 1:
                break  # one optimiser step in the new loop
    floor = adp._job.metrics.floor
    assert floor is not None and floor.steps == 1 and floor.average == pytest.approx(1.0)


def test_a_loss_reported_before_backward_survives_the_drop_of_a_stale_micro_batch() -> None:
    loader, adp, opt = accumulating()
    for epoch in adl.remaining_epochs_until(2):
        for i, (x, _y) in enumerate(loader):
            out = adp(x).sum()
            adp.report_loss(100.0 if epoch == 0 else 10.0 + i)  # before backward
            out.backward()
            opt.step()
            opt.zero_grad()
            if epoch == 0 or i == 1:
                break  # epoch 0: one micro-batch, never stepped; epoch 1: one step
    floor = adp._job.metrics.floor
    assert floor is not None and floor.steps == 1 and floor.average == pytest.approx(10.5)


def test_the_losses_of_a_step_the_grad_scaler_skips_join_the_next_step() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    loader = adl.AdaptiveDataLoader(data(), batch_size=8)
    loader.train()
    model, opt = sgd()
    adp = AdaptiveDataParallel(model, opt, mp_scaler=scaler)
    for _ in adl.remaining_epochs_until(1):
        for i, (x, y) in enumerate(loader):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(adp(x), y)
            scaled = loss * float("inf") if i == 1 else loss
            adp.report_loss(10.0 * (i + 1))  # before the step: folded at its own
            scaler.scale(scaled).backward()
            scaler.step(opt)  # step 1 is skipped: its loss waits for step 2
            scaler.update()
            if i == 2:
                break
    floor = adp._job.metrics.floor
    assert floor is not None and floor.steps == 2  # steps 0 and 2 ran the optimiser
    # Step 0 folded 10; step 2 the mean of 20 (the skipped step's) and 30.
    expected = (0.99 * 0.01 * 10.0 + 0.01 * 25.0) / (0.99 * 0.01 + 0.01)
    assert floor.average == pytest.approx(expected)


def test_a_job_with_two_models_counts_the_lapse_once_per_batch() -> None:
    loader = adl.AdaptiveDataLoader(data(), batch_size=8)
    loader.train()
    model, opt = sgd()
    adp = AdaptiveDataParallel(model, opt)
    other, other_opt = sgd()
    second = AdaptiveDataParallel(other, other_opt, name="second")  # a GAN's other model
    for _ in adl.remaining_epochs_until(1):
        for i, (x, y) in enumerate(loader):
            for net, optimizer in ((adp, opt), (second, other_opt)):
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(net(x), y)
                loss.backward()
                optimizer.step()
            if i == 0:
                adp.report_loss(1.0)  # folded at batch 1's first step
            if i == 2:
                break
    floor = adp._job.metrics.floor
    # Batches 1 and 2 count one optimiser step each toward the lapse, not two.
    assert floor is not None and floor.steps == 1 and floor.idle == 2


def test_the_floor_off_by_config_takes_the_reported_losses_and_credits_nothing(
    writer: Any,
) -> None:
    adl.init_process_group("gloo", metrics_config=MetricsConfig(floor=FloorConfig(enabled=False)))
    loader = adl.AdaptiveDataLoader(data(), batch_size=4)
    loader.autoscale_batch_size(8, (1, 8))
    _context.current_job().batch_size_decision = lambda query: (8, 0)
    model, opt = sgd(momentum=0.9)
    adp = AdaptiveDataParallel(model, opt)
    _train(adp, opt, loader, 16)  # 128 steps: past the floor's 100, were it on
    metrics = adp._job.metrics
    assert metrics.floor is None and metrics.floor_share() == 0.0
    fn = adp._job.goodput_fn()
    assert fn is not None and fn.grad_params == metrics.grad_params()
    adp.to_tensorboard(writer, 1)
    assert "Gradient/floor_share" not in writer.scalars


def test_init_process_group_makes_the_estimator_the_config_names() -> None:
    def smoothed(init_batch_size: int, num_groups: int) -> GradientNoiseScale:
        return GradientNoiseScale(
            init_batch_size=init_batch_size, num_groups=num_groups, smoothing=0.9
        )

    adl.init_process_group(
        "gloo",
        metrics_config=MetricsConfig(estimator="smoothed"),
        estimators={**ESTIMATORS, "smoothed": smoothed},
    )
    loader, adp, opt = accumulating()
    _train(adp, opt, loader, 1)
    assert adp.gns is not None and adp.gns.smoothing == 0.9 and adp.gns.has_estimate
