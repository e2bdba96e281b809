"""End to end: an Accelerate training loop on AdaptDL, stopped by SIGTERM and resumed.

``train_accelerate.py`` runs under torchrun (gloo, CPU) at 2 replicas until SIGTERM
mid epoch 1, then resumes at 1 replica to the end. From the indices the loop
actually received we check that every sample of every epoch was consumed exactly
once, from the recorded batch sizes that they were adapted, and from the
exit records that every replica checkpointed and exited with 143.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
from tests.e2e.test_elastic_restarts import _records
from tests.e2e.test_seed_programs import N, _run

pytest.importorskip("accelerate")

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).with_name("train_accelerate.py")
EPOCHS = 3  # test_seed_programs runs 3 epochs of N = 96 samples


@pytest.fixture(scope="module")
def elastic_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run 2 replicas until SIGTERM in epoch 1, then 1 replica to the end; the directory."""
    tmp = tmp_path_factory.mktemp("accelerate-elastic")
    # With short steps the autoscaler grew the batch in our runs (with 0.2 s it kept 8).
    return _run(tmp, SCRIPT, 2, 1, E2E_STEP_SLEEP="0.05")


def _batches(tmp: Path) -> list[dict[str, Any]]:
    return [r for r in _records(tmp / "records") if "indices" in r]


def check_exactly_once(batches: list[dict[str, Any]], epochs: int) -> None:
    """Each replica got core's share; each epoch's first pass read every sample once.

    An adaptive loop whose batch size grew walks on into a further pass (progress
    equal to one pass at the target batch size): no sample repeats there either.
    """
    first: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    later: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for r in batches:
        assert r["indices"] == r["expected"], r
        counter = first if r["index"] < N else later
        pairs = zip(r["indices"], r["padding"], strict=True)
        counter[r["epoch"]].update(i for i, pad in pairs if not pad)
    assert sorted(first) == list(range(epochs))
    for epoch in range(epochs):
        assert first[epoch] == collections.Counter(range(N)), f"epoch {epoch}"
        assert all(count == 1 for count in later[epoch].values()), f"epoch {epoch}"


def test_every_sample_of_every_epoch_consumed_exactly_once(elastic_job: Path) -> None:
    batches = _batches(elastic_job)
    assert {(r["run"], r["replicas"]) for r in batches} == {(0, 2), (1, 1)}
    check_exactly_once(batches, EPOCHS)


def test_every_replica_checkpoints_and_exits_143_on_sigterm(elastic_job: Path) -> None:
    records = _records(elastic_job / "records")
    exits = {(r["run"], r["rank"], r["exit"]) for r in records if "exit" in r}
    assert exits == {(0, 0, 143), (0, 1, 143), (1, 0, 0)}
    assert list((elastic_job / "checkpoints").glob("ckpt-*"))


def test_the_batch_size_was_adapted(elastic_job: Path) -> None:
    batches = _batches(elastic_job)
    for r in batches:  # the total is split over the replicas of each run
        assert r["local_bsz"] * (r["accumulation_steps"] + 1) * r["replicas"] == r["batch_size"]
    # The autoscaler decided with a goodput model; on this tiny job it grows the total
    # batch size, but how far depends on measured times, so either shows it ran.
    totals = {r["batch_size"] for r in batches}
    assert len(totals) > 1 or any(r["modelled"] for r in batches), totals


def test_accelerate_steps_only_at_the_loaders_optimizer_steps(elastic_job: Path) -> None:
    records = _records(elastic_job / "records")
    batches = [r for r in records if "indices" in r]
    for r in batches:
        assert r["sync_gradients"] == r["optim_step"], r
    # The scheduler stepped once per optimiser step, and resumed with the job.
    steps = [r for r in batches if r["rank"] == 0 and r["optim_step"]]
    starts = {r["run"]: r["scheduler_steps"] for r in records if r.get("start") and r["rank"] == 0}
    assert starts == {0: 0, 1: sum(1 for r in steps if r["run"] == 0)}
    assert [r["scheduler_steps"] for r in steps] == list(range(1, len(steps) + 1))
