"""A torchrun worker for tests: `noise_match.match_noise` over replicas, against the
mix computed in one process from every replica's samples (rank 0 writes both)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from experiments.harness.launch import worker_config, write_result
from experiments.harness.noisematch import match_noise

import torch


def main() -> None:
    """Each replica holds its own 16 samples; the averaged gradient is the 32's."""
    cfg = worker_config()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)  # the same data and model on every replica
    z = torch.randn(16 * world, 3, generator=gen, dtype=torch.float64)
    model = torch.nn.Linear(3, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(torch.randn(1, 3, generator=gen, dtype=torch.float64))

    def batch_loss(net: Any, idx: torch.Tensor) -> torch.Tensor:
        # Quadratic in w, so each sample's gradient depends on the parameters.
        return (net(z[idx]).squeeze(1) - z[idx, 0]).pow(2).mean()

    def gradient(idx: torch.Tensor) -> torch.Tensor:
        model.zero_grad()
        batch_loss(model, idx).backward()
        return model.weight.grad.detach().clone()

    local = torch.arange(16 * rank, 16 * (rank + 1))
    everything = torch.arange(16 * world)
    large = gradient(everything)  # what the replicas' averaged step would hold
    firsts = [torch.arange(16 * r, 16 * r + cfg["samples"]) for r in range(world)]
    small = gradient(torch.cat(firsts))
    model.weight.grad = large.clone()
    match_noise(model, batch_loss, local, cfg["samples"], cfg["weight"])
    if rank == 0:
        expected = large + cfg["weight"] * (small - large)
        write_result(
            {
                "world": world,
                "mixed": model.weight.grad.view(-1).tolist(),
                "expected": expected.view(-1).tolist(),
                "large": large.view(-1).tolist(),
            }
        )
    # Both replicas leave the group together: gloo aborts a process exiting with it open.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
