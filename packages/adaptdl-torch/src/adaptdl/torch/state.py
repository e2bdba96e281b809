"""Torch objects as a checkpoint `State`: state dicts saved with ``torch.save``, loaded safely.

Loading uses ``torch.load(..., weights_only=True)``, which accepts tensors and
plain containers only, so a checkpoint cannot run code when it is read.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from adaptdl.core.checkpoint import CheckpointError

__all__ = ["StateDictState"]


class _HasStateDict(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


class StateDictState:
    """A checkpoint entry holding the state dicts of several torch objects by key.

    ``objects`` maps a key (``"model"``, ``"optimizer"``, ...) to anything with
    ``state_dict()``/``load_state_dict()``; None values are skipped.
    """

    def __init__(self, name: str, objects: Mapping[str, _HasStateDict | None]) -> None:
        self._name = name
        self._objects = {k: v for k, v in objects.items() if v is not None}

    @property
    def name(self) -> str:
        return self._name

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        torch.save({k: v.state_dict() for k, v in self._objects.items()}, buffer)
        return buffer.getvalue()

    def from_bytes(self, data: bytes) -> None:
        try:
            saved = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises several kinds for unsafe or damaged data
            raise CheckpointError(
                f"state {self._name!r}: cannot load torch state with weights_only=True ({exc})"
            ) from exc
        if not isinstance(saved, dict):
            raise CheckpointError(f"state {self._name!r}: saved data is not a dict of state dicts")
        missing = sorted(set(self._objects) - set(saved))
        if missing:
            raise CheckpointError(
                f"state {self._name!r}: the checkpoint has no state for {missing} (it holds "
                f"{sorted(saved)}); construct the same objects as the run that saved it"
            )
        for key, obj in self._objects.items():
            try:
                obj.load_state_dict(saved[key])
            except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as exc:
                # torch's own message lists the mismatched parameters and shapes.
                raise CheckpointError(
                    f"state {self._name!r}: the saved {key} does not fit this {key} "
                    f"({type(exc).__name__}: {exc}); construct the same {key} as the run "
                    "that saved the checkpoint"
                ) from exc
