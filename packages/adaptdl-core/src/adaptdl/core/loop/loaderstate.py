"""What a loader persists across restarts (`LoaderState`) and the checks of its settings."""

from __future__ import annotations

from typing import Any

from adaptdl.core.persist.checkpoint import JsonState
from adaptdl.core.validate import check_int

__all__ = ["LoaderState", "check_local_bsz_bounds"]


class LoaderState(JsonState):
    """What a loader persists across restarts."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.current_index = 0
        self.end_index = 0
        # epoch -> position (0, 1, ...) of the last loop that finished in that epoch;
        # None: loops run outside epoch loops.
        self.last_position: dict[int | None, int] = {}
        self.current_local_bsz = 0
        self.accumulation_steps = 0
        # The replicas the last decision was made for (0: none yet): a restart on
        # others changes the total, which the lifecycle then reports.
        self.num_replicas = 0
        self.dataset_len = 0  # of the newest loop; 0 before the first

    def to_json(self) -> dict[str, Any]:
        return {
            "dataset_len": self.dataset_len,
            "current_index": self.current_index,
            "end_index": self.end_index,
            "last_position": {_epoch_key(k): v for k, v in self.last_position.items()},
            "current_local_bsz": self.current_local_bsz,
            "accumulation_steps": self.accumulation_steps,
            "num_replicas": self.num_replicas,
        }

    def load_json(self, data: dict[str, Any]) -> None:
        self.current_index = check_int("current_index", data["current_index"], min=0)
        self.end_index = check_int("end_index", data["end_index"], min=0)
        self.last_position = {
            _key_epoch(k): check_int("last_position", v, min=0)
            for k, v in data["last_position"].items()
        }
        self.current_local_bsz = check_int("current_local_bsz", data["current_local_bsz"], min=0)
        self.accumulation_steps = check_int(
            "accumulation_steps", data["accumulation_steps"], min=0
        )
        # Absent from checkpoints written before they were recorded.
        self.dataset_len = check_int("dataset_len", data.get("dataset_len", 0), min=0)
        self.num_replicas = check_int("num_replicas", data.get("num_replicas", 0), min=0)


_NO_EPOCH = "none"  # the JSON key of loops run outside epoch loops


def _epoch_key(epoch: int | None) -> str:
    return _NO_EPOCH if epoch is None else str(epoch)


def _key_epoch(key: str) -> int | None:
    return None if key == _NO_EPOCH else check_int("last_position epoch", int(key), min=0)


def check_local_bsz_bounds(
    bounds: tuple[int | None, int | None] | None, batch_size: int
) -> tuple[int | None, int | None] | None:
    """``bounds`` checked as ``local_bsz_bounds`` for target ``batch_size``; ValueError if bad."""
    if bounds is None:
        return None
    if not isinstance(bounds, (tuple, list)) or len(bounds) != 2:
        raise ValueError(f"local_bsz_bounds must be a pair (min, max), got {bounds!r}")
    lo, hi = bounds
    for label, value in (("min", lo), ("max", hi)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(
                f"local_bsz_bounds {label} must be None or an int >= 1, got {bounds!r}"
            )
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"local_bsz_bounds must have min <= max, got {bounds!r}")
    if lo is not None and lo > batch_size:
        raise ValueError(
            f"local_bsz_bounds min must be <= batch_size={batch_size}, got {bounds!r}"
        )
    if hi is not None and hi < batch_size:
        raise ValueError(
            f"local_bsz_bounds max must be >= batch_size={batch_size}, got {bounds!r}"
        )
    return (lo, hi)
