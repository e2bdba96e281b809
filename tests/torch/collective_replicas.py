"""Run by test_torch_collective under torchrun: every collective, checked on every replica."""

from __future__ import annotations

import json
import os
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

import torch
from adaptdl.core.collective import CollectiveError, logical_or, maximum
from adaptdl.core.config import JobConfig
from adaptdl.torch.collective import TorchCollective, collective_timeout

timeout = collective_timeout(JobConfig.from_env())  # no job here: the environment's
dist.init_process_group("gloo", timeout=timeout)
c = TorchCollective(dist.new_group(backend="gloo", timeout=timeout))
r, n = c.rank, c.num_replicas
big = "x" * 5000
results = {
    "rank": r,
    "broadcast": c.broadcast({"from": r}),
    "broadcast_big_from_last": c.broadcast([big, r] if r == n - 1 else None, root=n - 1)[1],
    "allgather": c.allgather([r, "y" * (400 * r)]),
    "sum": c.allreduce(r + 1),
    "max": c.allreduce(float(r), maximum),
    "tuple_arrives_as_list": c.allreduce((r, 1)),
}
flag = c.allreduce_async(r == n - 1, logical_or)
# Larger than a slot on rank 0 only; the fold keeps the longer string.
large = c.allreduce_async(
    [big] if r == 0 else [""], lambda a, b: a if len(a[0]) >= len(b[0]) else b
)
# Flat ints reduced by their maximum travel as one int64 all_reduce: the fold's result.
ints = c.allreduce_async([r, 5 - r, -(2**62) + r, 0], maximum)
mixed = c.allreduce_async([r, 1.5], maximum)  # not all ints: the JSON path
c.barrier()
results["int_max"] = [ints.result(), ints.result()]
results["mixed_max"] = mixed.result()
results["async_or"] = [flag.result(), flag.result()]
results["async_large"] = len(large.result()[0])

# Every operation returns only once gloo's worker thread has let go of the tensors it
# was handed (a program ending right after one would otherwise abort in the
# interpreter's finalization): those tensors are freed as soon as the operation returns.
handed: list[weakref.ref[torch.Tensor]] = []


def spy(fn: Callable[..., Any]) -> Callable[..., Any]:
    def handing(*args: Any, **kwargs: Any) -> Any:
        for arg in args:
            for t in arg if isinstance(arg, list) else [arg]:
                if isinstance(t, torch.Tensor):
                    handed.append(weakref.ref(t))
        return fn(*args, **kwargs)

    return handing


originals = dist.all_gather, dist.broadcast, dist.all_reduce
dist.all_gather, dist.broadcast = spy(dist.all_gather), spy(dist.broadcast)
dist.all_reduce = spy(dist.all_reduce)
held = 0
for i in range(50):
    handed.clear()
    if i % 5 == 0:
        c.allreduce(i)
    elif i % 5 == 1:
        c.broadcast(big if r == 0 else None)
    elif i % 5 == 2:
        c.allgather("z" * (300 * r))
    elif i % 5 == 3:
        c.allreduce_async([r, i], maximum).result()
    else:
        c.allreduce_async(r).result()
    held += sum(ref() is not None for ref in handed)
dist.all_gather, dist.broadcast, dist.all_reduce = originals
results["held_after_return"] = held

# A peer that never joins: the others time out instead of hanging.
if r != 0:
    try:
        c.allreduce(1)
        results["timeout"] = "no error"
    except CollectiveError as exc:
        results["timeout"] = type(exc).__name__
    # What a failure raises is the job's to say (a stopping replica exits instead).
    c.failed = lambda error: SystemExit(f"stopping after {type(error).__name__}")
    try:
        c.broadcast(1)
        results["failed_hook"] = "no error"
    except SystemExit as exc:
        results["failed_hook"] = str(exc.code)
with open(os.path.join(sys.argv[1], f"rank{r}.json"), "w", encoding="utf-8") as out:
    json.dump(results, out)
if r == 0:
    time.sleep(9)  # alive but absent from the last two operations: the others time out
os._exit(0)
