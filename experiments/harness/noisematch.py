"""Noise matching: a fixed size's steps carry the initial batch's gradient noise.

The mechanism of the `noise_match` study (its docstring says why): before each
optimiser step the averaged gradient ``g_M`` becomes ``g_M + k (g_m - g_M)``, ``g_m``
the gradient of ``m`` of the batch's own samples and ``k`` from `extra_noise_weight`.
The trainer applies it under the ``noise-match`` variant (`experiments.harness.variants`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


def extra_noise_weight(scale: float, gain: float, level: float = 1.0) -> float:
    """``k`` for which ``g_M + k (g_m - g_M)`` has covariance ``level * Sigma / (gain * m)``.

    ``g_m`` is the mean gradient of ``m`` of the ``M = scale * m`` samples whose mean is
    ``g_M``, so ``Cov(g_m, g_M) = Sigma / M`` and the mix's covariance is
    ``((1 - k^2) / M + k^2 / m) Sigma``. ``gain`` is clipped to ``[1, scale]`` (the
    AdaScale gain's range). At ``level`` 1 (the initial batch's noise per unit of
    progress) a gain of 1 gives ``k = 1`` (the small batch's gradient) and ``scale``
    gives 0 (no added noise); a ``level`` in (0, 1) asks for that fraction of it, and
    ``k`` is 0 where the batch's own noise is already below it.
    """
    if not (scale >= 1.0 and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number >= 1, got {scale!r}")
    if not math.isfinite(gain):
        raise ValueError(f"gain must be finite, got {gain!r}")
    if not 0.0 < level <= 1.0:
        raise ValueError(f"level must be in (0, 1], got {level!r}")
    if scale == 1.0:
        return 0.0
    r = min(max(gain, 1.0), scale)
    return math.sqrt(max(scale * level / r - 1.0, 0.0) / (scale - 1.0))


def check_config(cfg: dict[str, Any], replicas: int) -> int:
    """The samples each of ``replicas`` contributes to the small batch of a
    ``noise_match`` run of the trainer config ``cfg``; ValueError for an adaptive
    run, one that accumulates, a batch below the initial one, or an initial batch the
    replicas do not divide."""
    b0 = cfg["init_batch_size"]
    local = cfg.get("local_bsz", 0)
    if (
        cfg.get("autoscale")
        or cfg.get("accum_steps", 0)
        or replicas < 1
        or b0 % replicas
        or local * replicas < b0
    ):
        raise ValueError(
            "noise_match needs a fixed size at least the initial batch, without "
            "accumulation, and an initial batch that the replicas divide; got "
            f"autoscale={cfg.get('autoscale')!r}, accum_steps={cfg.get('accum_steps')!r}, "
            f"local_bsz={local!r}, init_batch_size={b0!r}, replicas={replicas!r}"
        )
    return int(b0 // replicas)


def match_noise(
    model: Any,
    batch_loss: Callable[[Any, Any], Any],
    local_indices: Any,
    local_samples: int,
    weight: float,
) -> None:
    """Mix ``weight`` of the small-batch gradient into ``model``'s averaged ``.grad``.

    The small batch is the first ``local_samples`` of ``local_indices`` on every
    replica (the loader's order is already shuffled), its gradient averaged over the
    replicas with `torch.distributed` when a process group is up. The gradient is
    taken through detached copies of the parameters, so AdaptDL's gradient hooks
    (on the parameters themselves) do not see it. Its extra forward pass would
    update batch-norm statistics and draw dropout masks: the outcome problems' models
    have neither.
    """
    import torch.distributed as dist

    import torch

    if not 0 < local_samples <= len(local_indices):
        raise ValueError(
            f"local_samples must be in [1, {len(local_indices)}] (the local batch), "
            f"got {local_samples}"
        )
    named = [(name, p) for name, p in model.named_parameters() if p.grad is not None]
    copies = {name: p.detach().requires_grad_() for name, p in named}

    def net(*inputs: Any) -> Any:
        return torch.func.functional_call(model, copies, inputs)

    loss = batch_loss(net, local_indices[:local_samples])
    grads = torch.autograd.grad(loss, list(copies.values()))
    flat = torch.cat([g.reshape(-1) for g in grads])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
    offset = 0
    with torch.no_grad():
        for _, p in named:
            small = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            p.grad.add_(small - p.grad, alpha=weight)
