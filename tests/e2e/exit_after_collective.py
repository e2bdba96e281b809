"""A program whose last act is a collective: it must end with status 0 on every replica.

``E2E_LAST`` picks the collective: ``adaptdl`` (adaptdl.collective's allreduce),
``torch`` (``torch.distributed.all_gather`` on the default gloo group) or
``checkpoint`` (a training loop whose last act is its final checkpoint).
"""

from __future__ import annotations

import os

import torch.distributed as dist

import adaptdl.collective
import adaptdl.torch
import torch


def main() -> None:
    adaptdl.torch.init_process_group("gloo")
    last = os.environ.get("E2E_LAST", "adaptdl")
    rank = dist.get_rank()
    if last == "adaptdl":
        total = adaptdl.collective.allreduce(rank + 1)
        assert total == sum(range(1, dist.get_world_size() + 1)), total
    elif last == "torch":
        out = [torch.empty(1000) for _ in range(dist.get_world_size())]
        dist.all_gather(out, torch.full((1000,), float(rank)))
    elif last == "checkpoint":
        data = torch.utils.data.TensorDataset(torch.arange(16.0).unsqueeze(1))
        loader = adaptdl.torch.AdaptiveDataLoader(data, batch_size=4)
        for _epoch in adaptdl.torch.remaining_epochs_until(1):
            for _batch in loader:
                pass
    else:
        raise ValueError(f"E2E_LAST must be adaptdl, torch or checkpoint, got {last!r}")


if __name__ == "__main__":
    main()
