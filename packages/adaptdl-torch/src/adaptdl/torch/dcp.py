"""Reading torch's distributed checkpoints (DCP) without running code from them.

DCP writes its ``.metadata`` file with :mod:`pickle` and reads it back with
``pickle.load``; the values of a state dict that are not tensors (an optimiser's
learning rate, a step count kept as a number) it reads with
``torch.load(weights_only=False)``. Either runs whatever code a crafted file asks
for. Here both are replaced:

* :func:`read_metadata` unpickles ``.metadata`` with :class:`MetadataUnpickler`,
  which admits only DCP's own metadata classes and the few torch and standard
  types they hold (:data:`ALLOWED_GLOBALS`), and refuses anything else with a
  :class:`~adaptdl.core.persist.checkpoint.CheckpointError` naming the file and the
  global, before it is called;
* :class:`SafeFileSystemReader` is DCP's file reader with that metadata reading;
* :class:`SafeLoadPlanner` is DCP's default load planner with every non-tensor
  value read by ``torch.load(weights_only=True)``. (DCP already reads tensors so.)

:func:`load` is ``torch.distributed.checkpoint.load`` with both.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from adaptdl.core.persist.checkpoint import CheckpointError
from adaptdl.core.persist.localfs import open_regular
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

__all__ = [
    "ALLOWED_GLOBALS",
    "MAX_METADATA_BYTES",
    "METADATA_FILE",
    "MetadataUnpickler",
    "RefusedGlobal",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "load",
    "read_metadata",
]

METADATA_FILE = ".metadata"
"""The name DCP gives its metadata file."""

MAX_METADATA_BYTES = 1 << 28
"""A metadata file longer than this (256 MiB) is refused unread."""

_DCP = "torch.distributed.checkpoint"

ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        # DCP's metadata dataclasses and enum (torch/distributed/checkpoint/metadata.py).
        (f"{_DCP}.metadata", "Metadata"),
        (f"{_DCP}.metadata", "TensorStorageMetadata"),
        (f"{_DCP}.metadata", "BytesStorageMetadata"),
        (f"{_DCP}.metadata", "ChunkStorageMetadata"),
        (f"{_DCP}.metadata", "TensorProperties"),
        (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"),
        (f"{_DCP}.metadata", "StorageMeta"),
        (f"{_DCP}.metadata", "MetadataIndex"),
        # Where each item lies in the data files (filesystem.py).
        (f"{_DCP}.filesystem", "_StorageInfo"),
        # Shapes and layouts: constructors of plain values, no effects.
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        # StorageMeta.checkpoint_id is the path it was saved to: a pure path object.
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib._local", "PosixPath"),
        ("pathlib._local", "PurePosixPath"),
    }
)
"""The ``(module, name)`` globals a DCP metadata file may name, besides torch's dtypes."""

_DTYPES = frozenset(name for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype))


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle named a global that :class:`MetadataUnpickler` does not admit."""


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only :data:`ALLOWED_GLOBALS` and torch's dtypes.

    Any other global (``os.system``, ``builtins.eval``, a class with a
    ``__reduce__``) raises :class:`RefusedGlobal` naming it, before anything is
    called; persistent ids raise :class:`pickle.UnpicklingError`.
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        raise RefusedGlobal(f"refused global {module}.{name}")


def read_metadata(path: str | os.PathLike[str]) -> Metadata:
    """The DCP metadata in file ``path`` (``<checkpoint>/.metadata``), read without running code.

    Raises CheckpointError naming the file when it is not a regular file, is
    larger than :data:`MAX_METADATA_BYTES`, names a global outside
    :data:`ALLOWED_GLOBALS` (the global is named), or does not hold a ``Metadata``.
    """
    path = Path(path)
    try:
        fd = open_regular(path, os.O_RDONLY)
        with os.fdopen(fd, "rb") as file:
            data = file.read(MAX_METADATA_BYTES + 1)
    except OSError as exc:
        raise CheckpointError(f"DCP metadata '{path}' is missing or unreadable ({exc})") from None
    if len(data) > MAX_METADATA_BYTES:
        raise CheckpointError(f"DCP metadata '{path}' is larger than {MAX_METADATA_BYTES} bytes")
    try:
        metadata = MetadataUnpickler(io.BytesIO(data)).load()
    except RefusedGlobal as exc:
        raise CheckpointError(
            f"DCP metadata '{path}' was refused: {exc}; a DCP metadata file holds only DCP's "
            "own metadata types, so this one is damaged or crafted to run code. Remove it."
        ) from None
    except Exception as exc:  # truncated or malformed: pickle raises many kinds
        raise CheckpointError(
            f"DCP metadata '{path}' cannot be read ({type(exc).__name__}: {exc})"
        ) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(
            f"DCP metadata '{path}' holds a {type(metadata).__name__}, not DCP's Metadata"
        )
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader whose metadata is read by :func:`read_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        metadata = read_metadata(self._get_metadata_path(rank))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as exc:  # torch raises several kinds for unsafe or damaged data
            raise CheckpointError(
                f"DCP value {read_item.dest_index.fqn!r} cannot be loaded with "
                f"weights_only=True ({exc})"
            ) from exc
        # What DefaultLoadPlanner.load_bytes does after its own (unsafe) torch.load.
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def load(state_dict: dict[str, Any], directory: str | os.PathLike[str]) -> None:
    """``torch.distributed.checkpoint.load`` of ``directory`` into ``state_dict``, safely.

    Collective over the default process group. The metadata is read first by
    :func:`read_metadata`, so a refused file raises CheckpointError on every
    replica before DCP starts.
    """
    read_metadata(Path(directory) / METADATA_FILE)
    dcp_load(
        state_dict,
        storage_reader=SafeFileSystemReader(directory),
        planner=SafeLoadPlanner(),
    )
