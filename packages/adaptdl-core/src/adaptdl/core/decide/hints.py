"""The scheduling hints: the versioned JSON document a scheduler reads to decide a
job's resources (:func:`hints`), its validation, and the goodput model it describes.

Plain data: core reads and writes no files (``adaptdl.torch.hints`` stores them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adaptdl.core.goodput import GoodputFunction, GradParams, PerfParams
from adaptdl.core.stats.profiler import Profiler
from adaptdl.core.validate import ArgumentTypeError, check_flag, check_int, check_keys

#: Schema tag of the scheduling hints (:func:`hints`).
HINTS_SCHEMA = "adaptdl.hints/1"


#: The keys of a hints document, in order.
HINTS_KEYS = (
    "schema",
    "perf_params",
    "grad_params",
    "init_batch_size",
    "max_batch_size",
    "local_bsz_bounds",
    "gradient_accumulation",
    "max_profiled_replicas",
    "max_profiled_nodes",
)


def hints(
    profiler: Profiler,
    grad_params: GradParams | None,
    init_batch_size: int,
    max_batch_size: int | None = None,
    local_bsz_bounds: tuple[int | None, int | None] | None = None,
    gradient_accumulation: bool = False,
) -> dict[str, Any]:
    """Return the job's scheduling hints, schema ``adaptdl.hints/1``.

    A JSON-ready dict with exactly these keys:

    * ``schema``: ``"adaptdl.hints/1"``;
    * ``perf_params``: ``PerfParams.to_dict()`` of the current fit, or null before
      a configuration holds `timings.FIT_AFTER` optimiser steps;
    * ``grad_params``: ``GradParams.to_dict()`` (variance at the initial batch
      size), or null before any estimate;
    * ``init_batch_size``: int >= 1;
    * ``max_batch_size``: int >= ``init_batch_size``, or null (batch size fixed);
    * ``local_bsz_bounds``: ``[min, max]`` per-replica batch bounds, each an int >= 1
      or null (unbounded), min <= max; or null for no bounds;
    * ``gradient_accumulation``: bool, whether the job may accumulate gradients;
    * ``max_profiled_replicas``, ``max_profiled_nodes``: the largest configuration
      the profile covers, ints >= 0.
    """
    if not isinstance(profiler, Profiler):
        raise ArgumentTypeError(f"profiler must be a Profiler, got {type(profiler).__name__}")
    if grad_params is not None and not isinstance(grad_params, GradParams):
        raise ArgumentTypeError(f"grad_params must be a GradParams or None, got {grad_params!r}")
    perf = profiler.perf_params()
    bounds = None if local_bsz_bounds is None else list(local_bsz_bounds)
    return validate_hints(
        {
            "schema": HINTS_SCHEMA,
            "perf_params": perf.to_dict() if perf is not None else None,
            "grad_params": grad_params.to_dict() if grad_params is not None else None,
            "init_batch_size": init_batch_size,
            "max_batch_size": max_batch_size,
            "local_bsz_bounds": bounds,
            "gradient_accumulation": gradient_accumulation,
            "max_profiled_replicas": profiler.max_profiled_replicas,
            "max_profiled_nodes": profiler.max_profiled_nodes,
        }
    )


def _optional_int(name: str, value: Any, min: int) -> int | None:
    return None if value is None else check_int(name, value, min=min)


def validate_hints(data: Any) -> dict[str, Any]:
    """Check a hints document against schema ``adaptdl.hints/1``; return a normalised copy.

    Raises ValueError (or ArgumentTypeError) naming the offending key.
    """
    if not isinstance(data, Mapping):
        raise ArgumentTypeError(f"hints must be a mapping, got {type(data).__name__}")
    if data.get("schema") != HINTS_SCHEMA:
        raise ValueError(f"hints schema must be {HINTS_SCHEMA!r}, got {data.get('schema')!r}")
    data = check_keys("hints", data, HINTS_KEYS)
    perf = data["perf_params"]
    grad = data["grad_params"]
    init = check_int("init_batch_size", data["init_batch_size"], min=1)
    max_bsz = _optional_int("max_batch_size", data["max_batch_size"], init)
    bounds = data["local_bsz_bounds"]
    if bounds is not None:
        if isinstance(bounds, (str, bytes)) or not isinstance(bounds, (list, tuple)):
            raise ArgumentTypeError(f"local_bsz_bounds must be [min, max] or null, got {bounds!r}")
        if len(bounds) != 2:
            raise ValueError(f"local_bsz_bounds must be [min, max], got {bounds!r}")
        lo = _optional_int("local_bsz_bounds[0]", bounds[0], 1)
        hi = _optional_int("local_bsz_bounds[1]", bounds[1], 1)
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"local_bsz_bounds must have min <= max, got {bounds!r}")
        bounds = [lo, hi]
    return {
        "schema": HINTS_SCHEMA,
        "perf_params": PerfParams.from_dict(perf).to_dict() if perf is not None else None,
        "grad_params": GradParams.from_dict(grad).to_dict() if grad is not None else None,
        "init_batch_size": init,
        "max_batch_size": max_bsz,
        "local_bsz_bounds": bounds,
        "gradient_accumulation": check_flag(
            "gradient_accumulation", data["gradient_accumulation"]
        ),
        "max_profiled_replicas": check_int(
            "max_profiled_replicas", data["max_profiled_replicas"], min=0
        ),
        "max_profiled_nodes": check_int("max_profiled_nodes", data["max_profiled_nodes"], min=0),
    }


def goodput_fn_from_hints(
    data: Mapping[str, Any], *, optimistic: bool = False
) -> GoodputFunction | None:
    """The goodput model a hints document describes; None while it has no ``perf_params``.

    Null ``grad_params`` mean no noise, as in :meth:`Profiler.goodput_fn`. With
    ``optimistic``, its synchronisation time stops growing past the most replicas
    the job was profiled on (`GoodputFunction.network_flat_beyond`).
    """
    checked = validate_hints(data)
    if checked["perf_params"] is None:
        return None
    grad = checked["grad_params"]
    flat = max(checked["max_profiled_replicas"], 1) if optimistic else None
    return GoodputFunction(
        PerfParams.from_dict(checked["perf_params"]),
        GradParams.from_dict(grad) if grad is not None else GradParams(0.0, 0.0),
        checked["init_batch_size"],
        network_flat_beyond=flat,
    )
