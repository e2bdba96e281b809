"""The random number generators of each replica as part of the job's checkpoint.

Python's ``random``, numpy's global generator, torch's CPU generator and, once
CUDA is initialised, every CUDA device's generator. Each replica's states are
gathered to rank 0 when the job checkpoints (at a step boundary inside a loop).
After a restart at the same number of replicas, each replica restores its own
states when the interrupted loop resumes: the code replayed before it (model
construction, seeding) may draw numbers at will, and training then continues
with the very numbers an uninterrupted run would have drawn, so that at a fixed
batch size a stop and restart is bit-identical to not stopping (DataLoader
workers aside: they are seeded per loop, from the loop's position). After a
restart at another number of replicas nothing is restored: each replica keeps
the state the program gave it (its own seeding).

Saved as JSON (base64 bytes and integer lists), never pickled.
"""

from __future__ import annotations

import base64
import logging
import random
from typing import Any

import numpy as np

import torch
from adaptdl.core.collective import encode
from adaptdl.core.job import Job
from adaptdl.core.persist.checkpoint import CheckpointError, JsonState

__all__ = ["RngState", "capture", "restore"]

LOG = logging.getLogger("adaptdl.torch.rng")
_FORMAT = 1


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode("ascii")


def _tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)


def capture() -> dict[str, Any]:
    """This process's generator states as a JSON-safe dict (for `restore`)."""
    version, internal, gauss = random.getstate()
    numpy_state: Any = np.random.get_state(legacy=True)
    kind, keys, pos, has_gauss, cached = numpy_state
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [
            kind,
            base64.b64encode(keys.astype("<u4").tobytes()).decode("ascii"),
            int(pos),
            int(has_gauss),
            float(cached),
        ],
        "torch": _b64(torch.get_rng_state()),
        "cuda": None,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore(state: dict[str, Any]) -> None:
    """Set this process's generators to ``state`` (from `capture`); ValueError if malformed."""
    try:
        version, internal, gauss = state["python"]
        kind, keys, pos, has_gauss, cached = state["numpy"]
        keys_array = np.frombuffer(base64.b64decode(keys, validate=True), dtype="<u4")
        torch_state = _tensor(state["torch"])
        cuda = state["cuda"]
        python_state = (int(version), tuple(int(v) for v in internal), gauss)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed random-number state ({type(exc).__name__}: {exc})") from exc
    random.setstate(python_state)
    np.random.set_state((kind, keys_array.astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch_state)
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([_tensor(s) for s in cuda])
        else:
            LOG.warning(
                "CUDA generators not restored: saved for %d devices, this process sees %d",
                len(cuda),
                torch.cuda.device_count(),
            )


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {**a, **b}


class RngState(JsonState):
    """Every replica's generator states, gathered at a checkpoint (a collective state).

    A `~adaptdl.core.persist.checkpoint.SavableAlone`: rank 0 alone saves it without states.
    """

    def __init__(self, job: Job, name: str = "adaptdl-rng") -> None:
        self.name = name
        self._job = job
        self._gathered: dict[str, Any] = {}

    def sync(self) -> None:
        """Collective: gather every replica's states (the job calls it before saving)."""
        rank = str(self._job.topology.rank)
        self._gathered = self._job.collective.allreduce({rank: capture()}, _merge)

    def to_json(self) -> dict[str, Any]:
        return self._document(self._gathered)

    def bytes_alone(self) -> bytes:
        """What rank 0 saves without its peers (a stop outside any loop): no states,
        so a restart keeps the program's own seeding (see `SavableAlone`)."""
        return encode(self._document({}))  # what to_bytes makes with nothing gathered

    def _document(self, replicas: dict[str, Any]) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "num_replicas": self._job.topology.num_replicas,
            "replicas": replicas,
        }

    def load_json(self, data: dict[str, Any]) -> None:
        if data.get("format") != _FORMAT or not isinstance(data.get("replicas"), dict):
            raise CheckpointError(f"state {self.name!r}: unknown format {data!r:.60}")
        topology = self._job.topology
        if not data["replicas"]:
            return  # saved by rank 0 alone, outside any loop: nothing to restore
        if data.get("num_replicas") != topology.num_replicas:
            LOG.info(
                "random-number states saved by %s replicas are not restored at %d: each "
                "replica keeps the state the program set",
                data.get("num_replicas"),
                topology.num_replicas,
            )
            return
        mine = data["replicas"].get(str(topology.rank))
        if not isinstance(mine, dict):
            raise CheckpointError(f"state {self.name!r}: no state for rank {topology.rank}")
        self._job.on_resume(lambda: restore(mine))
