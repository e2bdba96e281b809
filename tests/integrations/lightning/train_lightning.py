"""A tiny LightningModule and LightningDataModule trained with AdaptiveStrategy under torchrun.

Every replica appends one JSON line per trained batch to
``$E2E_RECORD_DIR/run<R>-rank<k>.jsonl`` (the records of
``tests/e2e/test_elastic_restarts.py``: the dataset indices the training step
received, which of them core's sharding calls padding, the batch sizes), one at
the start, one as each epoch's validation starts and one as it exits (its exit
status). ``E2E_AUTOSCALE=1`` lets the batch size adapt, with accumulation;
``E2E_EVAL_SLEEP`` slows validation down (seconds per batch).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader

import adaptdl.torch as adl
import torch
from adaptdl.core.order.sampling import Shard
from adaptdl.core.order.seed import SHUFFLE_SEED
from adaptdl.torch import current_job
from adaptdl.torch.lightning import AdaptiveStrategy

sys.path.append(str(Path(__file__).resolve().parents[3]))  # the repository, for tests.e2e
# The e2e tests' dataset and settings (E2E_N, E2E_EPOCHS, E2E_RUN, ...).
from tests.e2e.train_elastic import EPOCHS, RECORD_DIR, RUN, STEP_SLEEP, N, Regression

BATCH_SIZE = int(os.environ.get("E2E_BATCH_SIZE", "2"))
AUTOSCALE = os.environ.get("E2E_AUTOSCALE") == "1"
EVAL_SLEEP = float(os.environ.get("E2E_EVAL_SLEEP", "0"))  # per validation batch


class Data(pl.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.dataset = Regression(N)

    def train_dataloader(self) -> adl.AdaptiveDataLoader:
        loader = adl.AdaptiveDataLoader(self.dataset, batch_size=BATCH_SIZE, shuffle=True)
        if AUTOSCALE:
            loader.autoscale_batch_size(
                8 * BATCH_SIZE, (1, BATCH_SIZE), gradient_accumulation=True
            )
        return loader

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.dataset, batch_size=32)


class Model(pl.LightningModule):
    def __init__(self, record: Any) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 1)
        self.record = record

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, x, y = batch
        helper = adl.current_dataloader()
        assert helper is not None
        index = helper.current_index
        assert index is not None
        topo = current_job().topology
        epoch = self.trainer.current_epoch
        shard = Shard(N, index, topo.num_replicas, topo.rank, seed=SHUFFLE_SEED, epoch=epoch)
        loss = torch.nn.functional.mse_loss(self.linear(x), y)
        self.record(
            epoch=epoch,
            adl_epoch=adl.current_epoch(),
            index=index,
            indices=idx.tolist(),
            expected=shard.indices(0, len(idx)).tolist(),
            padding=shard.is_padding(0, len(idx)).tolist(),
            local_bsz=helper.current_local_bsz,
            accumulation_steps=helper.accumulation_steps,
            batch_size=helper.current_batch_size,
            lr=self.trainer.optimizers[0].param_groups[0]["lr"],
            global_step=self.trainer.global_step,
        )
        if STEP_SLEEP:
            time.sleep(STEP_SLEEP)
        return loss

    def on_validation_start(self) -> None:
        if not self.trainer.sanity_checking:
            self.record(validating=self.trainer.current_epoch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        if EVAL_SLEEP and not self.trainer.sanity_checking:
            time.sleep(EVAL_SLEEP)
        self.log("val_loss", torch.nn.functional.mse_loss(self.linear(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.5)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


def main() -> None:
    adl.init_process_group("gloo")
    topo = current_job().topology
    path = os.path.join(RECORD_DIR, f"run{RUN}-rank{topo.rank}.jsonl")
    with open(path, "a", encoding="utf-8") as out:

        def record(**entry: Any) -> None:
            entry.update(run=RUN, rank=topo.rank, replicas=topo.num_replicas)
            out.write(json.dumps(entry) + "\n")
            out.flush()

        torch.manual_seed(0)
        record(start=True, restored=current_job().restored_from)
        trainer = pl.Trainer(
            strategy=AdaptiveStrategy(),
            max_epochs=EPOCHS,
            enable_progress_bar=False,
            enable_model_summary=False,
            logger=False,
            enable_checkpointing=False,
        )
        try:
            trainer.fit(Model(record), datamodule=Data())
        except SystemExit as exc:
            record(exit=exc.code)
            raise
        record(exit=0, finished_epochs=adl.finished_epochs(), current_epoch=trainer.current_epoch)


if __name__ == "__main__":
    main()
