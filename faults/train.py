"""The training script the fault-injection harness launches under torchrun.

A tiny regression model trained with AdaptDL's data loader and data parallelism.
Every replica appends one JSON line per optimiser step to
``$FAULTS_RECORD_DIR/run<R>-restart<T>-rank<k>.jsonl``, written after the step
(so a record means the step was taken): the dataset indices the loop handed out
and which of them are padding. It also records its start (the checkpoint it
resumed from, the replay the library counted), the end of each epoch, how it
exited, and on rank 0 the time of every checkpoint.

Faults that need to happen inside the process are injected here, never in the
library, by handing the library a faulty checkpoint storage (`FaultyStorage`):

``FAULTS_SLOW_SAVE=<seconds>``
    in the first attempt of a launch (torchrun restart 0), rank 0 pauses that
    long inside every checkpoint write, after the entries and before the
    manifest, and creates ``in-save-run<R>`` in the record directory while it
    waits, so that the harness can kill or signal it there.
``FAULTS_WORKERS=<k>``
    DataLoader worker processes per replica (default 0).
``FAULTS_NODE=<name>``
    the replica runs on node ``name`` of a multi-node launch: its records go to
    ``run<R>-restart<T>-rank<k>-node<name>-pid<p>.jsonl`` (ranks move between
    nodes, and a node's restart count is its own) and name the node.
``FAULTS_HOLD_FILE=<path>``, ``FAULTS_HOLD_FROM=<k>``
    once a replica process took ``k`` steps (default 0), it waits before each
    further step, with its batch in hand, while ``path`` exists and no stop was
    requested: the harness changes the job's membership while it stands there.
``FAULTS_ACCUMULATOR=1``, ``FAULTS_EVAL_SLEEP=<seconds>``, ``FAULTS_EVAL_RANK0=1``
    the loop sums its losses in an ``Accumulator`` (a state every replica must save
    together); after each epoch's loop the replicas "evaluate" inside its
    ``synchronized()`` for that long, recording ``evaluating`` as they start (with
    ``FAULTS_EVAL_RANK0=1`` only rank 0 does, as a busy machine holds one replica,
    while the others go on to the next epoch).
``FAULTS_ENOSPC_AT=<k>``
    in the first attempt of a launch, the k-th file write into the checkpoint
    directory (1 is the writability probe at start) writes half of its bytes and
    fails with ENOSPC, as a full disk would.
``FAULTS_FSDP=1``
    the model is sharded with FSDP2 (``fully_shard``) and adapted by `AdaptiveFSDP`:
    each checkpoint holds every replica's DCP shard files, written through the
    checkpoint storage (`adaptdl.core.persist.shardedfiles.StagedFiles`).
``FAULTS_SHARD_ENOSPC_AT=<k>``, ``FAULTS_SHARD_RANK=<r>``
    in the first attempt of a launch, the k-th sharded-checkpoint file replica ``r``
    writes (its DCP shards; rank 0's DCP metadata too) gets its first 64 bytes
    and fails with ENOSPC, as a full disk would.
``FAULTS_SHARD_LOSE_AT=<k>``, ``FAULTS_SHARD_VICTIM=<i>``
    in the first attempt of a launch, rank 0's storage commits the k-th sharded
    checkpoint and then loses the second half of its i-th shard file (modulo their
    number), as a disk whose rename reached it before the data did; it records
    ``damaged`` with the checkpoint's label.
"""

from __future__ import annotations

import errno
import io
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

from torch.utils.data import Dataset

import adaptdl.torch as adl
import torch
from adaptdl.core.config import JobConfig
from adaptdl.core.loop.boundary import Boundary
from adaptdl.core.order.sampling import Shard
from adaptdl.core.order.seed import SHUFFLE_SEED
from adaptdl.core.persist.localfs import LocalStorage
from adaptdl.core.persist.manifest import MANIFEST
from adaptdl.torch import current_job

N = int(os.environ.get("FAULTS_N", "64"))
EPOCHS = int(os.environ.get("FAULTS_EPOCHS", "2"))
BATCH_SIZE = int(os.environ.get("FAULTS_BATCH_SIZE", "8"))
STEP_SLEEP = float(os.environ.get("FAULTS_STEP_SLEEP", "0"))
RUN = int(os.environ.get("FAULTS_RUN", "0"))
RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RECORD_DIR = Path(os.environ["FAULTS_RECORD_DIR"])
WORKERS = int(os.environ.get("FAULTS_WORKERS", "0"))
NODE = os.environ.get("FAULTS_NODE", "")
HOLD_FILE = Path(os.environ["FAULTS_HOLD_FILE"]) if os.environ.get("FAULTS_HOLD_FILE") else None
HOLD_FROM = int(os.environ.get("FAULTS_HOLD_FROM", "0"))
SLOW_SAVE = float(os.environ.get("FAULTS_SLOW_SAVE", "0")) if RESTART == 0 else 0.0
ENOSPC_AT = int(os.environ.get("FAULTS_ENOSPC_AT", "0")) if RESTART == 0 else 0
FSDP = os.environ.get("FAULTS_FSDP") == "1"
RANK = int(os.environ.get("RANK", "0"))
SHARD_ENOSPC_AT = (
    int(os.environ.get("FAULTS_SHARD_ENOSPC_AT", "0"))
    if RESTART == 0 and int(os.environ.get("FAULTS_SHARD_RANK", "0")) == RANK
    else 0
)
SHARD_LOSE_AT = int(os.environ.get("FAULTS_SHARD_LOSE_AT", "0")) if RESTART == 0 else 0
SHARD_VICTIM = int(os.environ.get("FAULTS_SHARD_VICTIM", "0"))
ACCUMULATOR = os.environ.get("FAULTS_ACCUMULATOR") == "1"
EVAL_SLEEP = float(os.environ.get("FAULTS_EVAL_SLEEP", "0"))
EVAL_RANK0 = os.environ.get("FAULTS_EVAL_RANK0") == "1"


class Regression(Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    """y = x @ w + noise, with each sample's own index first."""

    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 4, generator=gen)
        w = torch.randn(4, 1, generator=gen)
        self.y = self.x @ w + 0.05 * torch.randn(n, 1, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


class _FullDisk(io.FileIO):
    """A new file on a disk that fills up: the write that crosses ``room`` bytes fails."""

    def __init__(self, path: Path, room: int) -> None:
        super().__init__(path, "xb")  # a new file, as LocalStorage.open_new makes
        self.room = room

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if len(view) > self.room:
            super().write(view[: self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.name)
        self.room -= len(view)
        return super().write(view)


class FaultyStorage(LocalStorage):
    """The checkpoint directory, with the faults this launch asks for in its file writes.

    Whole files the storage writes go through `write_durably`; the files of a
    sharded checkpoint, which DCP streams, through `open_new`; a sharded
    checkpoint is committed by `write_directory` after `adopt`.
    """

    def __init__(self, root: str, owner: str) -> None:
        super().__init__(root, owner=owner)  # as the library's own: tagged with the job
        self.writes = 0
        self.staged_files = 0
        self.sharded_commits = 0
        self.adopted: str | None = None

    def open_new(self, path: Path) -> BinaryIO:  # type: ignore[override]
        self.staged_files += 1
        if self.staged_files == SHARD_ENOSPC_AT:
            # Half of what the file would hold: DCP writes it in one stream.
            return io.BufferedWriter(_FullDisk(path, room=64))
        return LocalStorage.open_new(path)

    def adopt(self, staged: str | None) -> None:
        self.adopted = staged
        super().adopt(staged)

    def write_directory(self, name: str, files: Mapping[str, bytes]) -> None:
        sharded = self.adopted is not None
        super().write_directory(name, files)
        if not sharded:
            return
        self.sharded_commits += 1
        if self.sharded_commits == SHARD_LOSE_AT:
            shards = sorted((self.root / name).rglob("*.distcp"))
            victim = shards[SHARD_VICTIM % len(shards)]
            data = victim.read_bytes()
            victim.write_bytes(data[: len(data) // 2])
            entry = {"damaged": name, "file": victim.name, "run": RUN, "restart": RESTART}
            path = RECORD_DIR / f"run{RUN}-restart{RESTART}-rank{RANK}-storage.jsonl"
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps({**entry, "rank": RANK, "t": time.time()}) + "\n")

    def write_durably(self, path: Path, data: bytes) -> None:  # type: ignore[override]
        self.writes += 1
        if self.writes == ENOSPC_AT:
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        if SLOW_SAVE and path.name == MANIFEST:
            marker = RECORD_DIR / f"in-save-run{RUN}"
            marker.write_text(str(os.getpid()))
            time.sleep(SLOW_SAVE)
            marker.unlink(missing_ok=True)
        LocalStorage.write_durably(path, data)


def _storage() -> LocalStorage | None:
    """The checkpoint storage: faulty when this launch injects faults into writes."""
    config = JobConfig.from_env(os.environ)
    if config.checkpoint_path is None or not (
        SLOW_SAVE or ENOSPC_AT or SHARD_ENOSPC_AT or SHARD_LOSE_AT
    ):
        return None  # the library's own
    return FaultyStorage(config.checkpoint_path, config.job_id or "")


def main() -> None:
    adl.init_process_group("gloo", storage=_storage())
    job = current_job()
    topo = job.topology
    torch.manual_seed(0)
    dataset = Regression(N)
    loader = adl.AdaptiveDataLoader(
        dataset, batch_size=BATCH_SIZE, shuffle=True, num_workers=WORKERS
    )
    adp: Any
    model: torch.nn.Module
    if FSDP:
        # Imported here: FSDP2 and DTensor add half again to the import of every
        # replica of every trial, and most trials train with DDP.
        from torch.distributed.fsdp import fully_shard

        from adaptdl.torch.fsdp import AdaptiveFSDP

        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        for layer in (model[0], model[2], model):
            fully_shard(layer)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        adp = AdaptiveFSDP(model, optimizer)
    else:
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        adp = adl.AdaptiveDataParallel(model, optimizer)
    sums = adl.Accumulator() if ACCUMULATOR else None
    name = f"run{RUN}-restart{RESTART}-rank{topo.rank}"
    path = RECORD_DIR / (f"{name}-node{NODE}-pid{os.getpid()}.jsonl" if NODE else f"{name}.jsonl")
    out = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by the OS on SIGKILL too)

    def record(**entry: Any) -> None:
        entry.update(
            run=RUN, restart=RESTART, rank=topo.rank, replicas=topo.num_replicas, t=time.time()
        )
        if NODE:
            entry["node"] = NODE
        out.write(json.dumps(entry) + "\n")
        out.flush()

    # Time each checkpoint: the whole step boundary that wrote it, the checkpoint
    # (serialise, write, barrier) and the store's write alone.
    timing: dict[str, float] = {}
    plain: list[float] = []
    store_save = job.store.save if job.store is not None else None
    job_checkpoint = job.checkpoint
    job_boundary = job.step_boundary

    def timed_save(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            saved = store_save(*args, **kwargs)  # type: ignore[misc]
        finally:
            timing["save"] = time.perf_counter() - start
        record(saved=saved.label)
        return saved

    def timed_checkpoint() -> None:
        start = time.perf_counter()
        try:
            job_checkpoint()
        finally:
            timing["checkpoint"] = time.perf_counter() - start

    def timed_boundary(*, training: bool = True) -> Boundary:
        written = job.checkpoints_written
        start = time.perf_counter()
        try:
            return job_boundary(training=training)
        finally:
            elapsed = time.perf_counter() - start
            if job.checkpoints_written != written and topo.rank == 0:
                record(
                    checkpoint_s=timing.get("checkpoint", 0.0),
                    save_s=timing.get("save", 0.0),
                    boundary_s=elapsed,
                    plain_s=sorted(plain)[len(plain) // 2] if plain else 0.0,
                    slowed=bool(SLOW_SAVE),
                )
            else:
                plain.append(elapsed)

    if store_save is not None:
        job.store.save = timed_save  # type: ignore[method-assign,union-attr]
    job.checkpoint = timed_checkpoint  # type: ignore[method-assign]
    job.step_boundary = timed_boundary  # type: ignore[method-assign]

    record(
        start=True,
        pid=os.getpid(),
        restored=job.restored_from,
        replayed=job.replayed_samples,
        samples_consumed=job.state.samples_consumed,
        finished_epochs=adl.finished_epochs(),
    )
    taken = 0
    try:
        for epoch in adl.remaining_epochs_until(EPOCHS):
            for idx, x, y in loader:
                while (
                    HOLD_FILE is not None
                    and taken >= HOLD_FROM
                    and HOLD_FILE.exists()
                    and not job.stop_requested
                ):
                    time.sleep(0.02)
                taken += 1
                helper = adl.current_dataloader()
                assert helper is not None
                index = helper.current_index
                assert index is not None
                shard = Shard(
                    N,
                    index,
                    topo.num_replicas,
                    topo.rank,
                    seed=SHUFFLE_SEED,
                    epoch=epoch,
                    shuffle=True,
                )
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(adp(x), y)
                loss.backward()
                optimizer.step()
                record(
                    epoch=epoch,
                    index=index,
                    indices=idx.tolist(),
                    padding=shard.is_padding(0, len(idx)).tolist(),
                    batch_size=helper.current_batch_size,
                )
                if sums is not None:
                    sums["loss"] += loss.item()
                if STEP_SLEEP:
                    time.sleep(STEP_SLEEP)
            record(epoch_end=epoch)
            if sums is not None:
                with sums.synchronized():
                    if EVAL_SLEEP and (topo.rank == 0 or not EVAL_RANK0):
                        record(evaluating=epoch)
                        time.sleep(EVAL_SLEEP)
                    sums.clear()
    except SystemExit as exc:
        record(exit=exc.code, replayed=job.replayed_samples)
        raise
    except Exception as exc:
        record(error=f"{type(exc).__name__}: {exc}"[:400])
        raise
    record(exit=0, replayed=job.replayed_samples, finished_epochs=adl.finished_epochs())


if __name__ == "__main__":
    main()
