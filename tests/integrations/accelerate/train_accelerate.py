"""A small Hugging Face Accelerate training loop on AdaptDL, launched by torchrun (e2e tests).

Every replica appends one JSON line per micro-batch to
``$E2E_RECORD_DIR/run<R>-rank<k>.jsonl``: the dataset indices the loop received,
those core's sharding assigns (and which are padding), the batch size the loader
decided, whether Accelerate synchronised the gradients, and how the replica
exited.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from accelerate import Accelerator
from torch.utils.data import Dataset

import adaptdl.torch as adl
import torch
from adaptdl.core.order.sampling import Shard
from adaptdl.core.order.seed import SHUFFLE_SEED
from adaptdl.torch import accelerate as adaptdl_accelerate

N = int(os.environ.get("E2E_N", "96"))
EPOCHS = int(os.environ.get("E2E_EPOCHS", "2"))
STEP_SLEEP = float(os.environ.get("E2E_STEP_SLEEP", "0"))
RUN = int(os.environ.get("E2E_RUN", "0"))
RECORD_DIR = os.environ["E2E_RECORD_DIR"]


class Regression(Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    """y = x @ w + noise, with each sample's own index first."""

    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 8, generator=gen)
        self.y = self.x @ torch.randn(8, 1, generator=gen) + 0.1 * torch.randn(n, 1, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


def decision(helper: Any) -> dict[str, Any]:
    """The loader's batch-size decision for the current micro-batch."""
    return {
        "batch_size": helper.current_batch_size,
        "local_bsz": helper.current_local_bsz,
        "accumulation_steps": helper.accumulation_steps,
        "optim_step": helper.is_optim_step(),
    }


def main() -> None:
    adl.init_process_group("gloo")  # before Accelerate, which then uses this process group
    accelerator = Accelerator(cpu=True)  # CPU processes under torchrun
    torch.manual_seed(0)
    loader = adl.AdaptiveDataLoader(Regression(N), batch_size=8, shuffle=True)
    loader.autoscale_batch_size(32, local_bsz_bounds=(2, 8), gradient_accumulation=True)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.01 * step))
    model, optimizer, loader, scheduler = adaptdl_accelerate.prepare(
        accelerator, model, optimizer, loader, scheduler
    )
    rank, replicas = accelerator.process_index, accelerator.num_processes
    path = os.path.join(RECORD_DIR, f"run{RUN}-rank{rank}.jsonl")
    with open(path, "a", encoding="utf-8") as out:

        def record(**entry: Any) -> None:
            entry.update(run=RUN, rank=rank, replicas=replicas)
            out.write(json.dumps(entry) + "\n")
            out.flush()

        record(start=True, scheduler_steps=scheduler.scheduler.last_epoch)
        try:
            for epoch in adl.remaining_epochs_until(EPOCHS):
                for idx, x, y in loader:
                    helper = adl.current_dataloader()
                    assert helper is not None and helper.current_index is not None
                    index = helper.current_index
                    with accelerator.accumulate(model):
                        loss = torch.nn.functional.mse_loss(model(x), y)
                        accelerator.backward(loss)
                        optimizer.step()
                        scheduler.step()
                        optimizer.zero_grad()
                    # Where the batch came from, what core assigns there, what was decided.
                    share = Shard(N, index, replicas, rank, seed=SHUFFLE_SEED, epoch=epoch)
                    entry = {"epoch": epoch, "index": index, "indices": idx.tolist()}
                    entry["expected"] = share.indices(0, len(idx)).tolist()
                    entry["padding"] = share.is_padding(0, len(idx)).tolist()
                    record(
                        **entry,
                        **decision(helper),
                        sync_gradients=accelerator.sync_gradients,
                        scheduler_steps=scheduler.scheduler.last_epoch,
                        modelled=model.goodput() is not None,
                    )
                    if STEP_SLEEP:
                        time.sleep(STEP_SLEEP)
        except SystemExit as exc:
            record(exit=exc.code)
            raise
        record(exit=0)


if __name__ == "__main__":
    main()
