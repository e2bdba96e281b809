"""Run by test_step_cost under torchrun: what a step of `AdaptiveDataParallel` measures
and which collectives it calls, on 2 replicas (gloo).

``python ddp_replicas.py OUT``: two models train one epoch each, every other step
measured, one micro-batch of 4 per replica per step: the first with DDP's defaults
(the local norms read from ``.grad`` at the end of the backward pass), the second
with ``gradient_as_bucket_view=True`` (``.grad`` is then the bucket being reduced:
the gradient hooks measure it). Each replica writes, per model and step, what core
was handed, the squared norms of the local gradients (seen by hooks of the test's
own) and of the reduced ones, and the Python-level collectives called since the
previous step's end (DDP's own all-reduces run in C++ and are not among them).
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.utils.data import TensorDataset

import adaptdl.torch as adl
import torch
from adaptdl.core.stats.statsbudget import MeasureBudget
from adaptdl.torch import _context

CALLS: collections.Counter[str] = collections.Counter()


def counted(name: str) -> None:
    original = getattr(dist, name)

    def call(*args: Any, **kwargs: Any) -> Any:
        CALLS[name] += 1
        return original(*args, **kwargs)

    setattr(dist, name, call)


for _name in ("all_reduce", "all_gather", "broadcast", "barrier", "reduce_scatter"):
    counted(_name)


def sqr(tensors: list[torch.Tensor]) -> float:
    return sum(float(t.double().square().sum()) for t in tensors)


def train(loader: Any, name: str, **kwargs: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    groups = [list(model[0].parameters()), list(model[2].parameters())]
    optimizer = torch.optim.SGD([{"params": g} for g in groups], lr=0.05)
    adp = adl.AdaptiveDataParallel(model, optimizer, name=name, **kwargs)
    adp._steps.budget = MeasureBudget(fixed=0.5)
    handed: list[Any] = []
    measure = adp._steps.measure

    def spy(m: Any, init: int) -> Any:
        handed.append(m)
        return measure(m, init)

    adp._steps.measure = spy
    local: dict[int, list[torch.Tensor]] = {}
    for index, group in enumerate(groups):
        for param in group:
            param.register_hook(lambda g, i=index: local[i].append(g.detach().clone()))
    steps: list[dict[str, Any]] = []
    before = dict(CALLS)
    for _ in adl.remaining_epochs_until(adl.finished_epochs() + 1):
        for x, y in loader:
            handed.clear()
            local.update({i: [] for i in range(len(groups))})
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(adp(x), y).backward()
            total = [sqr([p.grad for p in g]) for g in groups]
            taken = adp._steps.taken
            optimizer.step()
            m = handed[0] if handed else None
            steps.append(
                {
                    "measured": adp._steps.budget.measures(taken),
                    "local": [sqr(local[i]) for i in range(len(groups))],
                    "total": total,
                    "handed": None if m is None else [list(m.local_sqr), list(m.total_sqr)],
                    # Since the last step's: the step boundary in between, this step.
                    "calls": {k: CALLS[k] - before.get(k, 0) for k in CALLS},
                }
            )
            before = dict(CALLS)
    return {"steps": steps, "in_grads": adp._local_in_grads}


def main() -> None:
    out = Path(sys.argv[1])
    adl.init_process_group("gloo")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, generator=gen)
    loader = adl.AdaptiveDataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    loader.train()
    _context.current_job().batch_size_decision = lambda query: (4, 0)
    results = {
        "grads": train(loader, "grads"),
        "hooks": train(loader, "hooks", gradient_as_bucket_view=True),
    }
    rank = dist.get_rank()
    (out / f"ddp-rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
