"""A training job under a scheduler (ADAPTDL_SHARE_PATH set) publishes its hints and
progress for it (core's `adaptdl.core.jobreport`, driven by the torch adapter's job)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from torch.utils.data import TensorDataset

import adaptdl.torch as adl
import torch
from adaptdl.core import jobreport
from adaptdl.core.persist.localfs import LocalShare
from adaptdl.torch import _context
from adaptdl.torch.parallel import AdaptiveDataParallel


def _train(epochs: int) -> adl.AdaptiveDataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(96, 3, generator=gen)
    data = TensorDataset(x, x.sum(1, keepdim=True) + 0.3 * torch.randn(96, 1, generator=gen))
    loader = adl.AdaptiveDataLoader(data, batch_size=4)
    loader.autoscale_batch_size(32, (2, 16))
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    adp = AdaptiveDataParallel(model, opt)
    for _epoch in adl.remaining_epochs_until(epochs):
        for xb, yb in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(adp(xb), yb).backward()
            opt.step()
    return loader


def test_a_training_loop_under_a_scheduler_publishes_hints_and_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    share = tmp_path / "share"
    monkeypatch.setenv("ADAPTDL_SHARE_PATH", str(share))
    started = time.time()
    loader = _train(epochs=3)
    job = _context.current_job()
    hints = jobreport.read_hints(LocalShare(share))
    progress = jobreport.read_progress(LocalShare(share))
    assert hints is not None and progress is not None
    assert hints["init_batch_size"] == 4 and hints["max_batch_size"] == 32
    assert hints["local_bsz_bounds"] == [2, 16]
    assert progress["replicas"] == 1
    assert progress["batch_size"] == loader.current_batch_size
    assert 1 <= progress["step"] <= job.global_step
    assert started <= progress["time"] <= time.time()
    assert sorted(p.name for p in share.iterdir()) == ["hints.json", "progress.json"]
    assert json.loads((share / "progress.json").read_text()) == progress


def test_without_a_share_path_nothing_is_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    _train(epochs=1)
    assert _context.current_job().reporter is None
    assert list(tmp_path.iterdir()) == []
