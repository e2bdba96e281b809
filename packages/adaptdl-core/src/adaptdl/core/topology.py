"""Where this process stands in the job: rank, replicas, nodes, restarts.

An immutable value; :class:`~adaptdl.core.config.JobConfig` reads it from the
environment (and documents which variable wins when several name the same thing).
"""

from __future__ import annotations

import attrs

from adaptdl.core.validate import int_in


@attrs.frozen
class Topology:
    """This process's place in the job.

    ``num_nodes`` defaults to ``ceil(num_replicas / local_world_size)`` when no
    variable names it.
    """

    rank: int = attrs.field(default=0, validator=int_in(min=0))
    num_replicas: int = attrs.field(default=1, validator=int_in(min=1))
    num_nodes: int = attrs.field(default=1, validator=int_in(min=1))
    num_restarts: int = attrs.field(default=0, validator=int_in(min=0))
    local_world_size: int = attrs.field(default=1, validator=int_in(min=1))

    def __attrs_post_init__(self) -> None:
        if self.rank >= self.num_replicas:
            raise ValueError(
                f"rank must be in [0, num_replicas={self.num_replicas}), got {self.rank}"
            )
        if self.num_nodes > self.num_replicas:
            raise ValueError(
                f"num_nodes must be <= num_replicas={self.num_replicas}, got {self.num_nodes}"
            )
