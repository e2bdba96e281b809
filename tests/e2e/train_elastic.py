"""A tiny elastic training script for the end-to-end tests, launched by torchrun.

With ``E2E_SHARDS`` set to a directory, the same samples are written there as
JSON-lines shards of uneven sizes and read through a ``ShardedDataset`` instead of
the map-style dataset (the expected indices then come from core's block order).
With ``E2E_FSDP=1`` the model is sharded by FSDP2 and adapted by ``AdaptiveFSDP``
(checkpointed as DCP shards that every replica writes).

Every replica appends one JSON line per batch to ``$E2E_RECORD_DIR/run<R>-rank<k>.jsonl``:
the dataset indices the training loop actually received, which of them the core
sharding calls padding, and the loss. At the start of each run and at the end of
each epoch rank 0 also records the loss over the whole dataset, and every replica
records how it exited. ``E2E_EVAL_SLEEP`` and ``E2E_POST_SLEEP`` add an
"evaluation" after each epoch's loop and "post-processing" after the epoch loop
(each recorded as it starts), where no training loop runs. With ``E2E_ACCUMULATOR=1``
the loop sums its losses in an ``Accumulator`` (a state every replica must save
together) and the evaluation runs inside its ``synchronized()``; with
``E2E_EVAL_RANK0=1`` only rank 0 evaluates that long (as a busy machine holds one
replica), the others going on to the next epoch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from typing import Any

from torch.utils.data import Dataset

import adaptdl.torch as adl
import torch
from adaptdl.core.order.sampling import Shard
from adaptdl.core.order.seed import SHUFFLE_SEED
from adaptdl.core.order.shards import BlockOrder, replica_chunk
from adaptdl.torch import current_job
from adaptdl.torch.shards import JsonLinesReader, ShardedDataset

N = int(os.environ.get("E2E_N", "120"))
EPOCHS = int(os.environ.get("E2E_EPOCHS", "3"))
BATCH_SIZE = int(os.environ.get("E2E_BATCH_SIZE", "8"))
WORKERS = int(os.environ.get("E2E_WORKERS", "0"))
STEP_SLEEP = float(os.environ.get("E2E_STEP_SLEEP", "0"))
RUN = int(os.environ.get("E2E_RUN", "0"))
RECORD_DIR = os.environ["E2E_RECORD_DIR"]
SHARDS = os.environ.get("E2E_SHARDS", "")
FSDP = os.environ.get("E2E_FSDP") == "1"
DROP_LAST = os.environ.get("E2E_DROP_LAST", "") == "1"
EVAL_SLEEP = float(os.environ.get("E2E_EVAL_SLEEP", "0"))  # after each epoch's loop
POST_SLEEP = float(os.environ.get("E2E_POST_SLEEP", "0"))  # after the epoch loop
ACCUMULATOR = os.environ.get("E2E_ACCUMULATOR") == "1"
EVAL_RANK0 = os.environ.get("E2E_EVAL_RANK0") == "1"
# The label noise: a noisier target has a larger gradient noise scale, which makes a
# larger batch worth its cost early (tests that must see the batch size grow raise it).
NOISE = float(os.environ.get("E2E_NOISE", "0.05"))
BLOCK_SIZE = 4
SHARD_SIZES = (7, 30, 1, 45, 37)  # cycled until N samples are written


class Regression(Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    """y = x @ w + noise, with each sample's own index first."""

    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 8, generator=gen)
        w = torch.randn(8, 1, generator=gen)
        self.y = self.x @ w + NOISE * torch.randn(n, 1, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


def write_shards(dataset: Regression, directory: str) -> list[str]:
    """The samples as JSON lines {"i", "x", "y"}, in shards of uneven sizes, in order."""
    os.makedirs(directory, exist_ok=True)
    paths, start = [], 0
    for s in range(N):
        if start >= N:
            break
        stop = min(N, start + SHARD_SIZES[s % len(SHARD_SIZES)])
        path = os.path.join(directory, f"part-{s:03d}.jsonl")
        if not os.path.exists(path):  # every replica writes the same bytes, atomically
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as out:
                for i in range(start, stop):
                    x, y = dataset.x[i].tolist(), dataset.y[i].tolist()
                    out.write(json.dumps({"i": i, "x": x, "y": y}) + "\n")
            os.replace(tmp, path)
        paths.append(path)
        start = stop
    return paths


def as_tensors(sample: dict[str, Any]) -> tuple[int, torch.Tensor, torch.Tensor]:
    return sample["i"], torch.tensor(sample["x"]), torch.tensor(sample["y"])


def expected_batch(
    epoch: int, index: int, local_bsz: int, size: int
) -> tuple[list[int], list[bool]]:
    """The indices core assigns this replica's batch of ``size`` at ``index``, and padding."""
    topo = current_job().topology
    if not SHARDS:
        shard = Shard(N, index, topo.num_replicas, topo.rank, seed=SHUFFLE_SEED, epoch=epoch)
        return shard.indices(0, size).tolist(), shard.is_padding(0, size).tolist()
    chunk = replica_chunk(N, index, topo.num_replicas, topo.rank, local_bsz)
    order = BlockOrder(N, BLOCK_SIZE, seed=SHUFFLE_SEED, epoch=epoch, pass_=index // N)
    indices = order.take(chunk.lo, chunk.hi).tolist()
    padding = [False] * len(indices)
    if chunk.pad is not None:
        indices.append(order[chunk.pad])
        padding.append(True)
    return indices, padding


def digest(model: torch.nn.Module) -> str:
    """A fingerprint of the parameters' exact bits: replicas in step have the same."""
    h = hashlib.sha256()
    for p in model.parameters():
        full = p.full_tensor() if FSDP else p  # a DTensor: collective for a shard
        h.update(full.detach().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    adl.init_process_group("gloo")
    job = current_job()
    topo = job.topology
    torch.manual_seed(0)
    dataset = Regression(N)
    source: Any = dataset
    if SHARDS:
        paths = write_shards(dataset, SHARDS)
        source = ShardedDataset(
            paths, JsonLinesReader(), block_size=BLOCK_SIZE, transform=as_tensors
        )
    loader = adl.AdaptiveDataLoader(
        source, batch_size=BATCH_SIZE, shuffle=True, num_workers=WORKERS, drop_last=DROP_LAST
    )
    model = torch.nn.Linear(8, 1)
    if FSDP:
        # Imported here: FSDP2 and DTensor add half again to every replica's import,
        # and most launches train with DDP.
        from torch.distributed.fsdp import fully_shard

        from adaptdl.torch.fsdp import AdaptiveFSDP

        fully_shard(model)  # before the optimiser, which then holds the shards
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    adp: Any
    if FSDP:
        adp = AdaptiveFSDP(model, optimizer, lr_scheduler=scheduler)
    else:
        adp = adl.AdaptiveDataParallel(model, optimizer, scheduler)
    sums = adl.Accumulator() if ACCUMULATOR else None
    path = os.path.join(RECORD_DIR, f"run{RUN}-rank{topo.rank}.jsonl")
    with open(path, "a", encoding="utf-8") as out:

        def record(**entry: Any) -> None:
            entry.update(
                run=RUN, rank=topo.rank, replicas=topo.num_replicas, attempt=topo.num_restarts
            )
            out.write(json.dumps(entry) + "\n")
            out.flush()

        def full_loss() -> float:
            with torch.no_grad():  # every replica calls it: a sharded forward is collective
                return float(torch.nn.functional.mse_loss(model(dataset.x), dataset.y))

        record(
            start=True,
            pid=os.getpid(),
            restored=job.restored_from,
            full_loss=full_loss(),
            finished_epochs=adl.finished_epochs(),
            lr=scheduler.get_last_lr()[0],
        )
        try:
            for epoch in adl.remaining_epochs_until(EPOCHS):
                for idx, x, y in loader:
                    helper = adl.current_dataloader()
                    assert helper is not None
                    index = helper.current_index
                    assert index is not None
                    expected, padding = expected_batch(
                        epoch, index, helper.current_local_bsz, len(idx)
                    )
                    optimizer.zero_grad()
                    loss = torch.nn.functional.mse_loss(adp(x), y)
                    loss.backward()
                    optimizer.step()
                    record(
                        epoch=epoch,
                        index=index,
                        indices=idx.tolist(),
                        expected=expected,
                        padding=padding,
                        loss=loss.item(),
                        batch_size=helper.current_batch_size,
                    )
                    if sums is not None:
                        sums["loss"] += loss.item()
                    if STEP_SLEEP:
                        time.sleep(STEP_SLEEP)
                scheduler.step()
                record(epoch_end=epoch, full_loss=full_loss())
                with sums.synchronized() if sums is not None else contextlib.nullcontext():
                    if EVAL_SLEEP and (topo.rank == 0 or not EVAL_RANK0):
                        record(evaluating=epoch)
                        time.sleep(EVAL_SLEEP)
            record(post=True, finished_epochs=adl.finished_epochs())
            if POST_SLEEP:
                time.sleep(POST_SLEEP)
        except SystemExit as exc:
            record(exit=exc.code, digest=digest(model))
            raise
        record(exit=0, digest=digest(model))


if __name__ == "__main__":
    main()
