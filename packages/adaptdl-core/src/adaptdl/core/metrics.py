"""The job's training metrics as one checkpointed state: gradient noise and step timings."""

from __future__ import annotations

from typing import Any

from adaptdl.core.checkpoint import JsonState
from adaptdl.core.gns import GradientNoiseScale
from adaptdl.core.goodput import GradParams
from adaptdl.core.profiler import Profiler


class MetricsState(JsonState):
    """Holds the job's `GradientNoiseScale` (once a training loader exists) and `Profiler`."""

    def __init__(self, name: str = "adaptdl-metrics") -> None:
        self.name = name
        self.gns: GradientNoiseScale | None = None
        self.profiler = Profiler()

    def ensure_gns(self, init_batch_size: int, num_groups: int = 1) -> GradientNoiseScale:
        """The gradient-noise estimator for this shape, made anew (keeping progress) if needed."""
        gns = self.gns
        if gns is None or (gns.init_batch_size, gns.num_groups) != (init_batch_size, num_groups):
            progress = gns.progress if gns is not None else 0.0
            gns = GradientNoiseScale(init_batch_size=init_batch_size, num_groups=num_groups)
            gns.progress = progress
            self.gns = gns
        return gns

    @property
    def progress(self) -> float:
        return self.gns.progress if self.gns is not None else 0.0

    def grad_params(self) -> GradParams | None:
        return self.gns.grad_params() if self.gns is not None else None

    def to_json(self) -> dict[str, Any]:
        return {
            "gns": self.gns.to_json() if self.gns is not None else None,
            "profiler": self.profiler.to_json(),
        }

    def load_json(self, data: dict[str, Any]) -> None:
        gns = data["gns"]
        self.gns = GradientNoiseScale.from_json(gns) if gns is not None else None
        self.profiler = Profiler.from_json(data["profiler"])
