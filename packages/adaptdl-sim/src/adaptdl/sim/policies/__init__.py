"""Scheduling policies (``adaptdl``, ``pollux``, ``tiresias``, ``optimus``, ``fifo``), base API."""

from __future__ import annotations

from adaptdl.sim.policies.adaptdl import AdaptDLPolicy
from adaptdl.sim.policies.base import Allocation, ClusterState, Policy, greedy_allocate, pack
from adaptdl.sim.policies.fifo import FifoPolicy
from adaptdl.sim.policies.optimus import OptimusPolicy
from adaptdl.sim.policies.pollux import PolluxPolicy
from adaptdl.sim.policies.tiresias import TiresiasPolicy

POLICIES = ("pollux", "tiresias", "optimus", "fifo", "adaptdl")


def make_policy(name: str) -> Policy:
    """Return a fresh built-in policy by name."""
    if name == "adaptdl":
        return AdaptDLPolicy()
    if name == "pollux":
        return PolluxPolicy()
    if name == "tiresias":
        return TiresiasPolicy()
    if name == "optimus":
        return OptimusPolicy()
    if name == "fifo":
        return FifoPolicy()
    raise ValueError(f"unknown policy {name!r}; choose from {list(POLICIES)}")


__all__ = [
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
