"""A torchrun worker for tests: the outcome trainer's evaluations shared over replicas
against the same evaluations on the whole set in one process (rank 0 writes both)."""

from __future__ import annotations

import torch.distributed as dist
from experiments.harness import problems
from experiments.harness.launch import worker_config, write_result
from experiments.harness.trainer import (
    classifier_eval,
    dyck_lm,
    lm_eval,
    shapes_cnn,
)

import torch


def main() -> None:
    """Evaluate one seeded CNN and one seeded LM both ways."""
    cfg = worker_config()
    dist.init_process_group("gloo")
    torch.manual_seed(0)  # the same models on every replica
    x_np, y_np = problems.shapes(cfg["images"], seed=1)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    cnn = shapes_cnn()
    tok_np, _ = problems.dyck(cfg["sequences"], length=16, k=3, max_depth=6, seed=1)
    tokens = torch.from_numpy(tok_np)
    lm = dyck_lm(7, 16, 16, 1)
    shared = {"cnn": classifier_eval(cnn, x, y), "lm": lm_eval(lm, tokens)}
    with torch.no_grad():
        logits = cnn(x)
        whole_cnn = (
            float(torch.nn.functional.cross_entropy(logits, y)),
            float((logits.argmax(1) == y).float().mean()),
        )
        logits = lm(tokens[:, :-1]).reshape(-1, 6)
        nexts = tokens[:, 1:].reshape(-1)
        whole_lm = (
            float(torch.nn.functional.cross_entropy(logits, nexts)),
            float((logits.argmax(1) == nexts).float().mean()),
        )
    if dist.get_rank() == 0:
        write_result(
            {
                "world": dist.get_world_size(),
                "shared": shared,
                "whole": {"cnn": whole_cnn, "lm": whole_lm},
            }
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
