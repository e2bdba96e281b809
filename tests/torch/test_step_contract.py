"""One job's statistics through torch's adapter and the simulator's replay: identical decisions
(and, for a program that reports its training loss, an identical noise floor).

The probe model's loss is linear in its weights, so each micro-batch's gradient is
exactly the vector chosen for it. The vectors are small integers whose norms (and
the norm of their mean) are exact in float32, so the squared norms torch measures
equal, to the last bit, the ones the replay derives from the same statistics
(|G|^2 and the variance); both then go through core's step contract.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from torch.utils.data import TensorDataset

import adaptdl.torch as adl
import torch
from adaptdl.core.collective import LocalCollective
from adaptdl.core.stats.metrics import MetricsState
from adaptdl.core.stats.step import StepLoss, StepStatistics
from adaptdl.sim.replay import ReplaySteps
from adaptdl.torch import _context
from adaptdl.torch.parallel import AdaptiveDataParallel
from adaptdl.torch.stepping import _scaled_copies

INF = float("inf")
LR = 0.1  # the probe's SGD learning rate (no momentum: the floor's rate is the rate)
TARGET_LOSS = 0.25

#: (g1, g2) per optimiser step of two accumulated micro-batches; None: a non-finite step.
ACCUMULATED: list[tuple[tuple[float, ...], tuple[float, ...]] | None] = [
    ((-9, -6, -2), (-9, 6, 2)),
    ((0, 6, -8), (0, 9, 0)),
    None,
    ((0, 6, -8), (6, 9, -2)),
    ((-9, -6, -2), (-6, 0, -8)),
    ((0, 6, -8), (8, -4, -8)),
    ((-9, -6, -2), (-2, -4, 4)),
]

#: One micro-batch per step, all of norm 5, consecutive means of exact norm.
SINGLE: list[tuple[float, ...] | None] = [
    (-4, -3, 0),
    (-4, 3, 0),
    (-4, -3, 0),
    None,
    (-4, 3, 0),
    (-4, -3, 0),
    (-4, 3, 0),
]


class Probe(torch.nn.Module):
    """``loss = x . w``: the gradient with respect to ``w`` is ``x``, whatever ``w``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.weight).sum()


def _sqr(v: tuple[float, ...]) -> float:
    return float(sum(a * a for a in v))


def _torch_decisions(
    micro_batches: list[list[tuple[float, ...] | None]],
    local_bsz: int,
    accum: int,
    losses: list[float] | None = None,
) -> tuple[list[tuple[float, float, float]], dict[str, Any]]:
    """Train the probe; return (lr factor, gain, progress) after each optimiser step.

    ``losses``: the loss the program reports for each micro-batch (None: none).
    """
    loader = adl.AdaptiveDataLoader(TensorDataset(torch.arange(256)), batch_size=local_bsz)
    loader.autoscale_batch_size(8 * local_bsz, (1, 4 * local_bsz), gradient_accumulation=True)
    _context.current_job().batch_size_decision = lambda query: (local_bsz, accum)
    model = Probe()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    adp = AdaptiveDataParallel(model, optimizer)
    flat = [g for step in micro_batches for g in step]
    decisions = []
    for _ in adl.remaining_epochs_until(1):
        for i, _batch in enumerate(loader):
            g = flat[i]
            x = torch.full((3,), INF) if g is None else torch.tensor(g, dtype=torch.float32)
            optimizer.zero_grad()
            adp(x).backward()
            if losses is not None:
                adp.report_loss(losses[i], target_loss=TARGET_LOSS)
            optimizer.step()
            helper = adl.current_dataloader()
            assert helper is not None
            if helper.is_optim_step():
                decisions.append((adp.last_lr_factor, adp.last_gain, adp.progress))
            if i + 1 == len(flat):
                break
    assert adp.gns is not None
    return decisions, adp.gns.to_json()


def _replay_decisions(
    stats: list[tuple[float, float]],
    local_bsz: int,
    micro: int,
    losses: list[StepLoss] | None = None,
    metrics: MetricsState | None = None,
) -> tuple[list[tuple[float, float, float]], dict[str, Any]]:
    """The replay's steps for (|G|^2, variance at the initial batch) per step, with the
    loss reported for each step in ``losses`` (None: none), into ``metrics``."""
    metrics = metrics or MetricsState()
    steps = ReplaySteps(StepStatistics(metrics, LocalCollective()), init_batch_size=local_bsz)
    decisions = []
    for i, (sqr, var) in enumerate(stats):
        d = steps.step(sqr, var, local_bsz, micro, 1, None if losses is None else losses[i])
        assert len(set(d.lr_factors)) == 1
        decisions.append((d.lr_factors[0], d.gain, d.progress))
    assert metrics.gns is not None
    return decisions, metrics.gns.to_json()


def _accumulated_stats() -> list[tuple[float, float]]:
    """The replay's (|G|^2, variance) for each step of `ACCUMULATED` (initial batch 2)."""
    stats = []
    for pair in ACCUMULATED:
        if pair is None:
            stats.append((INF, 0.0))
            continue
        g1, g2 = pair
        mean = tuple((a + b) / 2 for a, b in zip(g1, g2, strict=True))
        local, total = _sqr(g1) + _sqr(g2), _sqr(mean)
        # The replay's norms: local = 2 (sqr + var), total = sqr + var / 2 (init = local bsz).
        var = local - 2 * total
        stats.append((2 * total - local / 2, var))
    return stats


def _accumulated_steps() -> list[list[tuple[float, ...] | None]]:
    return [[None, None] if p is None else list(p) for p in ACCUMULATED]


def test_accumulated_steps_decide_the_same_in_torch_and_in_the_replay() -> None:
    # Initial batch 2, two micro-batches of 2: scale 2, so the gain and factor vary.
    local_bsz = 2
    stats = _accumulated_stats()
    torch_side, torch_gns = _torch_decisions(_accumulated_steps(), local_bsz, accum=1)
    replay_side, replay_gns = _replay_decisions(stats, local_bsz, micro=2)
    assert torch_side == replay_side
    assert torch_gns == replay_gns
    assert torch_gns["num_updates"] == len(ACCUMULATED) - 1  # the non-finite step skipped
    assert any(factor > 1.0 for factor, _, _ in torch_side)


def test_single_micro_batch_steps_pair_the_same_in_torch_and_in_the_replay() -> None:
    local_bsz = 4
    stats = []
    for prev, cur in zip([None, *SINGLE], SINGLE, strict=False):
        if cur is None:
            stats.append((INF, 0.0))
            continue
        c = _sqr(cur)
        if prev is None:
            stats.append((c, 0.0))  # no pair: only |g|^2 is measured
            continue
        mixed = _sqr(tuple((a + b) / 2 for a, b in zip(prev, cur, strict=True)))
        # The replay's pair: |g|^2 = sqr + var, |(g_p + g_c) / 2|^2 = sqr + var / 2.
        stats.append((2 * mixed - c, 2 * (c - mixed)))
    torch_side, torch_gns = _torch_decisions([[g] for g in SINGLE], local_bsz, accum=0)
    replay_side, replay_gns = _replay_decisions(stats, local_bsz, micro=1)
    assert torch_side == replay_side
    assert torch_gns == replay_gns
    # Unpaired: the first step and the one after the non-finite step.
    assert torch_gns["num_updates"] == len(SINGLE) - 3
    assert all(math.isfinite(p) for _, _, p in torch_side)


def test_reported_losses_reach_the_noise_floor_the_same_in_torch_and_in_the_replay() -> None:
    # Each micro-batch reports a loss (one of them not finite: the step's mean is of
    # the others); torch averages a step's losses, the replay is handed the mean.
    local_bsz = 2
    flat = [2.0 - 0.125 * i for i in range(2 * len(ACCUMULATED))]
    flat[5] = math.nan
    torch_side, _ = _torch_decisions(_accumulated_steps(), local_bsz, accum=1, losses=flat)
    torch_floor = _context.current_job().metrics.floor
    assert torch_floor is not None
    per_step = []
    for a, b in zip(flat[::2], flat[1::2], strict=True):
        finite = [v for v in (a, b) if math.isfinite(v)]
        per_step.append(StepLoss(sum(finite) / len(finite), (LR,), TARGET_LOSS))
    metrics = MetricsState()
    replay_side, _ = _replay_decisions(
        _accumulated_stats(), local_bsz, micro=2, losses=per_step, metrics=metrics
    )
    assert replay_side == torch_side
    assert metrics.floor is not None
    assert metrics.floor.to_json() == torch_floor.to_json()
    # Every optimiser step reached the floor, each with a finite mean loss.
    assert torch_floor.steps == len(ACCUMULATED)
    assert torch_floor.loss_weight > 0.0


@pytest.mark.parametrize("accum", [0, 1])
def test_progress_is_the_sum_of_the_gains(accum: int) -> None:
    steps: list[list[tuple[float, ...] | None]] = [
        [(-9, -6, -2), (-9, 6, 2)][: accum + 1] for _ in range(4)
    ]
    decisions, _ = _torch_decisions(steps, 2, accum)
    assert decisions[-1][2] == pytest.approx(math.fsum(g for _, g, _ in decisions))


def test_the_kept_gradient_copies_hold_no_graph() -> None:
    # backward(create_graph=True) (a gradient penalty, MAML) gives gradients with a
    # graph; the copies kept to pair with the next step must not hold on to it.
    w = torch.randn(3, requires_grad=True)
    (grad,) = torch.autograd.grad((w**3).sum(), w, create_graph=True)
    assert grad.requires_grad
    for grads in ([grad, grad * 2], [grad.to_sparse()]):
        copies = _scaled_copies(grads, 2.0)
        assert not any(c.requires_grad for c in copies)
        assert all(
            torch.equal(c.to_dense(), g.detach().to_dense() / 2)
            for c, g in zip(copies, grads, strict=True)
        )


def test_a_parameter_group_added_after_wrapping_is_refused_by_name() -> None:
    loader = adl.AdaptiveDataLoader(TensorDataset(torch.randn(16, 3)), batch_size=4)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.01)
    adp = AdaptiveDataParallel(model, optimizer)
    optimizer.add_param_group({"params": model[1].parameters()})
    with pytest.raises(ValueError, match="2 parameter groups but had 1"):
        for _ in adl.remaining_epochs_until(1):
            for (x,) in loader:
                adp(x).sum().backward()
