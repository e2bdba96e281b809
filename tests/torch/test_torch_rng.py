"""The random-number states in a checkpoint, and what rank 0 saves of them alone."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

from adaptdl.core.collective import decode
from adaptdl.core.job import Job
from adaptdl.core.persist.checkpoint import CollectiveState, MemoryCheckpointStore, SavableAlone
from adaptdl.torch.rng import RngState


def test_rank_0_alone_saves_no_replica_s_states_and_keeps_those_gathered() -> None:
    job = Job()
    rng = RngState(job)
    assert isinstance(rng, SavableAlone) and isinstance(rng, CollectiveState)
    rng.sync()  # this replica's states gathered, as at a checkpoint
    gathered = rng.to_bytes()
    alone = rng.bytes_alone()
    assert decode(alone) == {"format": 1, "num_replicas": 1, "replicas": {}}
    assert alone == RngState(job).to_bytes()  # what to_bytes makes with nothing gathered
    assert rng.to_bytes() == gathered


def _draw_after_restart(alone: bool) -> float:
    """The first draw after a restart from a checkpoint taken inside a loop (seeded 1),
    its random states saved as usual or as rank 0 alone saves them; the restarted
    program seeds 2."""
    store = MemoryCheckpointStore()
    job = Job(store=store)
    rng = RngState(job)
    job.register(rng)
    loop: Any = SimpleNamespace(name="a loop")
    job.enter_loader(loop)  # a checkpoint inside a loop: the restart replays up to it
    random.seed(1)
    job.checkpoint()
    if alone:
        saved = store.load()
        assert saved is not None
        store.save({**saved.entries, rng.name: rng.bytes_alone()})
    again = Job(store=store)
    again.register(RngState(again))
    random.seed(2)  # the program's own seeding, replayed
    again.loop_resumes()
    return random.random()


def test_states_saved_alone_restore_nothing_and_the_program_s_seeding_holds() -> None:
    random.seed(1)
    first = random.random()
    random.seed(2)
    second = random.random()
    assert _draw_after_restart(alone=False) == first
    assert _draw_after_restart(alone=True) == second
