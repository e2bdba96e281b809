"""A tiny elastic training script for the end-to-end tests, launched by torchrun.

Every replica appends one JSON line per batch to ``$E2E_RECORD_DIR/run<R>-rank<k>.jsonl``:
the dataset indices the training loop actually received, which of them the core
sharding calls padding, and the loss. At the start of each run and at the end of
each epoch rank 0 also records the loss over the whole dataset, and every replica
records how it exited.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any

from torch.utils.data import Dataset

import adaptdl.torch as adl
import torch
from adaptdl.core.sampling import Shard
from adaptdl.core.seed import SHUFFLE_SEED
from adaptdl.torch._context import current_job

N = int(os.environ.get("E2E_N", "120"))
EPOCHS = int(os.environ.get("E2E_EPOCHS", "3"))
BATCH_SIZE = int(os.environ.get("E2E_BATCH_SIZE", "8"))
WORKERS = int(os.environ.get("E2E_WORKERS", "0"))
STEP_SLEEP = float(os.environ.get("E2E_STEP_SLEEP", "0"))
RUN = int(os.environ.get("E2E_RUN", "0"))
RECORD_DIR = os.environ["E2E_RECORD_DIR"]


class Regression(Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    """y = x @ w + noise, with each sample's own index first."""

    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 8, generator=gen)
        w = torch.randn(8, 1, generator=gen)
        self.y = self.x @ w + 0.05 * torch.randn(n, 1, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


def digest(model: torch.nn.Module) -> str:
    """A fingerprint of the parameters' exact bits: replicas in step have the same."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    adl.init_process_group("gloo")
    job = current_job()
    topo = job.topology
    torch.manual_seed(0)
    dataset = Regression(N)
    loader = adl.AdaptiveDataLoader(
        dataset, batch_size=BATCH_SIZE, shuffle=True, num_workers=WORKERS
    )
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    adp = adl.AdaptiveDataParallel(model, optimizer, scheduler)
    path = os.path.join(RECORD_DIR, f"run{RUN}-rank{topo.rank}.jsonl")
    with open(path, "a", encoding="utf-8") as out:

        def record(**entry: Any) -> None:
            entry.update(
                run=RUN, rank=topo.rank, replicas=topo.num_replicas, attempt=topo.num_restarts
            )
            out.write(json.dumps(entry) + "\n")
            out.flush()

        def full_loss() -> float:
            with torch.no_grad():
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
                    shard = Shard(
                        N,
                        index,
                        topo.num_replicas,
                        topo.rank,
                        seed=SHUFFLE_SEED,
                        epoch=epoch,
                        shuffle=True,
                    )
                    k = len(idx)
                    optimizer.zero_grad()
                    loss = torch.nn.functional.mse_loss(adp(x), y)
                    loss.backward()
                    optimizer.step()
                    record(
                        epoch=epoch,
                        index=index,
                        indices=idx.tolist(),
                        expected=shard.indices(0, k).tolist(),
                        padding=shard.is_padding(0, k).tolist(),
                        loss=loss.item(),
                        batch_size=helper.current_batch_size,
                    )
                    if STEP_SLEEP:
                        time.sleep(STEP_SLEEP)
                scheduler.step()
                record(epoch_end=epoch, full_loss=full_loss())
        except SystemExit as exc:
            record(exit=exc.code, digest=digest(model))
            raise
        record(exit=0, digest=digest(model))


if __name__ == "__main__":
    main()
