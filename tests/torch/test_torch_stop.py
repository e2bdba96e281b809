"""Stop signals in one training process, DataLoader workers under a scheduler's signals,
and a registered state the checkpoint lacks."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from torch.utils.data import Dataset, TensorDataset

import adaptdl.torch as adl
import torch
from adaptdl.core.loop.boundary import Preempted
from adaptdl.core.persist.checkpoint import CheckpointError
from adaptdl.torch import _context


@pytest.fixture
def ckpt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A checkpoint directory for the process's job, initialised on it."""
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path))
    adl.init_process_group("gloo")
    return tmp_path


def test_sigint_checkpoints_like_sigterm_and_exits_130(ckpt: Path) -> None:
    loader = adl.AdaptiveDataLoader(TensorDataset(torch.arange(20)), batch_size=2)
    batches = 0
    with pytest.raises(Preempted) as stopped:
        for _ in adl.remaining_epochs_until(1):
            for _ in loader:
                batches += 1
                if batches == 2:
                    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: no KeyboardInterrupt
    assert stopped.value.code == 130 and batches == 3  # acted on one boundary later
    assert len(list(ckpt.glob("ckpt-*"))) == 1


def test_sigterm_between_loops_checkpoints_and_ends_at_once(ckpt: Path) -> None:
    loader = adl.AdaptiveDataLoader(TensorDataset(torch.arange(8)), batch_size=2)
    evaluated = []
    with pytest.raises(Preempted) as stopped:
        for epoch in adl.remaining_epochs_until(3):
            list(loader)
            os.kill(os.getpid(), signal.SIGTERM)  # during the "evaluation"
            evaluated.append(epoch)  # not reached: the signal ends the program here
    assert stopped.value.code == 143 and evaluated == []
    _context._reset()
    adl.init_process_group("gloo")
    loader = adl.AdaptiveDataLoader(TensorDataset(torch.arange(8)), batch_size=2)
    sizes = [len(list(loader)) for _ in adl.remaining_epochs_until(3)]
    assert sizes == [0, 4, 4]  # epoch 0's training loop is not redone


def test_sigterm_after_training_exits_143_without_training_again(ckpt: Path) -> None:
    loader = adl.AdaptiveDataLoader(TensorDataset(torch.arange(8)), batch_size=2)
    for _ in adl.remaining_epochs_until(2):
        list(loader)
    with pytest.raises(Preempted):
        os.kill(os.getpid(), signal.SIGTERM)  # post-processing
        time.sleep(5)
    _context._reset()
    adl.init_process_group("gloo")
    adl.AdaptiveDataLoader(TensorDataset(torch.arange(8)), batch_size=2)
    assert list(adl.remaining_epochs_until(2)) == []


class Pids(Dataset[int]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> int:
        time.sleep(0.02)
        return os.getpid()


def test_dataloader_workers_ignore_a_schedulers_signals_and_obey_their_process(ckpt: Path) -> None:
    """Every process gets SIGTERM and SIGINT twice (Slurm); the loop goes on to a stop."""
    loader = adl.AdaptiveDataLoader(Pids(), batch_size=2, num_workers=2)
    workers: set[int] = set()
    with pytest.raises(Preempted) as stopped:
        for _ in adl.remaining_epochs_until(1):
            for step, pids in enumerate(loader):
                workers.update(pids.tolist())
                if step == 3:
                    # Sent by another process, as a scheduler would (not the workers' parent).
                    for signum in ("TERM", "INT", "TERM"):
                        pids_text = [str(p) for p in workers]
                        subprocess.run(["kill", f"-{signum}", *pids_text], check=True)
                    os.kill(os.getpid(), signal.SIGTERM)
    assert stopped.value.code == 143 and len(workers) == 2
    assert len(list(ckpt.glob("ckpt-*"))) == 1


def train_once(with_model: bool) -> None:
    adl.init_process_group("gloo")
    try:
        loader = adl.AdaptiveDataLoader(TensorDataset(torch.arange(8)), batch_size=2)
        if with_model:
            model = torch.nn.Linear(1, 1)
            adl.AdaptiveDataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for _ in adl.remaining_epochs_until(1):
            for _batch in loader:
                _context.current_job().request_stop()
    finally:
        _context._reset()


def test_a_model_the_checkpoint_lacks_is_an_error_unless_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model wrapper was added (or renamed) since the checkpoint: never silently fresh."""
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path))
    with pytest.raises(Preempted):
        train_once(with_model=False)
    with pytest.raises(CheckpointError) as info:
        train_once(with_model=True)
    message = str(info.value)
    assert "'adaptdl-dataparallel'" in message and str(tmp_path / "ckpt-000001") in message
    monkeypatch.setenv("ADAPTDL_ALLOW_MISSING_STATE", "adaptdl-dataparallel")
    with pytest.raises(Preempted):
        train_once(with_model=True)


def test_reinstall_puts_the_stop_handlers_back_after_another_replaced_them() -> None:
    from adaptdl.torch import _signals

    adl.init_process_group("gloo")
    ours = {s: signal.getsignal(s) for s in _signals.STOP_SIGNALS}
    for signum in _signals.STOP_SIGNALS:  # as a framework's Trainer does
        signal.signal(signum, signal.SIG_IGN)
    _signals.reinstall()
    assert {s: signal.getsignal(s) for s in _signals.STOP_SIGNALS} == ours
    assert all(callable(handler) for handler in ours.values())
