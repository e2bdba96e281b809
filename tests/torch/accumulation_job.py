"""A job whose local bounds hold one size and whose optimiser step is costly (#38 item
4), launched by torchrun from test_accumulation_growth.

Linear regression with label noise, local batch bounds (32, 32), gradient accumulation
allowed, and an optimiser whose step sleeps ``ACCUM_STEP_COST`` seconds (as a large
model's optimiser step costs the same whatever the batch). It trains until its total
batch grew by accumulation (or ``ACCUM_MAX_STEPS`` optimiser steps) and writes, per
replica, ``rank<k>.json`` into the folder it is given: the steps it took, the
(local, accumulation steps, total) of every step at which they changed, and the
fitted throughput model.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from torch.utils.data import TensorDataset

import adaptdl.torch as adl
import torch
from adaptdl.torch import current_job

N = 8192
STEP_COST = float(os.environ.get("ACCUM_STEP_COST", "0.02"))
MAX_STEPS = int(os.environ.get("ACCUM_MAX_STEPS", "400"))


class CostlySGD(torch.optim.SGD):
    """SGD whose step costs ``STEP_COST`` seconds more, whatever the batch."""

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        time.sleep(STEP_COST)
        return super().step(closure)


def main() -> None:
    out = sys.argv[1]
    adl.init_process_group("gloo")
    topo = current_job().topology
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(N, 8, generator=gen)
    y = x @ torch.randn(8, 1, generator=gen) + 2.0 * torch.randn(N, 1, generator=gen)
    loader = adl.AdaptiveDataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    loader.autoscale_batch_size(512, local_bsz_bounds=(32, 32), gradient_accumulation=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = CostlySGD(model.parameters(), lr=0.02)
    adp = adl.AdaptiveDataParallel(model, optimizer)
    steps, changes, grown = 0, [], False
    for _ in adl.remaining_epochs_until(100):
        for xb, yb in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(adp(xb), yb).backward()
            optimizer.step()
            helper = adl.current_dataloader()
            assert helper is not None
            if not helper.is_optim_step():
                continue
            steps += 1
            now = [helper.current_local_bsz, helper.accumulation_steps, helper.current_batch_size]
            if not changes or changes[-1][1:] != now:
                changes.append([steps, *now])
            # Every replica decides alike (one collective decision): all stop together.
            grown = now[1] > 0 and now[2] > 2 * 32 * topo.num_replicas
            if grown or steps >= MAX_STEPS:
                break
        if grown or steps >= MAX_STEPS:
            break
    fn = current_job().goodput_fn()
    result = {
        "rank": topo.rank,
        "replicas": topo.num_replicas,
        "steps": steps,
        "changes": changes,
        "perf_params": None if fn is None else fn.perf_params.to_dict(),
    }
    with open(os.path.join(out, f"rank{topo.rank}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
