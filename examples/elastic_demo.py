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

The SIGTERM lands while rank 0 prints an epoch's row, between two loops, as a
scheduler's signal often does; the replicas then meet at the next epoch and
checkpoint there. Each replica's stderr is kept (``--logs``, printed at the start),
and after every stop the demo checks that the stop wrote a checkpoint newer than
the previous one and that the next run resumed from it at the epoch after the
last row printed; it fails loudly (exit 1, the failing check and the logs' tails)
otherwise. ``--hold S`` keeps rank 0 S seconds after each row, as a busy machine
does.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EPOCHS = 10
N = 2048
TAG = "TIMELINE "


def train() -> None:
    from torch.utils.data import TensorDataset

    import adaptdl.torch as adl
    import torch

    # Read from torchrun's environment, not the job: the log must be redirected before
    # init_process_group prints anything.
    rank = int(os.environ.get("RANK", "0"))
    logs = os.environ.get("DEMO_LOGS")
    if logs:  # this replica's stderr, C-level output and tracebacks included
        path = os.path.join(logs, f"run{os.environ['DEMO_RUN']}-rank{rank}.stderr")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
    hold = float(os.environ.get("DEMO_HOLD", "0"))
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
    replicas = adl.current_job().topology.num_replicas
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
                time.sleep(hold)
            accuracy.clear()


def _row(row: dict[str, object], run: int) -> str:
    goodput = row["goodput"]
    goodput_text = f"{goodput:9.0f}" if isinstance(goodput, float) else f"{'-':>9}"
    return (
        f"{run:>3} {row['replicas']:>8} {row['epoch']:>5} {row['batch_size']:>10} "
        f"{row['local_bsz']:>9} {row['accum']:>5} {row['gain']:>6.2f} {goodput_text} "
        f"{row['loss']:>7.4f} {row['accuracy']:>7.3f}"
    )


class DemoFailure(Exception):
    """A stop lost work or a run did not resume where the previous one stopped."""


def _newest(checkpoints: str) -> str | None:
    labels = [p.name for p in Path(checkpoints).glob("ckpt-*")]
    return max(labels, key=lambda n: (len(n), n)) if labels else None


def _check_stop(rank0: str, before: str | None, after: str | None, last_row: int) -> None:
    """Rank 0's stderr of a stopped run: it checkpointed, and newer than ``before``."""
    if "without a checkpoint" in rank0 or "checkpointing" not in rank0:
        raise DemoFailure("the stop wrote no checkpoint: the work since the last one is lost")
    if after is None or (before is not None and (len(after), after) <= (len(before), before)):
        raise DemoFailure(f"no checkpoint newer than {before} after the stop (newest: {after})")
    written = re.findall(r"checkpoint '[^']*?(ckpt-\d+)' written .* in epoch (\d+)", rank0)
    if not written or written[-1][0] != after:
        raise DemoFailure(f"rank 0 does not report writing {after}")
    if int(written[-1][1]) != last_row + 1:
        raise DemoFailure(
            f"the stop's checkpoint is in epoch {written[-1][1]}, not in the epoch after the "
            f"last row printed ({last_row})"
        )


def _check_resume(rank0: str, stopped_at: str, last_row: int, first_row: int | None) -> None:
    """Rank 0's stderr of the run after a stop: resumed from its checkpoint, not behind."""
    resumed = re.search(r"resumed from checkpoint '[^']*?(ckpt-\d+)' at epoch (\d+)", rank0)
    if resumed is None or resumed.group(1) != stopped_at:
        raise DemoFailure(f"the run did not resume from {stopped_at}, the stop's checkpoint")
    if int(resumed.group(2)) != last_row + 1 or first_row not in (None, last_row + 1):
        raise DemoFailure(
            f"stopped after epoch {last_row} but resumed at epoch {resumed.group(2)} "
            f"(first row: epoch {first_row}): behind where it stopped"
        )


def _tails(logs: Path, run: int) -> str:
    out = []
    for path in sorted(logs.glob(f"run{run}-*")):
        lines = path.read_text(errors="replace").splitlines()[-15:]
        out.append(f"--- {path}:\n" + "\n".join(lines))
    return "\n".join(out)


def drive(logs: Path, hold: float) -> int:
    """Launch torchrun at 2, 3, then 1 replicas, stopping the first two with SIGTERM."""
    from adaptdl.torch.launch import torchrun_command

    plan = [(2, 3), (3, 3), (1, None)]  # (replicas, epochs to let finish before SIGTERM)
    logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="adaptdl-demo-") as checkpoints:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "ADAPTDL_CHECKPOINT_PATH": checkpoints,
            "DEMO_LOGS": str(logs),
            "DEMO_HOLD": str(hold),
        }
        print(f"checkpoints in {checkpoints}, each replica's stderr in {logs}")
        print("run replicas epoch batch_size local_bsz accum   gain   goodput    loss     acc")
        started = time.monotonic()
        stopped: tuple[str, int] | None = None  # (the stop's checkpoint, last row's epoch)
        for run, (replicas, stop_after) in enumerate(plan):
            command = torchrun_command(
                os.path.abspath(__file__), replicas, args=["--train"], monitor_interval=0.5
            )
            before = _newest(checkpoints)
            with open(logs / f"run{run}-torchrun.log", "w") as agent:
                proc = subprocess.Popen(
                    command,
                    env={**env, "DEMO_RUN": str(run)},
                    stdout=subprocess.PIPE,
                    stderr=agent,
                    text=True,
                )
                assert proc.stdout is not None
                epochs = []
                for line in proc.stdout:
                    if not line.startswith(TAG):
                        continue
                    row = json.loads(line[len(TAG) :])
                    print(_row(row, run), flush=True)
                    epochs.append(row["epoch"])
                    if stop_after is not None and len(epochs) == stop_after:
                        proc.send_signal(signal.SIGTERM)
                        print("--- SIGTERM: every replica checkpoints and exits with 143 ---")
                code = proc.wait()
            rank0 = (logs / f"run{run}-rank0.stderr").read_text(errors="replace")
            try:
                if "Traceback" in rank0 or any(
                    "Traceback" in p.read_text(errors="replace")
                    for p in logs.glob(f"run{run}-rank*.stderr")
                ):
                    raise DemoFailure("a replica died with a traceback")
                if stopped is not None:
                    _check_resume(rank0, stopped[0], stopped[1], epochs[0] if epochs else None)
                if stop_after is None:
                    if code != 0:
                        raise DemoFailure(f"the last run failed with exit code {code}")
                    continue
                after = _newest(checkpoints)
                _check_stop(rank0, before, after, epochs[-1])
                assert after is not None
                stopped = (after, epochs[-1])
            except DemoFailure as failure:
                print(f"FAILED: run {run}: {failure}\n{_tails(logs, run)}", file=sys.stderr)
                return 1
            print(f"--- run {run} stopped at {stopped[0]}; the next run resumes from it ---")
        print(f"done in {time.monotonic() - started:.0f}s")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", action="store_true", help="run one replica (for torchrun)")
    parser.add_argument(
        "--logs", type=Path, default=None, help="where each replica's stderr goes (a new folder)"
    )
    parser.add_argument(
        "--hold", type=float, default=0.0, help="seconds rank 0 waits after printing a row"
    )
    args = parser.parse_args()
    if args.train:
        train()
        return 0
    logs = args.logs or Path(tempfile.mkdtemp(prefix="adaptdl-demo-logs-"))
    return drive(logs, args.hold)


if __name__ == "__main__":
    sys.exit(main())
