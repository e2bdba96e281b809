"""A tiny real adaptdl.torch job (gloo, CPU) for the live scheduler's end-to-end test.

Run as a replica with the scheduler's environment. A regression with noisy labels,
an adaptive batch size, and steps that sleep in proportion to the local batch (as
compute would), so that more replicas are worth having and the job lasts long
enough to be resized, while using little CPU. Every replica appends one JSON line
per trained batch to ``$SCHED_E2E_RECORDS/<job>-<pid>.jsonl``: the epoch, the pass,
and the dataset indices the loop received with their padding flags, so that a test
can check each sample of each pass was consumed exactly once across resizes. The job
publishes its hints and progress itself (core's jobreport, ``ADAPTDL_SHARE_PATH``).
``SCHED_E2E_FAIL_AFTER=S``: rank 0 exits with status 3 (a crash, not a stop) once S
steps have run in this launch.
"""

from __future__ import annotations

import json
import os
import time

from torch.utils.data import Dataset

import adaptdl.torch as adl
import torch
from adaptdl.core.order.sampling import Shard
from adaptdl.core.order.seed import SHUFFLE_SEED
from adaptdl.torch import current_job

N = int(os.environ.get("SCHED_E2E_N", "256"))
EPOCHS = int(os.environ.get("SCHED_E2E_EPOCHS", "3"))
# Seconds a step takes per local sample, on top of a fixed part.
PER_SAMPLE = float(os.environ.get("SCHED_E2E_PER_SAMPLE", "0.01"))
FIXED = 0.02
FAIL_AFTER = int(os.environ.get("SCHED_E2E_FAIL_AFTER", "0"))


class Regression(Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 4, generator=gen)
        self.y = self.x.sum(1, keepdim=True) + torch.randn(n, 1, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


def main() -> None:
    adl.init_process_group("gloo")
    topo = current_job().topology
    torch.manual_seed(0)
    loader = adl.AdaptiveDataLoader(Regression(N), batch_size=8, shuffle=True)
    loader.autoscale_batch_size(64, local_bsz_bounds=(4, 32))
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    adp = adl.AdaptiveDataParallel(model, optimizer)
    name = os.environ.get("ADAPTDL_JOB_ID", "job")
    path = os.path.join(os.environ["SCHED_E2E_RECORDS"], f"{name}-{os.getpid()}.jsonl")
    steps = 0
    with open(path, "a", encoding="utf-8") as out:
        for epoch in adl.remaining_epochs_until(EPOCHS):
            for idx, x, y in loader:
                steps += 1
                if FAIL_AFTER and steps > FAIL_AFTER and topo.rank == 0:
                    os._exit(3)  # a crash: no checkpoint, no stop status
                helper = adl.current_dataloader()
                assert helper is not None and helper.current_index is not None
                shard = Shard(
                    N,
                    helper.current_index,
                    topo.num_replicas,
                    topo.rank,
                    seed=SHUFFLE_SEED,
                    epoch=epoch,
                )
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(adp(x), y).backward()
                optimizer.step()
                time.sleep(FIXED + PER_SAMPLE * len(idx))
                out.write(
                    json.dumps(
                        {
                            "epoch": epoch,
                            # An adaptive epoch may run into a second pass.
                            "pass": helper.current_index // N,
                            "indices": idx.tolist(),
                            "padding": shard.is_padding(0, len(idx)).tolist(),
                            "replicas": topo.num_replicas,
                        }
                    )
                    + "\n"
                )
                out.flush()


if __name__ == "__main__":
    main()
