"""The torch side of core's step contract, shared by the data-parallel and sharded wrappers.

`AdaptiveSteps` is what `AdaptiveDataParallel` (DDP) and `AdaptiveFSDP` (FSDP2)
have in common. Core decides which optimiser steps measure the gradient-noise
statistics (`StepStatistics.measures`: all of them while their cost is within its
budget, a share of them otherwise). On a measured step the local squared norms
(before any reduction) and the squared norm of the reduced gradient go to core
as a `StepMeasurement` (`adaptdl.core.stats.step`) after the step's last backward
pass, with the seconds the statistics cost; an unmeasured step computes no norm.

Where the norms come from is the wrapper's: DDP reads a replica's own gradients
in ``.grad`` at the end of the backward pass, before its callback writes the
reduced ones there, and the reduced ones after it (one fused norm per parameter
group each, however many tensors it holds, and no communication hook of ours on
any step); FSDP2 measures each module's flat local gradient at its reduce-scatter
and the reduced shards with one fused norm per group; a
replica's accumulation micro-batches and a preconditioned gradient
(`AdamScale(preconditioned=True)`) are measured per parameter by gradient hooks,
armed only for the measured steps that need them. With one replica and one
micro-batch, a measured step pairs with the step before it, whose gradient is
copied (into a buffer kept for it) only when the next step is measured. On a GPU
the norms stay on the device and core reads them one step later. The step time
the budget weighs the cost against is the CPU time between two steps of one loop
run, never what ran between two loops.

The time spent waiting for the reduction after the backward computation goes to
the profiler. Accumulation micro-batches leave the gradients summing in ``.grad``
without a reduction; on the step they are divided by the number of
micro-batches, so the optimiser always sees the mean gradient of the whole batch.
``optimizer.step()`` asks core for the step's `StepDecision`, multiplies each
group's learning rate by its factor for that step only, then commits the step's
gain to the job's progress. Losses the program reports
(`AdaptiveSteps.report_loss`) go with the step's question to core (a `StepLoss`),
which folds them into the job's noise floor.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from adaptdl.core.job import Job
from adaptdl.core.loop.loader import LoaderHelper
from adaptdl.core.stats.gns import GradientNoiseScale
from adaptdl.core.stats.step import (
    Fold,
    PairedNorms,
    StepLoss,
    StepMeasurement,
    StepStatistics,
    split_by_size,
)
from adaptdl.core.validate import check_float
from adaptdl.torch._loss import check_floor_optimizer, check_loss, floor_rates, mean_loss
from adaptdl.torch.scaling_rules import AdamScale, AdaScale, ScalingRuleBase

__all__ = ["AdaptiveSteps", "check_arguments", "register_grad_hooks", "set_step_attr"]


def _norm(grad: torch.Tensor) -> torch.Tensor:
    """The L2 norm of a gradient as a scalar tensor (no device sync)."""
    grad = grad.detach()
    if grad.is_sparse:
        grad = grad.coalesce().values()
    half = grad.dtype in (torch.float16, torch.bfloat16)
    norm: torch.Tensor = torch.linalg.vector_norm(grad, dtype=torch.float32 if half else None)
    return norm


def _norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The L2 norm of each gradient (one fused call for dense ones)."""
    if grads and not any(g.is_sparse or g.dtype in (torch.float16, torch.bfloat16) for g in grads):
        return list(torch._foreach_norm(grads))
    return [_norm(g) for g in grads]


def _inner(a: list[torch.Tensor], b: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``sum_i a[i] . b[i]`` as a float64 scalar tensor on ``device`` (dense tensors of
    equal shapes; no device sync)."""
    if not a:
        return torch.zeros((), dtype=torch.float64, device=device)
    dots = []
    for x, y in zip(a, b, strict=True):
        x, y = x.detach().reshape(-1), y.detach().reshape(-1)
        if x.is_complex() or y.is_complex():
            # Re <x, y>: what |x + y|^2 = |x|^2 + |y|^2 + 2 Re <x, y> needs.
            dots.append(torch.vdot(x.to(torch.complex64), y.to(torch.complex64)).real)
            continue
        if x.dtype in (torch.float16, torch.bfloat16) or y.dtype != x.dtype:
            x, y = x.float(), y.float()
        dots.append(torch.dot(x, y))
    return torch.stack(dots).double().sum()


def _sums(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[torch.Tensor]:
    """``a[i] + b[i]`` for each i (one fused call for dense tensors)."""
    if a and not any(t.is_sparse for t in (*a, *b)):
        return list(torch._foreach_add(a, b))
    return [x + y for x, y in zip(a, b, strict=True)]


def _same_shapes(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return [[t.shape for t in g] for g in a] == [[t.shape for t in g] for g in b]


def _sum_sqr_norms(norms: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the squares of ``norms`` as a float64 scalar tensor on their device
    (0 for none)."""
    if not norms:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack(norms).double().square().sum()


def _scaled_copies(grads: list[torch.Tensor], scale: float) -> list[torch.Tensor]:
    """Fresh tensors holding ``grads / scale`` (one fused call for dense gradients)."""
    # Detached: under backward(create_graph=True) the gradients carry a graph, which
    # the copies kept until the next step must not hold on to.
    grads = [g.detach() for g in grads]
    if grads and not any(g.is_sparse for g in grads):
        return list(torch._foreach_div(grads, scale))
    return [g / scale for g in grads]


class _Gain(float):
    """A float that may also be called for its own value (``gain`` was once a method)."""

    def __call__(self) -> float:
        return float(self)


def _check_mp_scaler(mp_scaler: Any) -> None:
    """TypeError unless ``mp_scaler`` is None or a GradScaler (or quacks like one)."""
    if mp_scaler is None or isinstance(mp_scaler, torch.amp.GradScaler):
        return
    needed = ("scale", "unscale_", "step", "update", "get_scale", "is_enabled", "state_dict")
    if all(callable(getattr(mp_scaler, attr, None)) for attr in needed):
        return
    hint = (
        f"; to name the model, pass name={mp_scaler!r} by keyword (the fourth positional "
        "argument is mp_scaler)"
        if isinstance(mp_scaler, str)
        else ""
    )
    raise TypeError(
        f"mp_scaler must be a torch.amp.GradScaler or None, got {mp_scaler!r} "
        f"({type(mp_scaler).__name__}){hint}"
    )


def check_arguments(optimizer: Any, scaling_rule: Any, mp_scaler: Any = None) -> None:
    """ValueError unless ``optimizer`` is an optimiser and ``scaling_rule`` one of ours or None;
    TypeError unless ``mp_scaler`` is a GradScaler or None."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {optimizer!r}")
    if isinstance(optimizer, torch.optim.LBFGS):
        # Its step re-evaluates the closure several times; the step here runs the closure
        # once, for the micro-batch's gradients, and measures them before stepping.
        raise ValueError(
            "optimizer must take one step per closure evaluation: torch.optim.LBFGS "
            "re-evaluates its closure within a step, which adaptive batches cannot follow"
        )
    _check_mp_scaler(mp_scaler)
    if scaling_rule is not None and not isinstance(scaling_rule, ScalingRuleBase):
        raise ValueError(
            "scaling_rule must be one of adaptdl.torch.scaling_rules (AdaScale, AdamScale, "
            f"LinearScale, SqrtScale, LEGWScale), got {scaling_rule!r}"
        )


def register_grad_hooks(
    steps: AdaptiveSteps, params: list[tuple[int, torch.Tensor]]
) -> list[torch.utils.hooks.RemovableHandle]:
    """Have the gradient of each ``(group, param)`` feed ``steps``' local squared norms;
    return the hooks' handles."""
    return [
        param.register_hook(functools.partial(steps._grad_hook, index, param))  # type: ignore[no-untyped-call]
        for index, param in params
        if param.requires_grad
    ]


def set_step_attr(module: torch.nn.Module, name: str, value: Any) -> None:
    """Set attribute ``name`` of ``module``, an `AdaptiveSteps` wrapper that is an
    nn.Module: its step state (``_step_attrs``) directly, anything else as
    nn.Module does.

    Module.__setattr__ checks every value for a parameter, module or buffer, a few
    microseconds a set; the step state, some thirty sets a step, is none of those.
    """
    if name in module.__dict__.get("_step_attrs", ()):
        object.__setattr__(module, name, value)
    else:
        torch.nn.Module.__setattr__(module, name, value)


def _cpu() -> float:
    """This thread's CPU seconds: what the statistics' budget is measured in.

    CPU time, not the wall clock: on a shared machine a norm of microseconds
    preempted for milliseconds would read as costly; each thread times its own work
    (the communication hook's callbacks run on the reduction's thread).
    """
    return time.thread_time()


def _sqr(tensor: torch.Tensor) -> torch.Tensor:
    """The squared L2 norm of ``tensor`` as a float64 scalar tensor on its device (no sync)."""
    return _norm(tensor).double().square()


def _group_sums(
    parts: list[tuple[int, torch.Tensor]], num_groups: int, device: torch.device
) -> list[torch.Tensor]:
    """Per group, the sum of the ``(group, squared norm)`` parts (0 for a group with none)."""
    rows: list[list[torch.Tensor]] = [[] for _ in range(num_groups)]
    for group, value in parts:
        rows[group].append(value.to(device))
    return [
        torch.stack(row).sum() if row else torch.zeros((), dtype=torch.float64, device=device)
        for row in rows
    ]


class _Lagged:
    """A step's squared norms on their way from the device to the host, and what goes
    with them into the `StepMeasurement` core is handed one step later."""

    def __init__(self, values: torch.Tensor, build: Callable[[list[float]], object]) -> None:
        self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        self.host.copy_(values, non_blocking=True)
        self.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self.event.record()
        self.build = build

    def finish(self) -> None:
        self.event.synchronize()  # the copy was queued a step ago: long done
        self.build(self.host.tolist())


class AdaptiveSteps:
    """Gradient statistics, accumulation, learning-rate factors and metrics of one wrapper.

    A wrapper calls :meth:`_init_steps`, registers its gradient hooks
    (:func:`register_grad_hooks`), says where a measured step's local norms may come
    from (``_local_in_grads``: ``.grad`` at the end of the backward pass;
    ``_fused_norms``: its reduction fills ``_bucket_local``)
    and provides :meth:`_will_sync` (and, for a sharded model, :meth:`_local_grad`
    and :meth:`_total_squares`).
    """

    _job: Job
    adaptdl_optimizer: torch.optim.Optimizer
    adaptdl_mp_scaler: Any
    scaling_rule: ScalingRuleBase

    def _init_steps(
        self,
        job: Job,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any,
        mp_scaler: Any,
        scaling_rule: ScalingRuleBase | None,
        name: str,
    ) -> None:
        """Set up the step statistics (after the wrapper's own ``__init__``); ``name``
        is the wrapper's, under which it is checkpointed."""
        before = set(vars(self))
        self._job = job
        self._adaptdl_name = name
        self.adaptdl_optimizer = optimizer
        self.adaptdl_lr_scheduler = lr_scheduler
        self.adaptdl_mp_scaler = mp_scaler
        self.scaling_rule: ScalingRuleBase = scaling_rule or AdaScale()
        self._num_groups = len(optimizer.param_groups)
        # Per group, squared norms of the local micro-batch gradients since the last step
        # (from the gradient hooks).
        self._local_parts: list[list[torch.Tensor]] = [[] for _ in range(self._num_groups)]
        # (group, squared norm) of each flat gradient before its reduction, this
        # backward pass (the reduction of a wrapper with `_fused_norms`).
        self._bucket_local: list[tuple[int, torch.Tensor]] = []
        self._fused_norms = False  # whether the wrapper measures flat gradients
        # Whether the replica's own gradients stay in ``.grad`` until after the last
        # backward pass's bookkeeping (`_after_backward`), while their reduction runs
        # elsewhere: then a measured step reads its local norms there, one fused norm
        # per group (`_grads_local`), and its total norms from ``.grad`` after the
        # reduction.
        self._local_in_grads = False
        self._grads_local = False
        # Per group, the squared norm of the replica's gradient read at the end of the
        # last backward pass (`_grads_local`), on the device; None: not read.
        self._grad_local: list[torch.Tensor] | None = None
        self._in_backward = False
        self._need_local = True  # whether the step needs local norms at all
        # The plan of the step under way (None: not planned yet): whether core has it
        # measured, whether the gradient hooks measure local norms, whether the buckets do.
        self._measuring: bool | None = None
        self._plan_share = 1.0  # the budget's share when the step was planned
        self._hook_local = False
        self._buckets_local = False
        # The hooks a wrapper arms only for a measured step (`_hook_params`).
        self._hook_params: list[tuple[int, torch.Tensor]] = []
        self._hook_handles: list[torch.utils.hooks.RemovableHandle] = []
        self._stat_cost = 0.0  # seconds spent on the step's statistics so far
        # The CPU clock and the loop run (`Job.loop_runs`) at the last synchronised
        # backward pass, and the last interval between two such passes of one loop run:
        # the step time the budget weighs the statistics against.
        self._last_sync: float | None = None
        self._last_sync_run = -1
        self._step_time = 0.0
        # Loop positions of the micro-batches accumulated in .grad since the last step:
        # several backward passes on one micro-batch add up, they are not averaged.
        self._micro: set[int] = set()
        # The loop run (`Job.loop_runs`) and index of the last micro-batch accumulated.
        self._accum_run = 0
        self._accum_index = 0
        self._loader: LoaderHelper | None = None
        self._sync_start = 0.0
        self._steps = StepStatistics(job.metrics, job.collective)
        job.on_drain(self._drain)
        # The previous single-micro-batch step's gradient (divided by the loss scale),
        # kept only when the next step is measured, and its squared norms (per group,
        # on the device); the general path's fresh copies (a preconditioner, sparse).
        self._prev_buf: list[list[torch.Tensor]] | None = None
        self._prev_buf_valid = False
        self._prev_grads: list[list[torch.Tensor]] | None = None
        self._prev_bsz = 0
        self._prev_total: list[torch.Tensor] = []
        self._lagged: _Lagged | None = None
        # The split of the reduced gradient's tensors between the replicas (`_my_part`):
        # this replica's indices per group, for the sizes and replicas of its key.
        self._part: list[list[int]] = []
        self._part_key: tuple[int, tuple[tuple[int, ...], ...]] | None = None
        self.last_lr_factor = 1.0
        self.last_gain = 1.0
        self._plain = False
        # Losses reported since the last step (`report_loss`), the target stated, and
        # whether the first report checked the optimiser, its rates and the reporter.
        self._losses: list[torch.Tensor | float] = []
        self._target_loss: float | None = None
        self._floor_checked = False
        # Every attribute set above: the statistics' own state, set dozens of times a
        # step and never a parameter, module or buffer. A wrapper that is an
        # nn.Module sets them past Module.__setattr__'s registration checks
        # (`set_step_attr`).
        object.__setattr__(self, "_step_attrs", frozenset(vars(self)) - before)

    # -- the step's plan -----------------------------------------------------------------
    def _plan_step(self, armable: bool) -> None:
        """Decide what the step under way measures, before its first backward pass
        (``armable``: early enough to arm gradient hooks for it)."""
        loader = self._job.current_loader
        if loader is None:
            return
        self._need_local = (
            self._job.topology.num_replicas > 1
            or bool(self._micro)
            or loader.accumulation_steps > 0
        )
        measuring = self._steps.measures()
        plain = not self._preconditions()
        single = loader.accumulation_steps == 0 and not self._micro
        # Whole flat gradients, or the gradients left in .grad at the end of the backward
        # pass, serve a replica's single micro-batch; anything else is measured per
        # parameter, by the hooks.
        whole = measuring and plain and single and self._need_local
        self._buckets_local = whole and self._fused_norms
        self._grads_local = whole and not self._buckets_local and self._local_in_grads
        self._hook_local = (
            measuring and self._need_local and not (self._buckets_local or self._grads_local)
        )
        if self._hook_local and not self._arm_hooks(armable):
            measuring = self._hook_local = False  # too late to arm: skip this step
        if self._buckets_local:
            self._arm_buckets()
        self._measuring = measuring
        # The share the step was chosen under: a lagged fold finished before this step's
        # own may move the budget's share, and the step stands for 1 / its own share.
        self._plan_share = self._steps.share

    def _arm_hooks(self, armable: bool) -> bool:
        """Arm the gradient hooks for a step that measures by them; whether they are
        (``armable``: early enough to)."""
        if self._hook_params and not self._hook_handles:
            if not armable:
                return False
            self._hook_handles = register_grad_hooks(self, self._hook_params)
        return True

    def _arm_buckets(self) -> None:
        """Prepare a step whose local norms come from whole buckets (DDP's comm hook
        measures every step it is asked to: nothing to do)."""

    def _buckets_whole(self) -> bool:
        """Whether every bucket of the step was measured (a wrapper may find one that
        could not be, after the plan); the step is then measured no further."""
        return True

    def _disarm(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    # -- backward hooks ----------------------------------------------------------------
    def _grad_hook(self, group: int, param: torch.Tensor, grad: torch.Tensor) -> None:
        if not self._in_backward:
            self._begin_backward()
        if not self._hook_local:
            return
        start = _cpu()
        precond = self._preconditioner(group, param)
        self._local_parts[group].append(_norm(grad if precond is None else grad / precond))
        self._stat_cost += _cpu() - start

    def _preconditions(self) -> bool:
        """Whether the noise is estimated of Adam's preconditioned gradient (`AdamScale`)."""
        rule = self.scaling_rule
        return isinstance(rule, AdamScale) and rule.preconditioned

    def _preconditioner(self, group: int, param: torch.Tensor) -> torch.Tensor | None:
        """Adam's ``sqrt(v_hat) + eps`` for ``param`` under AdamScale(preconditioned=True).

        None otherwise. The optimiser state changes only at the step, so every norm
        of one step uses the same preconditioner.
        """
        if not self._preconditions():
            return None
        state = self.adaptdl_optimizer.state.get(param)
        if not state or "exp_avg_sq" not in state or "step" not in state:
            return None
        options = self.adaptdl_optimizer.param_groups[group]
        beta2 = options.get("betas", (0.9, 0.999))[1]
        correction = 1.0 - beta2 ** float(state["step"])
        if correction <= 0.0:
            return None
        v_hat: torch.Tensor = state["exp_avg_sq"] / correction
        return v_hat.sqrt().add_(options.get("eps", 1e-8))

    def _begin_backward(self) -> None:
        loader = self._job.current_loader
        if loader is None:
            raise RuntimeError(
                f"{type(self).__name__}: backward() called outside a dataloader loop. Compute "
                "the loss on batches of an AdaptiveDataLoader, inside "
                "`for epoch in remaining_epochs_until(N): for batch in loader: ...`"
            )
        self._drop_stale_accumulation()
        self._in_backward = True
        self._loader = loader
        if self._measuring is None:
            self._plan_step(armable=False)
        # Each backward pass's buckets hold the gradients accumulated so far: the last
        # pass's are the step's.
        self._bucket_local = []
        self._grad_local = None
        # Runs after the backward computation; it queues the step after the wrapper's
        # own callback (DDP's, queued later; FSDP2's, queued earlier), which waits for
        # the gradients' reduction.
        torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        self._in_backward = False
        loader = self._loader
        assert loader is not None
        self._micro.add(loader.current_index or 0)
        if not self._will_sync():
            self._accum_run = self._job.loop_runs
            self._accum_index = loader.current_index or 0
            return
        if self._grads_local:
            # Before the wrapper's own callback (queued later) writes the reduced
            # gradients into .grad: these are still this replica's.
            start = _cpu()
            self._grad_local = [_sum_sqr_norms(_norms(g)) for g in self._grad_groups()]
            self._stat_cost += _cpu() - start
        self._sync_start = self._job.clock()
        torch.autograd.Variable._execution_engine.queue_callback(self._after_sync)

    def _after_sync(self) -> None:
        job = self._job
        job.record_sync_time(job.clock() - self._sync_start)
        now = _cpu()
        # Only two steps of one loop run bound a step: across runs the interval also
        # holds whatever ran between the loops (an evaluation, another model's
        # training, a checkpoint), which would let the budget allow that much more.
        if self._last_sync is not None and self._last_sync_run == job.loop_runs:
            self._step_time = now - self._last_sync
        self._last_sync, self._last_sync_run = now, job.loop_runs
        step_time = self._step_time
        loader = self._loader
        assert loader is not None
        micro, self._micro = max(len(self._micro), 1), set()
        parts, self._local_parts = self._local_parts, [[] for _ in range(self._num_groups)]
        bucket_local, self._bucket_local = self._bucket_local, []
        measuring, self._measuring = bool(self._measuring), None
        buckets_local, self._buckets_local = self._buckets_local, False
        grad_local, self._grad_local = self._grad_local, None
        grads_local, self._grads_local = self._grads_local, False
        self._hook_local = False
        self._disarm()
        num_groups = len(self.adaptdl_optimizer.param_groups)
        if num_groups != self._num_groups:
            raise ValueError(
                f"the optimizer has {num_groups} parameter groups but had "
                f"{self._num_groups} when {type(self).__name__} wrapped it: add every "
                "parameter group before wrapping the model and optimizer"
            )
        # The gradients are gathered only for a step that uses them: an unmeasured step
        # of one micro-batch per replica runs nothing per parameter (a transformer has
        # hundreds).
        groups: list[list[torch.Tensor]] | None = None
        if micro > 1:
            groups = self._grad_groups()
            for grads in groups:
                torch._foreach_div_(grads, float(micro))
        self._finish_lagged()
        replicas = job.topology.num_replicas
        single = replicas * micro == 1
        if buckets_local and (micro > 1 or not self._buckets_whole()):
            # The buckets summed micro-batches the plan did not expect, or one could not
            # be measured.
            measuring = False
        if grads_local and (micro > 1 or grad_local is None):
            # .grad summed micro-batches the plan did not expect, or was not read.
            measuring = False
        cost, self._stat_cost = self._stat_cost, 0.0
        if not measuring:
            if single and self._steps.measures(ahead=1):
                self._keep(self._grad_groups(), replicas * micro, loader)
            else:
                self._prev_buf_valid = False
                self._prev_grads = None
            return
        if groups is None:
            groups = self._grad_groups()
        start = _cpu()
        mp = self._mp_scale()
        mp2 = mp * mp
        count = self._num_groups
        device = next((t.device for g in groups for t in g), torch.device("cpu"))
        squares, partial = self._total_squares(groups)
        total = [t.to(device) for t in squares]
        if single:
            local: list[torch.Tensor] = []
        elif buckets_local:
            local = _group_sums(bucket_local, count, device)
        elif grad_local is not None:
            local = [t.to(device) for t in grad_local]
        else:
            local = [_sum_sqr_norms(p).to(device) for p in parts]
        pair = self._pair(groups, mp, total) if single else None
        flat = total + local + (pair if pair is not None else [])
        values = torch.stack(flat) / mp2
        training = job.training_loader or loader
        bsz = max(loader.current_local_bsz, 1)
        prev_bsz = self._prev_bsz
        share = self._plan_share

        def build(host: list[float], cost: float) -> Fold:
            totals = tuple(host[:count])
            locals_ = tuple(host[count : 2 * count]) if not single else totals
            paired = None
            if pair is not None:
                rest = host[len(host) - 2 * count :]
                # |prev + current|^2 first: the squared norm of their mean is a quarter.
                paired = PairedNorms(
                    prev_sqr=tuple(rest[count:]),
                    mixed_sqr=tuple(v / 4 for v in rest[:count]),
                    prev_batch_size=prev_bsz,
                )
            measurement = StepMeasurement(
                local_sqr=locals_,
                total_sqr=totals,
                micro_batches=micro,
                num_replicas=replicas,
                batch_size=bsz,
                pair=paired,
                share=share,
                cost=cost,
                step_time=step_time,
                total_partial=partial,
            )
            return self._steps.measure(measurement, training.batch_size)

        if values.device.type == "cuda":
            # Read a step later, when the copy is long done: no wait for the device now.
            lagged = _Lagged(values, lambda host: build(host, cost))
            cost += _cpu() - start
            self._lagged = lagged
            pairable = True
        else:
            host = values.tolist()
            # The tensor work only: core's bookkeeping of the measurement (0.2-0.5 ms of
            # Python) is not counted, since on a small model it alone would pass the
            # budget's floor and sample the statistics at a share set by timing noise.
            cost += _cpu() - start
            pairable = build(host, cost).pairable
        if single and pairable and self._steps.measures(ahead=1):
            self._keep(groups, 1, loader, [t / mp2 for t in total])
        else:
            self._prev_buf_valid = False
            self._prev_grads = None

    def _finish_lagged(self) -> None:
        lagged, self._lagged = self._lagged, None
        if lagged is not None:
            lagged.finish()

    def _drain(self) -> None:
        self._finish_lagged()
        self._steps.drain()

    def _keep(
        self,
        groups: list[list[torch.Tensor]],
        count: int,
        loader: LoaderHelper,
        total: list[torch.Tensor] | None = None,
    ) -> None:
        """Keep this single-micro-batch step's gradient (divided by the loss scale) for
        the next step to pair with; ``total``: its squared norms per group (None: unmeasured,
        computed now)."""
        if count != 1:
            return
        start = _cpu()
        mp = self._mp_scale()
        if total is None:
            if self._preconditions():
                total = []  # measured again under the next step's preconditioner
            else:
                total = [_sum_sqr_norms(_norms(g)) / (mp * mp) for g in groups]
        self._prev_total = total
        self._prev_bsz = max(loader.current_local_bsz, 1)
        if self._general_pairs(groups):
            self._prev_grads = [_scaled_copies(g, mp) for g in groups]
            self._prev_buf_valid = False
        else:
            buf = self._prev_buf
            if (
                buf is None
                or not _same_shapes(buf, groups)
                or any(
                    b.dtype != g.dtype or b.device != g.device
                    for bg, gg in zip(buf, groups, strict=True)
                    for b, g in zip(bg, gg, strict=True)
                )
            ):
                buf = [[torch.empty_like(g) for g in grads] for grads in groups]
                self._prev_buf = buf
            for dst, src in zip(buf, groups, strict=True):
                if dst:
                    torch._foreach_copy_(dst, src)
                    if mp != 1.0:
                        torch._foreach_div_(dst, mp)
            self._prev_buf_valid = True
            self._prev_grads = None
        self._stat_cost += _cpu() - start

    def _general_pairs(self, groups: list[list[torch.Tensor]]) -> bool:
        """Whether pairs need fresh copies: a preconditioner, or sparse gradients."""
        return self._preconditions() or any(t.is_sparse for g in groups for t in g)

    def _pair(
        self, current: list[list[torch.Tensor]], mp: float, total: list[torch.Tensor]
    ) -> list[torch.Tensor] | None:
        """Per group the squared norms (on the device, times the loss scale squared)
        that pair this single-micro-batch step with the previous one, if any: of
        prev + current, then of prev. ``total``: the current gradients' squared norms
        per group (times the loss scale squared, as ``current`` is)."""
        mp2 = mp * mp
        if self._prev_grads is not None:
            prev = self._prev_grads
            if not _same_shapes(prev, current):
                return None
            scaled = [_scaled_copies(g, mp) for g in current]
            # Both gradients with this step's preconditioner, as the estimator requires.
            prev = self._preconditioned(prev)
            pairs = zip(prev, self._preconditioned(scaled), strict=True)
            summed = [_sum_sqr_norms(_norms(_sums(pg, cg))) * mp2 for pg, cg in pairs]
            if self._preconditions():
                return summed + [_sum_sqr_norms(_norms(pg)) * mp2 for pg in prev]
            return summed + [t * mp2 for t in self._prev_total]
        buf = self._prev_buf
        if buf is None or not self._prev_buf_valid:
            return None
        if not _same_shapes(buf, current) or len(self._prev_total) != len(current):
            return None
        self._prev_buf_valid = False  # paired once; the next step pairs with this one
        # |prev + current / mp|^2 from the two squared norms at hand and one inner
        # product, a pass that reads both gradients: adding the current gradient into
        # the buffer and measuring the sum read three and wrote one.
        summed = []
        rows = zip(buf, current, self._prev_total, total, strict=True)
        for kept, now, kept_sqr, now_sqr in rows:
            dot = _inner(kept, now, kept_sqr.device)
            summed.append(kept_sqr * mp2 + now_sqr + 2.0 * mp * dot)
        return summed + [t * mp2 for t in self._prev_total]

    def _preconditioned(self, groups: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """``groups`` (gradients of the params with grads) divided by their preconditioners."""
        if not self._preconditions():
            return groups
        out = []
        for index, (grads, params) in enumerate(zip(groups, self._grad_params(), strict=True)):
            row = []
            for grad, param in zip(grads, params, strict=True):
                precond = self._preconditioner(index, param)
                row.append(grad if precond is None else grad / precond)
            out.append(row)
        return out

    def _grad_params(self) -> list[list[torch.Tensor]]:
        return [
            [p for p in group["params"] if p.grad is not None]
            for group in self.adaptdl_optimizer.param_groups
        ]

    def _grad_groups(self) -> list[list[torch.Tensor]]:
        """Per group, the gradients this replica holds (a shard's, for a sharded model)."""
        return [
            [self._local_grad(p.grad) for p in group["params"] if p.grad is not None]
            for group in self.adaptdl_optimizer.param_groups
        ]

    # -- what a wrapper provides -------------------------------------------------------
    def _will_sync(self) -> bool:
        """Whether the backward pass under way reduces the gradients across replicas."""
        raise NotImplementedError

    def _drop_local_gradients(self) -> None:
        """Forget gradients accumulated outside the parameters' ``.grad`` (none here)."""

    def _local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The part of ``grad`` this replica holds (all of it for a replicated model)."""
        return grad

    def _total_squares(self, groups: list[list[torch.Tensor]]) -> tuple[list[torch.Tensor], bool]:
        """Per group, the squared norm (a float64 scalar tensor) of the step's reduced
        gradient, or of this replica's part of it, and whether it is a part.

        ``groups`` are :meth:`_grad_groups`; a replicated model holds all of it, the
        same on every replica, so with several replicas each measures only the tensors
        `_my_part` gives it and core adds the parts up (`StepMeasurement.total_partial`):
        each replica pays ``1 / replicas`` of the pass, not all of it.
        """
        replicas = self._job.topology.num_replicas
        if replicas == 1 or self._preconditions():
            return [_sum_sqr_norms(_norms(g)) for g in self._preconditioned(groups)], False
        mine = self._my_part(groups, replicas)
        return [_sum_sqr_norms(_norms(g)) for g in mine], True

    def _my_part(
        self, groups: list[list[torch.Tensor]], replicas: int
    ) -> list[list[torch.Tensor]]:
        """This replica's tensors of ``groups``, by core's `split_by_size` (cached for
        the sizes and replicas it was computed for)."""
        sizes = tuple(tuple(t.numel() for t in g) for g in groups)
        key = (replicas, sizes)
        if self._part_key != key:
            owner = split_by_size(sizes, replicas)
            rank = self._job.topology.rank
            self._part = [[j for j, o in enumerate(row) if o == rank] for row in owner]
            self._part_key = key
        return [[g[j] for j in picks] for g, picks in zip(groups, self._part, strict=True)]

    def _mp_scale(self) -> float:
        scaler = self.adaptdl_mp_scaler
        if scaler is None or not scaler.is_enabled():
            return 1.0
        return float(scaler.get_scale())

    def _drop_stale_accumulation(self) -> None:
        # Gradients accumulated by a loop that ended before its step belong to no step:
        # another run (even of the same loader, which starts at index 0 again), or none.
        if not self._micro:
            return
        job = self._job
        loader = job.current_loader
        index = loader.current_index if loader is not None else None
        if job.loop_runs != self._accum_run or index is None or index < self._accum_index:
            self._losses = []  # reported for the dropped micro-batches
            self._micro = set()
            self._local_parts = [[] for _ in range(self._num_groups)]
            self._bucket_local = []
            self._measuring, self._hook_local, self._buckets_local = None, False, False
            self._grads_local, self._grad_local = False, None
            self._stat_cost = 0.0
            self._disarm()
            self.adaptdl_optimizer.zero_grad(set_to_none=True)
            self._drop_local_gradients()

    # -- optimiser and scaler ------------------------------------------------------------
    @contextlib.contextmanager
    def plain_optimizer(self) -> Iterator[None]:
        """Within it, ``optimizer.step``/``zero_grad`` are the optimiser's own.

        For torch code that steps the optimiser for its own ends (DCP initialises a
        stateless optimiser's state with a zero-gradient step): no statistics,
        no learning-rate factor, no progress.
        """
        self._plain = True
        try:
            yield
        finally:
            self._plain = False

    def _patch_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        step: Callable[..., Any] = optimizer.step
        zero_grad: Callable[..., Any] = optimizer.zero_grad

        @functools.wraps(step)
        def adaptive_step(*args: Any, **kwargs: Any) -> Any:
            if self._plain:
                return step(*args, **kwargs)
            closure = kwargs.pop("closure", None)
            if closure is None and args:
                closure, *rest = args
                args = tuple(rest)
            if closure is None:
                if self._job.accumulating():
                    return None  # the step comes with the last micro-batch of the batch
                return self._step(step, *args, **kwargs)
            # A closure (Lightning passes one) computes this micro-batch's loss and
            # gradients: it runs first, as torch's optimisers run it, also on an
            # accumulation micro-batch, so that the step below sees its gradients.
            with torch.enable_grad():
                loss = closure()
            if not self._job.accumulating():
                self._step(step, *args, **kwargs)
            return loss

        @functools.wraps(zero_grad)
        def adaptive_zero_grad(*args: Any, **kwargs: Any) -> Any:
            if self._plain:
                return zero_grad(*args, **kwargs)
            self._drop_stale_accumulation()
            if self._micro:
                return None  # keep the gradients being accumulated
            return zero_grad(*args, **kwargs)

        optimizer.step = adaptive_step  # type: ignore[method-assign]
        optimizer.zero_grad = adaptive_zero_grad  # type: ignore[method-assign]

    def _step(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        job = self._job
        loader = job.current_loader
        gns = job.metrics.gns
        if loader is None or gns is None:
            return step(*args, **kwargs)
        batch_size = loader.current_batch_size
        rule = self.scaling_rule.step_rule(gns.init_batch_size, batch_size / gns.init_batch_size)
        groups = self.adaptdl_optimizer.param_groups
        base = [group["lr"] for group in groups]
        loss = None
        if self._losses:
            # Read before the update: the losses are ready (the step's statistics
            # already waited for the device), and nothing after the update may raise.
            losses, self._losses = self._losses, []
            rates = floor_rates(self.adaptdl_optimizer, base)
            loss = StepLoss(mean_loss(losses), tuple(rates), self._target_loss)
        decision = self._steps.decide(batch_size, rule, len(groups), loss=loss)
        assert decision is not None
        for group, lr, factor in zip(groups, base, decision.lr_factors, strict=True):
            group["lr"] = lr * factor
        try:
            result = step(*args, **kwargs)
        finally:
            for group, lr in zip(groups, base, strict=True):
                group["lr"] = lr
        # One step of progress per batch, however many models the job steps in it.
        self._steps.commit(decision, step=job.boundaries)
        self.last_lr_factor = decision.lr_factors[0]
        self.last_gain = decision.gain
        return result

    def report_loss(self, loss: torch.Tensor | float, *, target_loss: float | None = None) -> None:
        """Report this micro-batch's training loss (the mean over its samples, whose
        gradient the step takes), opt-in: the batch-size decision then credits the
        noise floor a batch keeps (`adaptdl.core.stats.floor`). EXPERIMENTAL: not yet
        shown to win on problems it was not tuned on; configured (or turned off) by
        ``init_process_group(metrics_config=MetricsConfig(floor=FloorConfig(...)))``.

        Call it inside the training loop, once per micro-batch, before or after
        ``optimizer.step()``; the losses since the last step are averaged into the next
        step. A tensor's value is read there. ``target_loss`` is the training loss
        aimed at, if known (None: the loss the run sheds over as much progress again
        as it has made, read from the loss's own history; 0: the smallest credit);
        the last one given counts. The credit lapses 100 optimiser steps after the
        last finite loss.
        One model per job reports. ValueError for an optimiser other than
        ``torch.optim.SGD`` (or SGD with Nesterov), a rule other than `AdaScale`, a
        call outside the training loop, a second model reporting, or a tensor that is
        not one number; TypeError for a loss that is not a tensor or a number.
        """
        value = check_loss(loss)
        target = None if target_loss is None else check_float("target_loss", target_loss)
        job = self._job
        if not self._floor_checked:
            # Checked once, before any step uses them.
            check_floor_optimizer(self.adaptdl_optimizer, self.scaling_rule)
            floor_rates(self.adaptdl_optimizer)
            job.metrics.claim_loss(self._adaptdl_name)
            self._floor_checked = True
        if not job.in_training_loop():
            current = job.current_loader
            raise ValueError(
                "report_loss must be called inside the training loop (the training "
                f"loader's), got {'no loop' if current is None else current.name}"
            )
        # A micro-batch left unstepped by an earlier run is dropped now, with its
        # losses, before this run's loss joins them.
        self._drop_stale_accumulation()
        self._losses.append(value)
        self._target_loss = target

    def _patch_scaler(self, scaler: Any) -> None:
        for method in ("unscale_", "step", "update"):
            original = getattr(scaler, method)

            def skip_on_accumulation(
                *args: Any, _original: Callable[..., Any] = original, **kwargs: Any
            ) -> Any:
                if self._job.accumulating():
                    return None  # gradients are still summing; scaling happens at the step
                return _original(*args, **kwargs)

            setattr(scaler, method, skip_on_accumulation)

    # -- metrics --------------------------------------------------------------------------
    @property
    def gns(self) -> GradientNoiseScale | None:
        """The job's gradient-noise estimator (None before the first synchronised step)."""
        return self._job.metrics.gns

    @property
    def progress(self) -> float:
        """Scale-invariant progress: optimiser steps, each weighted by its gain."""
        return self._job.metrics.progress

    @property
    def gain(self) -> float:
        """The AdaScale gain at the current loader's batch size (1 before any estimate).

        A property, as in the seed; calling it (``model.gain()``, this package's
        earlier form) still works and gives the same number.
        """
        gns = self.gns
        loader = self._job.current_loader or self._job.training_loader
        if gns is None or loader is None or loader.current_local_bsz == 0:
            return _Gain(1.0)
        return _Gain(gns.gain(loader.current_batch_size / gns.init_batch_size))

    def to_tensorboard(self, writer: Any, global_step: int, tag_prefix: str = "") -> None:
        """Write gain, gradient statistics, progress and goodput to a SummaryWriter."""
        prefix = f"{tag_prefix}/" if tag_prefix and not tag_prefix.endswith("/") else tag_prefix
        writer.add_scalar(f"{prefix}Gradient/gain", float(self.gain), global_step)
        writer.add_scalar(f"{prefix}Gradient/lr_factor", self.last_lr_factor, global_step)
        writer.add_scalar(f"{prefix}Gradient/progress", self.progress, global_step)
        gns = self.gns
        if gns is not None and gns.has_estimate:
            writer.add_scalar(f"{prefix}Gradient/sqr", gns.sqr, global_step)
            writer.add_scalar(f"{prefix}Gradient/var", gns.var, global_step)
        if self._job.metrics.floor is not None:
            share = self._job.metrics.floor_share()
            writer.add_scalar(f"{prefix}Gradient/floor_share", share, global_step)
        goodput = self.goodput()
        if goodput is not None:
            writer.add_scalar(f"{prefix}Performance/goodput", goodput, global_step)

    def goodput(self) -> float | None:
        """Goodput (useful samples per second) at the current configuration, if modelled."""
        return self._job.goodput()
