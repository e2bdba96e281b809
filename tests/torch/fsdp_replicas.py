"""Run by test_torch_fsdp under torchrun: one model trained under DDP or FSDP2, or checkpointed.

``python fsdp_replicas.py MODE OUT``:

* ``ddp`` / ``fsdp``: the same two-layer model, data and seed, four micro-batches of
  4 per step over the replicas (accumulation included), trained for one epoch
  under `AdaptiveDataParallel` or `AdaptiveFSDP` (with ``FSDP_ADAM=1``: Adam and
  AdamScale); each replica writes the gradient-noise statistics per group, the
  progress and the full parameters.
* ``norms``: FSDP2, 2 replicas, one micro-batch of 4 each per step, every step
  measured; ``FSDP_NORMS=hooks`` measures the local gradients per parameter (the
  gradient hooks), otherwise from each module's flat gradient at its
  reduce-scatter; each replica writes every step's measurement and how many flat
  gradients it measured (``FSDP_REDUCE_FP16=1``: gradients reduced in float16).
* ``save``: FSDP2 with AdamW, a few steps, then a checkpoint; ``load``: restores it
  (at whatever world size torchrun gives); both write the full parameters and the
  full optimiser state.
* ``async-stop``: as ``save`` with ``async_checkpoint``, each write slowed by
  ``FSDP_SLOW_WRITE`` seconds: a checkpoint at the second step, then SIGTERM while it
  is written; the state after every step is written (the last is the stop's).
* ``async-kill``: a checkpoint at the second step, waited for (its state written),
  another at the third, then SIGKILL while that one is written.

* ``scaler``: FSDP2 with a ShardedGradScaler; at the third step one element of
  replica 1's gradient shard is made infinite after the reduction, so that only the
  all-reduced inf check can make replica 0 skip that step too; each replica writes
  the scale after every step and whether its own shards changed.

``FSDP_COUNT_CHECKS=1`` makes each replica also write which checkpoint files it hashed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset

import adaptdl.torch as adl
import torch
from adaptdl.core.persist import localfs
from adaptdl.torch import _context, sharded_state
from adaptdl.torch.fsdp import AdaptiveFSDP
from adaptdl.torch.scaling_rules import AdamScale, AdaScale

MODE, OUT = sys.argv[1], sys.argv[2]
N = 64


def data() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, 6, generator=gen)
    return TensorDataset(torch.arange(N), x, torch.sin(x).sum(1, keepdim=True))


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1))


def shard(net: torch.nn.Module) -> torch.nn.Module:
    bf16 = os.environ.get("FSDP_BF16") == "1"
    # FSDP_REDUCE_FP16=1: gradients reduced in float16, which FSDP2 divides before reducing.
    fp16 = os.environ.get("FSDP_REDUCE_FP16") == "1"
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float16 if fp16 else None
    )
    mesh = None
    if os.environ.get("FSDP_HSDP") == "1":
        # HSDP: every replica holds the whole model (shard groups of one), the
        # gradients all-reduced over the replicate dimension.
        mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("dp", "shard"))
    fully_shard(net[0], mp_policy=policy, mesh=mesh)
    fully_shard(net[2], mp_policy=policy, mesh=mesh)
    fully_shard(net, mp_policy=policy, mesh=mesh)
    return net


def full(t: Any) -> Any:
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().double().flatten().tolist() if isinstance(t, torch.Tensor) else t


def write(results: dict[str, Any]) -> None:
    with open(os.path.join(OUT, f"{MODE}-rank{dist.get_rank()}.json"), "w") as out:
        json.dump(results, out)


def two_groups(net: torch.nn.Module) -> list[dict[str, Any]]:
    return [
        {"params": list(net[0].parameters())},
        {"params": list(net[2].parameters()), "lr": 0.05},
    ]


def train_gns() -> None:
    loader = adl.AdaptiveDataLoader(data(), batch_size=16)
    loader.autoscale_batch_size(64, (1, 16), gradient_accumulation=True)
    # 2 replicas x 4 samples x 2 micro-batches: accumulation and the replicas' sum.
    _context.current_job().batch_size_decision = lambda query: (4, 1)
    net = model()
    wrapped: Any
    if MODE == "fsdp":
        net = shard(net)
    adam = os.environ.get("FSDP_ADAM") == "1"
    if adam:  # AdamScale: the statistics of Adam's preconditioned gradient
        optimizer: torch.optim.Optimizer = torch.optim.Adam(two_groups(net), lr=0.01)
    else:
        optimizer = torch.optim.SGD(two_groups(net), lr=0.1)
    rule = AdamScale(preconditioned=True) if adam else AdaScale()
    if MODE == "fsdp":
        wrapped = AdaptiveFSDP(net, optimizer, scaling_rule=rule)
    else:
        wrapped = adl.AdaptiveDataParallel(net, optimizer, scaling_rule=rule)
    for _ in adl.remaining_epochs_until(2):
        for _idx, x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(wrapped(x).float(), y)
            loss.backward()
            optimizer.step()
            if not adam:  # SGD's noise floor: the loss reaches it alike in both wrappers
                wrapped.report_loss(loss)
    gns = wrapped.gns
    floor = wrapped._job.metrics.floor
    write(
        {
            "sqr": list(gns.group_sqr),
            "var": list(gns.group_var),
            "updates": gns.num_updates,
            "progress": wrapped.progress,
            "params": [full(p) for p in net.parameters()],
            "floor": floor.to_json() if floor is not None else None,
            "steps": adl.global_step(),
        }
    )


def measured_norms() -> None:
    from adaptdl.core.stats.statsbudget import MeasureBudget

    loader = adl.AdaptiveDataLoader(data(), batch_size=8)
    _context.current_job().batch_size_decision = lambda query: (4, 0)
    net = shard(model())
    optimizer = torch.optim.SGD(two_groups(net), lr=0.1)
    wrapped = AdaptiveFSDP(net, optimizer)
    fused = wrapped._fused_norms
    if os.environ.get("FSDP_NORMS") == "hooks":
        wrapped._fused_norms = False
    wrapped._steps.budget = MeasureBudget(fixed=1.0)
    seen: list[dict[str, Any]] = []
    measure = wrapped._steps.measure

    def spy(m: Any, init: int) -> Any:
        seen.append({"local": list(m.local_sqr), "total": list(m.total_sqr)})
        return measure(m, init)

    wrapped._steps.measure = spy
    flats = []
    measure_flat = wrapped._measure_flat

    def count(group: int, flat: torch.Tensor) -> None:
        flats.append(group)
        measure_flat(group, flat)

    wrapped._measure_flat = count  # type: ignore[method-assign]
    for _ in adl.remaining_epochs_until(1):
        for _idx, x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(wrapped(x), y).backward()
            optimizer.step()
    write(
        {"measured": seen, "flats": flats, "fusable": fused, "armed": len(wrapped._hook_handles)}
    )


def slow_writes() -> None:
    delay = float(os.environ.get("FSDP_SLOW_WRITE", "0"))
    original = sharded_state._HashingWriter.write_data

    def slow(self: Any, plan: Any, planner: Any) -> Any:
        time.sleep(delay)
        return original(self, plan, planner)

    if delay:
        sharded_state._HashingWriter.write_data = slow  # type: ignore[method-assign]


CHECKED: list[str] = []


def count_checks() -> None:
    original = localfs.file_record

    def counted(path: Any, limit: Any = None) -> Any:
        CHECKED.append(f"{path.parent.parent.name}/{path.parent.name}/{path.name}")
        return original(path, limit)

    if os.environ.get("FSDP_COUNT_CHECKS") == "1":
        localfs.file_record = counted  # type: ignore[assignment]


def snapshot(net: torch.nn.Module, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    """Collective: the full model and optimiser state, and what the checkpoints are."""
    options = StateDictOptions(full_state_dict=True)
    model_sd, optim_sd = get_state_dict(net, optimizer, options=options)
    return {
        "restored": _context.current_job().restored_from,
        "model": {k: full(v) for k, v in model_sd.items()},
        "optim": {
            f"{k}.{s}": full(v) for k, state in optim_sd["state"].items() for s, v in state.items()
        },
        "lr": scheduler.get_last_lr(),
        "files": sorted(os.listdir(os.environ["ADAPTDL_CHECKPOINT_PATH"])),
        "checked": CHECKED,
    }


def checkpointed() -> None:
    slow_writes()
    loader = adl.AdaptiveDataLoader(data(), batch_size=8)
    net = shard(model())
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    background = MODE.startswith("async")
    wrapped = AdaptiveFSDP(net, optimizer, lr_scheduler=scheduler, async_checkpoint=background)
    job = _context.current_job()
    if MODE == "save" or background:
        for _ in adl.remaining_epochs_until(1):
            for i, (_idx, x, y) in enumerate(loader):
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(wrapped(x), y).backward()
                optimizer.step()
                if MODE == "async-stop":
                    write(snapshot(net, optimizer, scheduler))
                if i == 1 and background:
                    job.checkpoint()  # in the background
                    if MODE == "async-stop":
                        signal.raise_signal(signal.SIGTERM)  # stops at a later boundary
                    else:
                        assert job.store is not None
                        job.store.wait()
                        write(snapshot(net, optimizer, scheduler))
                if i == 2 and MODE == "async-kill":
                    job.checkpoint()
                    os.kill(os.getpid(), signal.SIGKILL)
            scheduler.step()
        # The finished epoch loop wrote its final checkpoint (ckpt-000001).
    write(snapshot(net, optimizer, scheduler))


def scaled() -> None:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    loader = adl.AdaptiveDataLoader(data(), batch_size=8)
    net = shard(model())
    optimizer = torch.optim.SGD(two_groups(net), lr=0.1)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    wrapped = AdaptiveFSDP(net, optimizer, mp_scaler=scaler)
    scales, changed = [], []
    for _ in adl.remaining_epochs_until(1):
        for i, (_idx, x, y) in enumerate(loader):
            optimizer.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(wrapped(x), y)).backward()
            if i == 2 and dist.get_rank() == 1:
                grad = next(iter(net.parameters())).grad
                grad.to_local().view(-1)[0] = float("inf")  # in replica 1's shard alone
            before = [p.to_local().clone() for p in net.parameters()]
            scaler.step(optimizer)
            scaler.update()
            after = [p.to_local() for p in net.parameters()]
            changed.append(any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)))
            scales.append(scaler.get_scale())
    gns = wrapped.gns
    write(
        {
            "scales": scales,
            "changed": changed,
            "var": list(gns.group_var),
            "sqr": list(gns.group_sqr),
            "progress": wrapped.progress,
        }
    )


def main() -> None:
    count_checks()
    adl.init_process_group("gloo")
    if MODE in ("ddp", "fsdp"):
        train_gns()
    elif MODE == "norms":
        measured_norms()
    elif MODE == "scaler":
        scaled()
    else:
        checkpointed()
    dist.barrier()
    _context.current_job().drain()


if __name__ == "__main__":
    main()
