"""Torch objects as a checkpoint `State`: state dicts saved with ``torch.save``, loaded safely.

Loading uses ``torch.load(..., weights_only=True)``, which accepts tensors and
plain containers only, so a checkpoint cannot run code when it is read.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from adaptdl.core.persist.checkpoint import CheckpointError
from adaptdl.torch._context import current_job

__all__ = ["StateDictState", "register_state"]


class _HasStateDict(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


class StateDictState:
    """A checkpoint entry holding the state dicts of several torch objects by key.

    ``objects`` maps a key (``"model"``, ``"optimizer"``, ...) to anything with
    ``state_dict()``/``load_state_dict()``; None values are skipped.
    """

    def __init__(
        self, name: str, objects: Mapping[str, _HasStateDict | None], *, check: bool = False
    ) -> None:
        self._name = name
        self._objects = {k: v for k, v in objects.items() if v is not None}
        self._check = check

    @property
    def name(self) -> str:
        return self._name

    def to_bytes(self) -> bytes:
        states = {k: v.state_dict() for k, v in self._objects.items()}
        if self._check:
            for key, value in states.items():
                _check_loadable(value, f"{self._name}: {key}.state_dict()")
        buffer = io.BytesIO()
        torch.save(states, buffer)
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


_PLAIN = (type(None), bool, int, float, str, torch.Tensor, torch.dtype, torch.device, torch.Size)


def _check_loadable(value: Any, where: str, depth: int = 0) -> None:
    """TypeError unless ``value`` is JSON-like data and tensors (what loads with weights_only)."""
    if depth > 100:
        raise TypeError(f"{where} nests deeper than 100 levels")
    if isinstance(value, _PLAIN):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                kind = type(key).__name__
                raise TypeError(f"{where} has a key {key!r} ({kind}): use str or int")
            _check_loadable(item, f"{where}[{key!r}]", depth + 1)
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_loadable(item, f"{where}[{index}]", depth + 1)
        return
    raise TypeError(
        f"{where} holds {value!r:.60} ({type(value).__name__}): a checkpointed state may hold "
        "only None, bool, int, float, str, tensors and lists, tuples and dicts of them "
        "(the checkpoint is never unpickled)"
    )


def register_state(name: str, obj: _HasStateDict) -> None:
    """Put ``obj`` (anything with ``state_dict()``/``load_state_dict()``) in the job's checkpoint.

    Its state is saved with every checkpoint under ``name`` and, when the job resumes
    from a checkpoint that holds it, loaded into ``obj`` now. A state dict may hold
    only None, bool, int, float, str, tensors and lists, tuples and dicts of them:
    anything else is a TypeError when the checkpoint is written, since loading it
    back would need pickle. Raises ValueError when ``name`` is taken (every
    replica must register the same names in the same order), TypeError when ``obj``
    lacks the two methods.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    for method in ("state_dict", "load_state_dict"):
        if not callable(getattr(obj, method, None)):
            raise TypeError(
                f"register_state({name!r}, ...) needs an object with state_dict() and "
                f"load_state_dict(), got {type(obj).__name__} without {method}()"
            )
    current_job().register(StateDictState(name, {"state": obj}, check=True))
