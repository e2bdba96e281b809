"""A sharded model and its optimiser as a checkpoint state that every replica writes itself.

`ShardedState` is a `adaptdl.core.persist.shardedfiles.FileState`: at a checkpoint each
replica saves the shards it holds with torch's distributed checkpoint (DCP) into
the checkpoint's staging directory (no replica gathers the whole model), every
file created through the checkpoint storage (`adaptdl.core.persist.shardedfiles.StagedFiles`,
so that a storage that fails or damages writes reaches these too), and on
restore DCP reads them back at whatever world size the job now has, resharding
the model and the optimiser's state. Reading goes through `adaptdl.torch.dcp`, so
a crafted checkpoint cannot run code.

`AsyncShardedState` saves in the background (``torch.distributed.checkpoint.async_save``):
training stalls only while the shards are copied aside in memory; each replica
then writes and hashes its files on a thread, and the records reach rank 0 with
DCP's own gathering of the write results, so that rank 0 commits the checkpoint
(`adaptdl.core.persist.shardedfiles.ShardedCheckpointStore`) once every replica's files
are written, and not before.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Callable, Generator, Mapping
from concurrent.futures import Future as ConcurrentFuture
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import attrs

import torch
import torch.distributed as dist
from adaptdl.core.persist.checkpoint import CheckpointError
from adaptdl.core.persist.shardedfiles import FileRecord, StagedFiles
from adaptdl.torch import dcp
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

__all__ = ["AsyncShardedState", "ShardedState"]

_FORMAT = "adaptdl.dcp/1"

# The index of a write result that carries a replica's file records to DCP's
# coordinator with the real ones; removed there before the metadata is written.
_RECORDS = "__adaptdl_file_records__"


class _StagedFileSystem(FileSystem):
    """DCP's local file system, creating every file it writes through the checkpoint storage.

    DCP still renames its metadata into place and reads files itself, in the
    staged directory's local path; each file it writes is created by
    `StagedFiles.create`.
    """

    def __init__(self, staged: StagedFiles) -> None:
        super().__init__()
        self._staged = staged

    @contextlib.contextmanager
    def create_stream(
        self, path: str | os.PathLike[str], mode: str
    ) -> Generator[io.IOBase, None, None]:
        if "r" in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        if mode != "wb":  # DCP writes whole new files; anything else is a new DCP
            raise ValueError(f"DCP asked to write {str(path)!r} with mode {mode!r}, not 'wb'")
        name = Path(path).relative_to(self._staged.path)
        with self._staged.create(str(name)) as file:
            yield cast(io.IOBase, file)


class _StagedWriter(FileSystemWriter):
    """DCP's file writer into a `StagedFiles` directory, through the checkpoint storage."""

    def __init__(self, staged: StagedFiles) -> None:
        super().__init__(staged.path, overwrite=False)
        self.fs = _StagedFileSystem(staged)
        self.staged = staged


class _RecordingWriter(_StagedWriter):
    """DCP's file writer that remembers the names of the files this replica wrote."""

    def __init__(self, staged: StagedFiles) -> None:
        super().__init__(staged)
        self.written: list[str] = []

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        future = super().write_data(plan, planner)
        results = future.wait()  # the plain writer finishes before it returns
        self.written.extend(sorted({r.storage_data.relative_path for r in results}))
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        self.written.append(dcp.METADATA_FILE)  # the coordinator's alone


class _HashingWriter(_StagedWriter):
    """DCP's file writer that hashes each replica's files and hands rank 0 all the records.

    Each replica hashes what it wrote on its own (DCP's writing thread) and adds
    the records to its write results, which DCP gathers to its coordinator for
    :meth:`finish`; there they are taken out again, and :attr:`records` holds
    every replica's (the metadata file's included). Elsewhere it stays None.
    """

    def __init__(self, staged: StagedFiles) -> None:
        super().__init__(staged)
        self.records: dict[str, FileRecord] | None = None

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()  # written before it returns
        mine = {}
        for name in sorted({r.storage_data.relative_path for r in results}):
            record = self.staged.record(name)
            mine[name] = (record.size, record.sha256)
        marker = WriteResult(MetadataIndex(_RECORDS), 0, mine)
        future: Future[list[WriteResult]] = Future()
        future.set_result([*results, marker])
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        records: dict[str, FileRecord] = {}
        kept = []
        for part in results:
            kept.append([r for r in part if r.index.fqn != _RECORDS])
            for r in part:
                if r.index.fqn == _RECORDS:
                    records.update({n: FileRecord(*v) for n, v in r.storage_data.items()})
        super().finish(metadata, kept)
        records[dcp.METADATA_FILE] = self.staged.record(dcp.METADATA_FILE)
        self.records = records


@attrs.define(eq=False)
class ShardedState:
    """``model`` (sharded by ``fully_shard``, or any module) and ``optimizer`` saved with DCP.

    The state dicts come from ``torch.distributed.checkpoint.state_dict``
    (``get_state_dict``/``set_state_dict``), which keep each tensor sharded as
    it is and name optimiser state by parameter name, so a restore at another
    world size reshards both. ``plain`` is entered around them: they may step the
    optimiser (with zero gradients) to create its state, which the adaptive
    wrapper must not take for a training step.
    """

    _name: str = attrs.field(alias="name")
    _model: torch.nn.Module = attrs.field(alias="model")
    _optimizer: torch.optim.Optimizer = attrs.field(alias="optimizer")
    _plain: Callable[[], AbstractContextManager[None]] = attrs.field(
        default=contextlib.nullcontext, alias="plain"
    )

    @property
    def name(self) -> str:
        return self._name

    def to_bytes(self) -> bytes:
        return json.dumps({"format": _FORMAT}).encode("ascii")

    def from_bytes(self, data: bytes) -> None:
        try:
            described = json.loads(data)
        except ValueError:
            described = None
        if not isinstance(described, dict) or described.get("format") != _FORMAT:
            raise CheckpointError(f"state {self._name!r}: not a {_FORMAT!r} description")

    def _state_dict(self) -> dict[str, Any]:
        with self._plain():  # its zero-gradient step is no training step
            model, optim = get_state_dict(self._model, self._optimizer)
        return {"model": model, "optim": optim}

    def write_files(self, directory: StagedFiles) -> list[str]:
        """Collective: DCP-save this replica's shards into ``directory``; their names."""
        writer = _RecordingWriter(directory)
        dcp_save(self._state_dict(), storage_writer=writer)
        return writer.written

    def read_files(self, directory: Path) -> None:
        """Collective: load the shards in ``directory`` into the model and optimiser."""
        state = self._state_dict()
        dcp.load(state, directory)
        try:
            with self._plain():
                set_state_dict(
                    self._model,
                    self._optimizer,
                    model_state_dict=state["model"],
                    optim_state_dict=state["optim"],
                )
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(
                f"state {self._name!r}: the saved model and optimiser do not fit these "
                f"({type(exc).__name__}: {exc}); construct the same model and optimiser as "
                "the run that saved the checkpoint"
            ) from exc


@attrs.define(eq=False)
class AsyncShardedState(ShardedState):
    """A `ShardedState` written in the background.

    It writes through an `adaptdl.core.persist.shardedfiles.AsyncFileState`.

    The shards are copied aside in host memory when the checkpoint is taken (so
    the replica holds a second copy of its shards until they are written), then
    written by a thread that talks to the other replicas over a process group of
    its own, made at the first checkpoint (every replica takes part). That group
    waits for a peer no longer than ``timeout``, the job's collective timeout
    (`adaptdl.torch.collective.collective_timeout` of its `Job.config`), so that a
    write whose peer died fails, and the process can exit, rather than wait behind
    it for torch's default half hour.
    """

    _timeout: timedelta = attrs.field(
        kw_only=True, alias="timeout", validator=attrs.validators.instance_of(timedelta)
    )
    _group: Any = attrs.field(default=None, init=False)

    def start_files(
        self, directory: StagedFiles
    ) -> ConcurrentFuture[Mapping[str, FileRecord] | None]:
        """Collective: copy this replica's shards aside and write them in the background."""
        if self._group is None:
            # Its own group: the writing thread's collectives never meet the training's.
            self._group = dist.new_group(backend="gloo", timeout=self._timeout)
        writer = _HashingWriter(directory)
        upload = async_save(self._state_dict(), storage_writer=writer, process_group=self._group)
        if not isinstance(upload, ConcurrentFuture):  # a torch whose async_save changed
            raise TypeError(
                f"async_save returned {type(upload).__name__}, not a concurrent.futures.Future"
            )
        out: ConcurrentFuture[Mapping[str, FileRecord] | None] = ConcurrentFuture()
        # The records are the writer's once the upload is done (on rank 0; None elsewhere).
        upload.add_done_callback(
            lambda done: (
                out.set_result(writer.records)
                if done.exception() is None
                else out.set_exception(done.exception())
            )
        )
        return out
