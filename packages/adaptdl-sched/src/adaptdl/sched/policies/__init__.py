"""Scheduling policies: ``pollux``, ``tiresias``, ``optimus``, ``fifo``, AdaptDL's own
``adaptdl``, and the base API.

A new policy is one module in this package (see ``adaptdl.sched.policies.base``) and
one entry in ``_FACTORIES`` below.
"""

from __future__ import annotations

from collections.abc import Callable

from adaptdl.sched.policies.adaptdl import AdaptDLPolicy
from adaptdl.sched.policies.base import Allocation, Policy, greedy_allocate, pack
from adaptdl.sched.policies.fifo import FifoPolicy
from adaptdl.sched.policies.optimus import OptimusPolicy
from adaptdl.sched.policies.pollux import PolluxPolicy
from adaptdl.sched.policies.tiresias import TiresiasPolicy
from adaptdl.sched.view import ClusterState

_FACTORIES: dict[str, Callable[[], Policy]] = {
    "pollux": PolluxPolicy,
    "tiresias": TiresiasPolicy,
    "optimus": OptimusPolicy,
    "fifo": FifoPolicy,
    "adaptdl": AdaptDLPolicy,
}

#: Every built-in policy's name, in the order the simulator compares them.
POLICIES = tuple(_FACTORIES)
#: The policies a live scheduler can run: those that need no oracle of the jobs' speed.
LIVE_POLICIES = tuple(p for p in POLICIES if p != "optimus")
#: What a live scheduler runs unless told otherwise (`Scheduler` and `adaptdl scheduler
#: start` alike): our own policy.
DEFAULT_POLICY = "adaptdl"


def make_policy(name: str) -> Policy:
    """Return a fresh built-in policy by name (one of :data:`POLICIES`)."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown policy {name!r}; choose from {list(POLICIES)}")
    return factory()


__all__ = [
    "DEFAULT_POLICY",
    "LIVE_POLICIES",
    "POLICIES",
    "AdaptDLPolicy",
    "Allocation",
    "ClusterState",
    "FifoPolicy",
    "OptimusPolicy",
    "Policy",
    "PolluxPolicy",
    "TiresiasPolicy",
    "greedy_allocate",
    "make_policy",
    "pack",
]
