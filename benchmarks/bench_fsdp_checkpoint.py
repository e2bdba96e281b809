"""Benchmark: checkpoint stall and bytes written per replica, DDP full save against FSDP2 shards.

A 50-million-parameter MLP with AdamW (so some 600 MB of state: parameters and two
moments) on CPU, 2 replicas under torchrun (gloo). One job adapts it with
`AdaptiveDataParallel`, whose checkpoint is the whole model and optimiser written
by rank 0 (``torch.save``); another shards it with ``fully_shard`` and adapts it
with `AdaptiveFSDP`, whose checkpoint is DCP shards, each replica writing its own.
Both write into the job's atomic checkpoint (manifest, SHA-256 of every file,
fsync, rename) after one training step; each takes several checkpoints, and the
stall is the time every replica spends in ``Job.checkpoint`` (the slowest
replica's; the best and median round). Bytes per replica are what each wrote.
A third job is the FSDP2 one with ``async_checkpoint=True``: its stall is the
copy of the shards aside, and the writing that goes on in the background (until
rank 0 commits the checkpoint) is reported beside it; each round starts once the
previous checkpoint is committed, as a training loop whose checkpoints are
further apart than one write would find it.
Figures are ratios (FSDP2 / DDP, asynchronous / synchronous FSDP2) from the same
machine minutes apart; on a shared, loaded machine read them from a quiet one.

    python benchmarks/bench_fsdp_checkpoint.py            # launches torchrun itself
    python benchmarks/bench_fsdp_checkpoint.py --quick    # a 12M-parameter model
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from typing import Any

WIDTH = 4096  # 3 layers of 4096 x 4096 (+ bias): 50.3M parameters
QUICK_WIDTH = 2048  # 12.6M


def worker(side: str, width: int, rounds: int) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import TensorDataset

    import adaptdl.torch as adl
    import torch
    from adaptdl.torch._context import current_job
    from adaptdl.torch.fsdp import AdaptiveFSDP

    torch.set_num_threads(1)
    adl.init_process_group("gloo")
    rank, replicas = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width) for _ in range(3)]
    model = torch.nn.Sequential(*layers)
    params = sum(p.numel() for p in model.parameters())
    wrapped: Any
    sharded = side.startswith("fsdp")
    if sharded:
        for layer in layers:
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if sharded:
        wrapped = AdaptiveFSDP(model, optimizer, async_checkpoint=side == "fsdp-async")
    else:
        wrapped = adl.AdaptiveDataParallel(model, optimizer)
    n = 2 * replicas
    dataset = TensorDataset(torch.randn(n, width), torch.randn(n, width))
    loader = adl.AdaptiveDataLoader(dataset, batch_size=n)
    for _ in adl.remaining_epochs_until(1):  # one step: the optimiser's state exists
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(wrapped(x), y).backward()
            optimizer.step()
    job = current_job()
    root = os.environ["ADAPTDL_CHECKPOINT_PATH"]
    stalls: list[float] = []
    background: list[float] = []
    written: list[int] = []
    assert job.store is not None
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        job.checkpoint()
        stalls.append(time.perf_counter() - start)
        job.store.wait()  # rank 0: until committed; elsewhere until its own files are written
        dist.barrier()
        background.append(time.perf_counter() - start - stalls[-1])
        written.append(_written_by(rank, os.path.join(root, sorted(_labels(root))[-1]), side))
    staging = _staging_time(model, optimizer) if sharded else 0.0
    slowest = [max(s) for s in zip(*_gather(stalls), strict=True)]
    behind = [max(b) for b in zip(*_gather(background), strict=True)]
    staged = max(_gather(staging))  # every replica takes part in each gather
    per_rank = _gather(written[-1])
    rss = _gather(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if rank == 0:
        result = {
            "params": params,
            "stalls": slowest,
            "background": behind,
            "bytes": per_rank,
            "rss": rss,
            "staging": staged,
        }
        print("RESULT " + json.dumps(result), flush=True)
    job.drain()


def _staging_time(model: Any, optimizer: Any) -> float:
    """Seconds to copy this replica's shards aside: what an asynchronous save would stall."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    import torch

    start = time.perf_counter()
    state = get_state_dict(model, optimizer)
    local = [t.to_local() if isinstance(t, DTensor) else t for p in state for t in _tensors(p)]
    copies = [t.clone() for t in local]
    elapsed = time.perf_counter() - start
    assert all(isinstance(c, torch.Tensor) for c in copies)
    return elapsed


def _tensors(value: Any) -> list[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _labels(root: str) -> list[str]:
    return [name for name in os.listdir(root) if name.startswith("ckpt-")]


def _written_by(rank: int, checkpoint: str, side: str) -> int:
    """Bytes of ``checkpoint`` that replica ``rank`` wrote."""
    total = 0
    for directory, _, files in os.walk(checkpoint):
        for name in files:
            sharded = os.path.basename(directory) != os.path.basename(checkpoint)
            mine = name.startswith(f"__{rank}_") if sharded else rank == 0  # rank 0: the rest
            if mine or (sharded and rank == 0 and name == ".metadata"):
                total += os.path.getsize(os.path.join(directory, name))
    return total


def _gather(value: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def launch(side: str, width: int, rounds: int) -> dict[str, Any]:
    from adaptdl.torch.launch import torchrun_command  # the parent needs no torch until here

    directory = tempfile.mkdtemp(prefix=f"bench-ckpt-{side}-")
    try:
        command = torchrun_command(
            os.path.abspath(__file__),
            2,
            args=[f"--worker={side}", f"--width={width}", f"--rounds={rounds}"],
        )
        env = {**os.environ, "OMP_NUM_THREADS": "1", "ADAPTDL_CHECKPOINT_PATH": directory}
        env.pop("ADAPTDL_CHECKPOINT_INTERVAL", None)
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        print(done.stdout[-3000:], done.stderr[-3000:])
        raise SystemExit(f"the benchmark workers failed (exit {done.returncode})")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model, fewer rounds")
    parser.add_argument("--worker", choices=["ddp", "fsdp", "fsdp-async"], help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    width = args.width or (QUICK_WIDTH if args.quick else WIDTH)
    rounds = args.rounds or (2 if args.quick else 4)
    if args.worker:
        worker(args.worker, width, rounds)
        return
    results = {side: launch(side, width, rounds) for side in ("ddp", "fsdp", "fsdp-async")}
    mb = 1 << 20
    for side, r in results.items():
        print(
            f"{side:>10}: stall best {min(r['stalls']):6.2f} s, median "
            f"{statistics.median(r['stalls']):6.2f} s; then in the background "
            f"{statistics.median(r['background']):6.2f} s; written per replica "
            + ", ".join(f"{b / mb:7.1f} MB" for b in r["bytes"])
            + "; peak RSS per replica "
            + ", ".join(f"{b / mb:6.0f} MB" for b in r["rss"])
        )
    ddp, fsdp = results["ddp"], results["fsdp"]
    stall = min(fsdp["stalls"]) / min(ddp["stalls"])
    most = max(fsdp["bytes"]) / max(ddp["bytes"])
    print(
        f"FSDP2 sharded checkpoint against DDP full checkpoint ({ddp['params'] / 1e6:.1f}M "
        f"parameters + AdamW state, 2 replicas, CPU, gloo): stall x{stall:.2f} (best rounds), "
        f"most bytes written by one replica x{most:.2f}, total bytes "
        f"x{sum(fsdp['bytes']) / sum(ddp['bytes']):.2f}; copying the shards aside (the stall "
        f"an asynchronous save would keep) {fsdp['staging']:.2f} s"
    )
    background = results["fsdp-async"]
    print(
        "FSDP2 asynchronous against synchronous sharded checkpoint: stall "
        f"x{min(background['stalls']) / min(fsdp['stalls']):.2f} (best rounds; median "
        f"x{statistics.median(background['stalls']) / statistics.median(fsdp['stalls']):.2f}), "
        "written meanwhile in the background for "
        f"{statistics.median(background['background']):.2f} s"
    )


if __name__ == "__main__":
    main()
