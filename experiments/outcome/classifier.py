"""The classifier of items 2 and 3: an MLP on a Gaussian mixture, trained by torchrun workers.

One worker trains one configuration to a target scale-invariant progress (in
epochs of the initial batch size: ``progress_epochs * train_size / init_batch_size``
initial-batch steps) and reports the trajectory: per optimiser step the progress,
total batch size, accumulation steps, gain, learning-rate factor and goodput; at
regular intervals of processed samples the validation loss and accuracy, with
the training wall time and this process's CPU time so far (evaluation excluded).

Either the batch size is fixed (``local_bsz`` and ``accum_steps`` given: the job's
batch-size decision is replaced by `FixedSplit`) or it is adaptive
(``autoscale``: AdaptDL's goodput-driven decision, up to ``max_batch_size``).
The learning rate follows a cosine schedule over the *progress*, so that runs at
different scales see the same schedule per unit of progress, and the scaling
rule (AdaScale or linear) multiplies it at each step.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
from experiments.outcome._common import FixedSplit, gaussian_mixture, worker_config, write_result

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
    from adaptdl.torch._context import current_job
    from adaptdl.torch.scaling_rules import AdaScale, LinearScale

    cfg = worker_config()
    adl.init_process_group("gloo")
    job = current_job()
    torch.manual_seed(cfg["seed"])
    x_np, y_np, xv_np, yv_np = data(cfg)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    xv, yv = torch.from_numpy(xv_np), torch.from_numpy(yv_np)
    b0 = cfg["init_batch_size"]
    n = cfg["train_size"]

    loader = adl.AdaptiveDataLoader(range(n), batch_size=b0, shuffle=True)
    if cfg.get("autoscale"):
        loader.autoscale_batch_size(
            cfg["max_batch_size"],
            local_bsz_bounds=tuple(cfg["local_bsz_bounds"]),  # type: ignore[arg-type]
            gradient_accumulation=cfg["gradient_accumulation"],
        )
    else:
        local, accum = cfg["local_bsz"], cfg["accum_steps"]
        job.batch_size_decision = FixedSplit(local, accum)
        total = local * (accum + 1) * job.topology.num_replicas
        # Adaptive mode with a fixed decision: the loop then ends on progress, not data.
        loader.autoscale_batch_size(max(total, b0), gradient_accumulation=True)
    model = torch.nn.Sequential(
        torch.nn.Linear(cfg["dim"], cfg["hidden"]),
        torch.nn.ReLU(),
        torch.nn.Linear(cfg["hidden"], cfg["num_classes"]),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    rule = LinearScale() if cfg["rule"] == "linear" else AdaScale()
    adp = adl.AdaptiveDataParallel(model, optimizer, scaling_rule=rule)

    target = cfg["progress_epochs"] * n / b0  # initial-batch steps

    def evaluate() -> tuple[float, float]:
        with torch.no_grad():
            logits = model(xv)
            loss = float(F.cross_entropy(logits, yv))
            acc = float((logits.argmax(1) == yv).float().mean())
        return loss, acc

    steps: list[list[float]] = []
    evals: list[list[float]] = []
    samples = 0
    next_eval = 0
    train_time = 0.0
    train_cpu = 0.0  # this process's CPU time: less sensitive than wall time to other load
    target_acc = cfg.get("target_accuracy")
    reached: dict[str, float] | None = None
    diverged = False
    tick, tick_cpu = time.perf_counter(), time.process_time()
    for _ in adl.remaining_epochs_until(cfg["progress_epochs"]):
        for idx in loader:
            helper = adl.current_dataloader()
            assert helper is not None
            loss = F.cross_entropy(adp(x[idx]), y[idx])
            optimizer.zero_grad()
            loss.backward()
            samples += len(idx) * job.topology.num_replicas
            if helper.is_accum_step():
                optimizer.step()  # skipped by the adapter until the batch's last micro-batch
                continue
            fraction = min(adp.progress / target, 1.0)
            for group in optimizer.param_groups:
                group["lr"] = cfg["lr"] * 0.5 * (1.0 + math.cos(math.pi * fraction))
            optimizer.step()
            if not math.isfinite(float(loss)):
                diverged = True
            steps.append(
                [
                    adp.progress,
                    helper.current_batch_size,
                    helper.current_local_bsz,
                    helper.accumulation_steps,
                    adp.last_gain,
                    adp.last_lr_factor,
                    float(loss),
                    adp.goodput() or 0.0,
                    train_time + time.perf_counter() - tick,
                ]
            )
            if samples >= next_eval:
                train_time += time.perf_counter() - tick
                train_cpu += time.process_time() - tick_cpu
                val_loss, val_acc = evaluate()
                evals.append([adp.progress, samples, train_time, val_loss, val_acc, train_cpu])
                if target_acc is not None and reached is None and val_acc >= target_acc:
                    reached = {
                        "seconds": train_time,
                        "cpu_seconds": train_cpu,
                        "progress": adp.progress,
                        "samples": samples,
                        "steps": len(steps),
                    }
                next_eval += cfg["eval_every_samples"]
                tick, tick_cpu = time.perf_counter(), time.process_time()
            if diverged or (cfg.get("stop_at_target") and reached is not None):
                break
        if diverged or (cfg.get("stop_at_target") and reached is not None):
            break
    train_time += time.perf_counter() - tick
    train_cpu += time.process_time() - tick_cpu
    val_loss, val_acc = evaluate()
    if not evals or evals[-1][1] != samples:
        evals.append([adp.progress, samples, train_time, val_loss, val_acc, train_cpu])
    if job.topology.rank == 0:
        gns = adp.gns
        write_result(
            {
                "config": cfg,
                "replicas": job.topology.num_replicas,
                "steps": steps,
                "evals": evals,
                "val_loss": val_loss,
                "val_acc": val_acc,
                "progress": adp.progress,
                "samples": samples,
                "train_seconds": train_time,
                "train_cpu_seconds": train_cpu,
                "reached": reached,
                "diverged": diverged,
                "noise_scale": gns.noise_scale if gns is not None else None,
            }
        )


if __name__ == "__main__":
    worker()
