"""A training program in the original AdaptDL's style, launched by torchrun in the e2e tests.

It reads its job from ``adaptdl.env``, keeps its own counters in an
``adaptdl.checkpoint.State`` (JSON, its own choice of format), whose ``sync`` sums
the replicas' counts with ``adaptdl.collective.allreduce``, and prints one line of
metrics per epoch on rank 0:

    ENV rank=.. replicas=.. nodes=.. restarts=.. checkpoint_path=.. share_path=.. job_id=..
    RESTORED <bool> steps=..
    STEP epoch=.. index=..                       (rank 0, after every optimiser step)
    METRIC epoch=.. samples=.. steps=.. progress=.. loss=..
    COLLECTIVE rank=.. broadcast=.. concatenated=.. sum=..   (every replica, at the end)
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, BinaryIO

import adaptdl
import adaptdl.torch
import adaptdl.torch._metrics
import torch

N = 96
EPOCHS = 4
BATCH_SIZE = 8
STEP_SLEEP = float(os.environ.get("COMPAT_STEP_SLEEP", "0.05"))


def merge_counts(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: a.get(k, 0) + b.get(k, 0) for k in sorted(set(a) | set(b))}


class Tally(adaptdl.checkpoint.State):
    """Optimiser steps, and the samples every replica trained on in each epoch."""

    def __init__(self) -> None:
        super().__init__("tally")
        self.steps = 0
        self.samples: dict[str, int] = {}  # epoch -> samples of all replicas, as of the last sync
        self.local: dict[str, int] = {}  # epoch -> this replica's samples since the last sync

    def sync(self) -> None:
        merged = adaptdl.collective.allreduce(self.local, merge_counts)
        self.samples = merge_counts(self.samples, merged)
        self.local = {}

    def save(self, fileobj: BinaryIO) -> None:
        fileobj.write(json.dumps({"steps": self.steps, "samples": self.samples}).encode())

    def load(self, fileobj: BinaryIO) -> None:
        saved: dict[str, Any] = json.loads(fileobj.read().decode())
        self.steps = saved["steps"]
        self.samples = saved["samples"]


def emit(line: str) -> None:
    """Print ``line`` in one write: the replicas share torchrun's output, and print's
    separate writes of text and newline let two replicas' lines run together."""
    os.write(1, (line + "\n").encode())


def dataset() -> torch.utils.data.TensorDataset:
    """Synthetic regression data, made once by rank 0 in the job's shared directory."""
    share = adaptdl.env.share_path()
    assert share is not None, "ADAPTDL_SHARE_PATH is required"
    path = os.path.join(share, "data.pt")
    if adaptdl.env.replica_rank() == 0 and not os.path.exists(path):
        gen = torch.Generator().manual_seed(7)
        x = torch.randn(N, 4, generator=gen)
        y = x @ torch.randn(4, 1, generator=gen) + 0.1 * torch.randn(N, 1, generator=gen)
        torch.save({"x": x, "y": y}, path + ".tmp")
        os.replace(path + ".tmp", path)
    adaptdl.collective.broadcast(None)  # everyone waits for rank 0's file
    data = torch.load(path, weights_only=True)
    return torch.utils.data.TensorDataset(data["x"], data["y"])


def main() -> None:
    adaptdl.torch.init_process_group("gloo")
    rank = adaptdl.env.replica_rank()
    emit(
        f"ENV rank={rank} replicas={adaptdl.env.num_replicas()} nodes={adaptdl.env.num_nodes()} "
        f"restarts={adaptdl.env.num_restarts()} checkpoint_path={adaptdl.env.checkpoint_path()} "
        f"share_path={adaptdl.env.share_path()} job_id={adaptdl.env.job_id()}"
    )
    tally = Tally()
    restored = adaptdl.checkpoint.load_state(tally)
    if rank == 0:
        emit(f"RESTORED {restored} steps={tally.steps}")

    data = dataset()
    loader = adaptdl.torch.AdaptiveDataLoader(data, batch_size=BATCH_SIZE, shuffle=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model = adaptdl.torch.AdaptiveDataParallel(model, optimizer)

    for epoch in adaptdl.torch.remaining_epochs_until(EPOCHS):
        key = str(epoch)
        for index, (x, y) in enumerate(loader):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            tally.steps += 1
            tally.local[key] = tally.local.get(key, 0) + len(x)
            if rank == 0:
                emit(f"STEP epoch={epoch} index={index}")
            time.sleep(STEP_SLEEP)
        tally.sync()
        with torch.no_grad():
            loss = torch.nn.functional.mse_loss(model.module(data.tensors[0]), data.tensors[1])
        if rank == 0:
            emit(
                f"METRIC epoch={epoch} samples={tally.samples[key]} steps={tally.steps} "
                f"progress={adaptdl.torch._metrics.get_progress():.6f} loss={loss.item():.8f}"
            )
    pending = adaptdl.collective.allreduce_async(rank + 1)
    emit(
        f"COLLECTIVE rank={rank} broadcast={adaptdl.collective.broadcast(f'from-{rank}')} "
        f"concatenated={json.dumps(adaptdl.collective.allreduce([rank]), separators=(',', ':'))} "
        f"sum={pending.result()}"
    )
    adaptdl.collective.teardown()


if __name__ == "__main__":
    main()
