"""The classifier of items 2 and 3: an MLP on a Gaussian mixture, trained by torchrun workers.

One worker trains one configuration to a target scale-invariant progress (in
epochs of the initial batch size: ``progress_epochs * train_size / init_batch_size``
initial-batch steps) and reports the trajectory; the loop and what it reports are
`experiments.harness.trainer.train`'s, shared with the problems of item 4.

Either the batch size is fixed (``local_bsz`` and ``accum_steps`` given: the job's
batch-size decision is replaced by `FixedSplit`) or it is adaptive
(``autoscale``: AdaptDL's goodput-driven decision, up to ``max_batch_size``).
The learning rate follows a cosine schedule over the *progress*, so that runs at
different scales see the same schedule per unit of progress, and the scaling
rule (AdaScale or linear) multiplies it at each step.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from experiments.harness.launch import gaussian_mixture, worker_config
from experiments.harness.trainer import classifier_eval, train

#: The problem and the base optimiser, tuned at the initial batch size only.
PROBLEM = {
    "num_classes": 10,
    "dim": 20,
    "spread": 0.35,
    "train_size": 8192,
    "val_size": 4096,
    "hidden": 64,
    "init_batch_size": 16,
    "lr": 0.6,
    "seed": 0,
}


def data(cfg: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_val, y_val), standardised with the training statistics."""
    n_train, n_val = cfg["train_size"], cfg["val_size"]
    x, y = gaussian_mixture(
        n_train + n_val,
        num_classes=cfg["num_classes"],
        dim=cfg["dim"],
        spread=cfg["spread"],
        seed=cfg["seed"],
    )
    mean, std = x[:n_train].mean(axis=0), x[:n_train].std(axis=0)
    x = (x - mean) / std
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def worker() -> None:
    """One replica of one training run (see the module docstring for the config)."""
    import torch.nn.functional as F

    import adaptdl.torch as adl
    import torch

    cfg = worker_config()
    adl.init_process_group("gloo")
    torch.manual_seed(cfg["seed"])
    x_np, y_np, xv_np, yv_np = data(cfg)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    xv, yv = torch.from_numpy(xv_np), torch.from_numpy(yv_np)
    model = torch.nn.Sequential(
        torch.nn.Linear(cfg["dim"], cfg["hidden"]),
        torch.nn.ReLU(),
        torch.nn.Linear(cfg["hidden"], cfg["num_classes"]),
    )

    def batch_loss(net: Any, idx: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(net(x[idx]), y[idx])

    def evaluate() -> tuple[float, float]:
        return classifier_eval(model, xv, yv)

    train(cfg, model, batch_loss, evaluate)


if __name__ == "__main__":
    worker()
