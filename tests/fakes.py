"""Test doubles shared by the test suite: one definition each, imported as ``tests.fakes``."""

from __future__ import annotations


class ManualClock:
    """A clock the test moves: ``now`` by hand, and ``tick`` more at every reading."""

    def __init__(self, tick: float = 0.0) -> None:
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


class FakeWriter:
    """Records add_scalar calls like a TensorBoard SummaryWriter."""

    def __init__(self) -> None:
        self.scalars: dict[str, tuple[float, int]] = {}

    def add_scalar(self, tag: str, value: float, global_step: int) -> None:
        self.scalars[tag] = (float(value), global_step)
