"""Elastic, adaptive training on CPU: 2 replicas, then 3, then 1, with restarts in between.

Run ``python examples/elastic_demo.py``. It launches the training below with
``torchrun`` three times. Between launches it sends SIGTERM to torchrun, as a
scheduler would when it takes resources away or adds some: every replica
checkpoints at the same step and exits with 143, and the next launch, at a
different size, resumes at the same epoch, batch and index. The timeline shows
the number of replicas, the batch size the goodput engine chose (local batch size
and accumulation steps), the AdaScale gain and the modelled goodput.

The training itself (``--train``) is an ordinary PyTorch script with the two
replacements: ``AdaptiveDataLoader`` for ``DataLoader`` and
``AdaptiveDataParallel`` for ``DistributedDataParallel``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

EPOCHS = 10
N = 2048
TAG = "TIMELINE "


def train() -> None:
    from torch.utils.data import TensorDataset

    import adaptdl.torch as adl
    import torch

    adl.init_process_group("gloo")
    gen = torch.Generator().manual_seed(0)
    centers = 2.0 * torch.randn(4, 16, generator=gen)
    labels = torch.randint(0, 4, (N,), generator=gen)
    features = centers[labels] + 3.0 * torch.randn(N, 16, generator=gen)
    dataset = TensorDataset(features, labels)

    loader = adl.AdaptiveDataLoader(dataset, batch_size=32, shuffle=True)
    loader.autoscale_batch_size(512, local_bsz_bounds=(16, 128), gradient_accumulation=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model = adl.AdaptiveDataParallel(model, optimizer)
    rank = int(os.environ.get("RANK", "0"))
    replicas = int(os.environ.get("WORLD_SIZE", "1"))
    accuracy = adl.Accumulator()

    for epoch in adl.remaining_epochs_until(EPOCHS):
        for x, y in loader:
            optimizer.zero_grad()
            out = model(x)
            loss = torch.nn.functional.cross_entropy(out, y)
            loss.backward()
            optimizer.step()
            accuracy["correct"] += int((out.argmax(1) == y).sum())
            accuracy["total"] += len(y)
            accuracy["loss"] += loss.item() * len(y)
        with accuracy.synchronized():
            if rank == 0:
                goodput = model.goodput()
                row = {
                    "replicas": replicas,
                    "epoch": epoch,
                    "batch_size": loader.current_batch_size,
                    "local_bsz": loader.current_local_bsz,
                    "accum": loader.accumulation_steps,
                    "gain": model.gain,
                    "goodput": goodput,
                    "loss": accuracy["loss"] / max(accuracy["total"], 1),
                    "accuracy": accuracy["correct"] / max(accuracy["total"], 1),
                }
                print(TAG + json.dumps(row), flush=True)
            accuracy.clear()


def _row(row: dict[str, object], run: int) -> str:
    goodput = row["goodput"]
    goodput_text = f"{goodput:9.0f}" if isinstance(goodput, float) else f"{'-':>9}"
    return (
        f"{run:>3} {row['replicas']:>8} {row['epoch']:>5} {row['batch_size']:>10} "
        f"{row['local_bsz']:>9} {row['accum']:>5} {row['gain']:>6.2f} {goodput_text} "
        f"{row['loss']:>7.4f} {row['accuracy']:>7.3f}"
    )


def drive() -> int:
    """Launch torchrun at 2, 3, then 1 replicas, stopping the first two with SIGTERM."""
    from adaptdl.torch.launch import torchrun_command

    plan = [(2, 3), (3, 3), (1, None)]  # (replicas, epochs to let finish before SIGTERM)
    with tempfile.TemporaryDirectory(prefix="adaptdl-demo-") as checkpoints:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "ADAPTDL_CHECKPOINT_PATH": checkpoints}
        print(f"checkpoints in {checkpoints}")
        print("run replicas epoch batch_size local_bsz accum   gain   goodput    loss     acc")
        started = time.monotonic()
        for run, (replicas, stop_after) in enumerate(plan):
            command = torchrun_command(
                os.path.abspath(__file__), replicas, args=["--train"], monitor_interval=0.5
            )
            proc = subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )
            assert proc.stdout is not None
            rows = 0
            for line in proc.stdout:
                if not line.startswith(TAG):
                    continue
                print(_row(json.loads(line[len(TAG) :]), run), flush=True)
                rows += 1
                if stop_after is not None and rows == stop_after:
                    proc.send_signal(signal.SIGTERM)
                    print("--- SIGTERM: every replica checkpoints and exits with 143 ---")
            code = proc.wait()
            if stop_after is None and code != 0:
                print(f"run {run} failed with exit code {code}")
                return 1
        print(f"done in {time.monotonic() - started:.0f}s")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", action="store_true", help="run one replica (for torchrun)")
    if parser.parse_args().train:
        train()
        return 0
    return drive()


if __name__ == "__main__":
    sys.exit(main())
