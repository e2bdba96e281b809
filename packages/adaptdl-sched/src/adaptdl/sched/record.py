"""One live job as the scheduler keeps it: what was submitted, where it runs, how it
went; plain data that round-trips through JSON (the scheduler's persisted state)."""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from adaptdl.core.decide.hints import validate_hints
from adaptdl.core.validate import check_float, check_int

#: A job name: what ``adaptdl submit --name`` accepts (it names directories and actors).
NAME_PATTERN = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")


class Status(enum.Enum):
    """A job's status, as ``adaptdl ls`` shows it."""

    #: Waiting for GPUs (never started, or suspended by a round, or restarting).
    PENDING = "Pending"
    #: Its replicas run.
    RUNNING = "Running"
    #: Its replicas were asked to stop, to be relaunched at another placement.
    RESIZING = "Resizing"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    #: Stopped by its user (checkpointed first).
    STOPPED = "Stopped"

    @property
    def done(self) -> bool:
        """Whether the job will never run again."""
        return self in (Status.SUCCEEDED, Status.FAILED, Status.STOPPED)


def check_name(name: str) -> str:
    """Return ``name`` if it is a valid job name, else raise ValueError naming it."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ValueError(
            f"job name {name!r}: use 1-63 lower-case letters, digits and '-', "
            "starting and ending with a letter or digit"
        )
    return name


def _check_env(env: Mapping[str, str]) -> dict[str, str]:
    out = {}
    for key, value in env.items():
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ValueError(f"env: {key!r} is not a variable name")
        if not isinstance(value, str):
            raise ValueError(f"env: {key}={value!r} is not a string")
        out[key] = value
    return out


@attrs.define
class JobSpec:
    """What a user submitted: the command every replica runs, and its bounds."""

    name: str = attrs.field(converter=check_name)
    command: tuple[str, ...] = attrs.field(converter=tuple)
    min_replicas: int = 1
    max_replicas: int = 1
    cpus_per_replica: float = 1.0
    env: dict[str, str] = attrs.field(factory=dict, converter=_check_env)
    max_failures: int = 3

    def __attrs_post_init__(self) -> None:
        if not self.command or not all(isinstance(c, str) and c for c in self.command):
            raise ValueError(f"command {list(self.command)!r}: give a program and its arguments")
        check_int("min_replicas", self.min_replicas, min=1)
        check_int("max_replicas", self.max_replicas, min=1)
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas={self.min_replicas} is above max_replicas={self.max_replicas}"
            )
        check_float("cpus_per_replica", self.cpus_per_replica, min=0.0, min_exclusive=True)
        check_int("max_failures", self.max_failures, min=0)


@attrs.define
class JobRecord:
    """A submitted job and everything the scheduler knows of it (times in Unix seconds).

    ``node_ids`` is its placement: the Ray node (or other backend's) id of each
    replica's GPU, by rank. ``target`` is the placement a resize is moving it to.
    ``launch`` counts its launches (it names each launch's replicas).
    """

    spec: JobSpec
    submit: float
    checkpoint_path: str
    share_path: str
    log_dir: str
    status: Status = Status.PENDING
    node_ids: list[str] = attrs.field(factory=list)
    target: list[str] | None = None
    started: float | None = None
    finished: float | None = None
    restarts: int = 0
    failures: int = 0
    launch: int = 0
    #: When the current stop was asked (None: no stop in progress).
    stop_requested: float | None = None
    #: Why: "resize", "stop" (its user) or "failure".
    stop_reason: str | None = None
    #: When the job was (re)launched at its current placement, waiting for its first step.
    launched: float | None = None
    #: Restart costs measured (seconds, stop requested to first step at the new size).
    restart_costs: list[float] = attrs.field(factory=list)
    hints: dict[str, Any] | None = None
    batch_size: int | None = None
    speedup: float | None = None
    attained_service: float = 0.0
    run_time: float = 0.0
    #: When accounting (service, run time) was last brought up to date.
    accounted: float | None = None
    message: str = ""

    @property
    def name(self) -> str:
        return self.spec.name

    def measured_restart_cost(self, default: float) -> float:
        """The median of the measured restart costs (``default`` before any)."""
        if not self.restart_costs:
            return default
        costs = sorted(self.restart_costs)
        mid = len(costs) // 2
        return costs[mid] if len(costs) % 2 else (costs[mid - 1] + costs[mid]) / 2

    def account(self, now: float) -> None:
        """Add the GPU time held since the last call."""
        if self.accounted is not None and self.node_ids and now > self.accounted:
            dt = now - self.accounted
            self.attained_service += dt * len(self.node_ids)
            self.run_time += dt
        self.accounted = now

    def row(self) -> dict[str, Any]:
        """What ``adaptdl ls --json`` shows of the job (snake-case keys)."""
        return {
            "name": self.name,
            "status": self.status.value,
            "replicas": len(self.node_ids),
            "nodes": len(set(self.node_ids)),
            "batch_size": self.batch_size,
            "speedup": self.speedup,
            "restarts": self.restarts,
            "submitted": self.submit,
            "started": self.started,
            "finished": self.finished,
        }

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (:meth:`from_dict` reads it back)."""
        data = attrs.asdict(self, recurse=True, value_serializer=_serialize)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobRecord:
        """Read :meth:`to_dict`'s output back, checking it."""
        fields = dict(data)
        spec = JobSpec(**fields.pop("spec"))
        status = Status(fields.pop("status"))
        hints = fields.pop("hints")
        if hints is not None:
            hints = validate_hints(hints)
        return cls(spec=spec, status=status, hints=hints, **fields)


def _serialize(instance: Any, field: Any, value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    return value


def node_indices(node_ids: Sequence[str], order: Sequence[str]) -> list[int]:
    """Each id's index in ``order`` (the round's node numbering); unknown ids are -1."""
    index = {n: i for i, n in enumerate(order)}
    return [index.get(n, -1) for n in node_ids]
