"""Storage faults reach the files of a sharded (FSDP2, DCP) checkpoint: in-process, one replica.

Every file DCP writes into a checkpoint is created through the checkpoint storage
(`adaptdl.core.persist.storage.StagingStorage.create`), and the storage commits the
directory, so a storage handed to the job can fail or damage those writes as it
does any other. The ``sharded_write`` kind of ``python -m faults`` does this with
torchrun and several replicas, with a SIGKILL and counted replays; here one
replica shows each fault's outcome: a full disk fails the save and leaves the
previous checkpoint the newest; a file whose data the disk lost after the commit
is found at the restore, which resumes from the checkpoint before it.
"""

from __future__ import annotations

import errno
import io
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import pytest
from torch.distributed.fsdp import fully_shard
from torch.utils.data import TensorDataset

import adaptdl.torch as adl
import torch
from adaptdl.core.loop.boundary import Preempted
from adaptdl.core.persist.checkpoint import CheckpointStore
from adaptdl.core.persist.localfs import LocalStorage
from adaptdl.torch import _context
from adaptdl.torch.fsdp import AdaptiveFSDP

JOB = "sharded-faults"


class _FullDisk(io.FileIO):
    """A new file that takes ``room`` bytes and then fails with ENOSPC."""

    def __init__(self, path: Path, room: int) -> None:
        super().__init__(path, "xb")
        self.room = room

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if len(view) > self.room:
            super().write(view[: self.room])
            raise OSError(errno.ENOSPC, "No space left on device", self.name)
        self.room -= len(view)
        return super().write(view)


class FaultyStorage(LocalStorage):
    """A checkpoint directory whose sharded files fill the disk or lose their data.

    ``full_at``: the k-th file a writer streams into a staged directory gets 16
    bytes, then ENOSPC. ``lose_at``: the k-th sharded checkpoint is committed, then
    its shard file loses its second half (the rename reached the disk, the data
    did not).
    """

    def __init__(self, root: Path, *, full_at: int = 0, lose_at: int = 0) -> None:
        super().__init__(root, owner=JOB)
        self.full_at, self.lose_at = full_at, lose_at
        self.created: list[str] = []
        self.commits = 0
        self.adopted: str | None = None

    def open_new(self, path: Path) -> BinaryIO:  # type: ignore[override]
        self.created.append(path.name)
        if len(self.created) == self.full_at:
            return io.BufferedWriter(_FullDisk(path, room=16))
        return LocalStorage.open_new(path)

    def adopt(self, staged: str | None) -> None:
        self.adopted = staged
        super().adopt(staged)

    def write_directory(self, name: str, files: Mapping[str, bytes]) -> None:
        sharded = self.adopted is not None
        super().write_directory(name, files)
        if sharded:
            self.commits += 1
            if self.commits == self.lose_at:
                (shard,) = (self.root / name).rglob("*.distcp")
                shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def train(
    storage: LocalStorage | None, stop_after: int | None = None
) -> tuple[str | None, list[int]]:
    """One epoch of a sharded model, a checkpoint after every step.

    Returns the checkpoint it resumed from and the samples it took.
    """
    adl.init_process_group("gloo", storage=storage)
    job = _context.current_job()
    restored = job.restored_from
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    for layer in (model[0], model[2], model):
        fully_shard(layer)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = AdaptiveFSDP(model, optimizer)
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.arange(16), torch.randn(16, 3, generator=gen))
    loader = adl.AdaptiveDataLoader(data, batch_size=4)
    seen: list[int] = []
    try:
        for _ in adl.remaining_epochs_until(1):
            for index, x in loader:
                optimizer.zero_grad()
                wrapped(x).pow(2).mean().backward()
                optimizer.step()
                seen.extend(index.tolist())
                if len(seen) // 4 == stop_after:
                    job.request_stop()
    finally:
        _context._reset()
    return restored, seen


@pytest.fixture
def ckpt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path / "ckpt"))
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_STEPS", "1")
    monkeypatch.setenv("ADAPTDL_JOB_ID", JOB)
    return tmp_path / "ckpt"


def test_a_full_disk_in_a_shard_write_fails_the_save_and_keeps_the_previous(ckpt: Path) -> None:
    # One replica creates two files a checkpoint (its shard, then DCP's metadata):
    # the third is the second checkpoint's shard.
    storage = FaultyStorage(ckpt, full_at=3)
    # DCP gathers every replica's failure into its CheckpointException, a BaseException.
    with pytest.raises(BaseException, match="No space left on device"):
        train(storage)
    assert storage.created[2] == "__0_0.distcp"
    assert CheckpointStore(ckpt, job_id=JOB).labels() == ["ckpt-000001"]
    assert train(None)[0] == "ckpt-000001"  # the next run resumes from it and finishes
    assert CheckpointStore(ckpt, job_id=JOB).labels()[-1] != "ckpt-000001"


def test_a_shard_that_lost_its_data_is_found_and_the_restore_falls_back(
    ckpt: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(Preempted):
        train(FaultyStorage(ckpt, lose_at=2), stop_after=2)
    assert CheckpointStore(ckpt, job_id=JOB).labels() == ["ckpt-000001", "ckpt-000002"]
    with caplog.at_level(logging.WARNING):
        restored, seen = train(None)
    assert "ckpt-000002" in caplog.text and "falling back" in caplog.text
    assert restored == "ckpt-000001"
    assert 0 < len(seen) < 16 and sorted(seen) == list(range(16 - len(seen), 16))
