"""End to end: a LightningModule trained by AdaptiveStrategy, stopped by SIGTERM, resumed smaller.

A small LightningModule and LightningDataModule (``train_lightning.py``) train
under torchrun with 2 replicas and an adaptive batch size until SIGTERM in epoch
1 (during its training, or during its validation), then resume at 1 replica to
the end. From the indices the training steps
received we check that every pass of every epoch was consumed exactly once over
the two runs, and from the records that every replica exited 143, that the batch
size adapted, and that Lightning's own state (epoch, step, LR scheduler) resumed.
"""

from __future__ import annotations

import collections
import signal
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

from tests.e2e.test_elastic_restarts import Launch, _records
from tests.e2e.test_seed_programs import ENV, N, _run

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).with_name("train_lightning.py")
EPOCHS = int(ENV["E2E_EPOCHS"])
# Adaptive batch size on a target noisy enough that a larger batch pays: at the default
# label noise the gradient noise scale is a few samples, and the autoscaler rightly keeps
# the initial size, from the one local size profiled (its throughput model then splits
# the step time between a fixed and a per-sample part).
AUTOSCALE = {"E2E_AUTOSCALE": "1", "E2E_NOISE": "4.0"}


@pytest.fixture(scope="module", params=["training", "validation"])
def lightning_job(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """Train 2 replicas until SIGTERM in epoch 1, then 1 replica to the end.

    The SIGTERM comes in the middle of the epoch's training, or of its validation
    (after the training loop of the epoch had ended).
    """
    tmp = tmp_path_factory.mktemp(f"lightning-{request.param}")
    if request.param == "training":
        return _run(tmp, SCRIPT, 2, 1, **AUTOSCALE)
    (tmp / "records").mkdir()
    env = {**ENV, **AUTOSCALE, "E2E_EVAL_SLEEP": "0.5"}
    launches = [Launch(tmp, 0, 2, script=SCRIPT, **env)]
    try:
        launches[0].wait_until(lambda records: any(r.get("validating") == 1 for r in records))
        launches[0].proc.send_signal(signal.SIGTERM)
        assert launches[0].wait() != 0, launches[0].output()
        launches.append(Launch(tmp, 1, 1, script=SCRIPT, **env))
        assert launches[1].wait() == 0, launches[1].output()
    finally:
        for launch in launches:
            launch.kill()
    return tmp


def _batches(tmp: Path) -> list[dict[str, Any]]:
    return [r for r in _records(tmp / "records") if "indices" in r]


def test_every_pass_of_every_epoch_consumed_exactly_once(lightning_job: Path) -> None:
    batches = _batches(lightning_job)
    assert {r["replicas"] for r in batches} == {1, 2}
    consumed: dict[tuple[int, int], collections.Counter[int]] = collections.defaultdict(
        collections.Counter
    )
    for r in batches:
        # The training step received exactly the indices core's sharding assigns.
        assert r["indices"] == r["expected"], r
        # Lightning's epoch is AdaptDL's epoch.
        assert r["epoch"] == r["adl_epoch"], r
        for index, pad in zip(r["indices"], r["padding"], strict=True):
            if not pad:
                consumed[r["epoch"], r["index"] // N].update([index])
    assert sorted({epoch for epoch, _ in consumed}) == list(range(EPOCHS))
    for (epoch, pass_), counts in consumed.items():
        assert max(counts.values()) == 1, f"epoch {epoch} pass {pass_} repeated a sample"
        if pass_ == 0:  # every epoch walks its first pass whole; an adaptive one may go on
            assert set(counts) == set(range(N)), f"epoch {epoch} lost samples"


def test_every_replica_checkpoints_and_exits_143(lightning_job: Path) -> None:
    exits = collections.defaultdict(set)
    for r in _records(lightning_job / "records"):
        if "exit" in r:
            exits[r["run"]].add((r["rank"], r["exit"]))
    assert exits[0] == {(0, 143), (1, 143)}
    assert exits[1] == {(0, 0)}
    assert list((lightning_job / "checkpoints").glob("ckpt-*"))


def test_batch_size_adapted(lightning_job: Path) -> None:
    batches = _batches(lightning_job)
    # The autoscaler changed the total batch size (accumulation under Lightning is
    # checked deterministically in test_lightning_strategy.py).
    assert len({r["batch_size"] for r in batches}) > 1
    for r in batches:
        assert r["batch_size"] == r["local_bsz"] * (r["accumulation_steps"] + 1) * r["replicas"]


def test_lightning_state_resumes_where_it_stopped(lightning_job: Path) -> None:
    records = _records(lightning_job / "records")
    starts = {r["run"]: r for r in records if r.get("start") and r["rank"] == 0}
    assert starts[0]["restored"] is None and starts[1]["restored"] is not None
    first = [r for r in _batches(lightning_job) if r["run"] == 0 and r["rank"] == 0]
    resumed = [r for r in _batches(lightning_job) if r["run"] == 1]
    # Resumed inside epoch 1 (or, stopped in its validation, at epoch 2), after the
    # batches of run 0, at the scheduled LR.
    assert (resumed[0]["epoch"], resumed[0]["index"] > 0) in {(1, True), (2, False)}
    assert resumed[0]["global_step"] > first[-1]["global_step"]
    assert any(r.get("validating") == 1 for r in records)
    # StepLR(gamma=0.5) steps once per epoch, across the restart too.
    for r in first + resumed:
        assert r["lr"] == pytest.approx(0.05 * 0.5 ** r["epoch"]), r
    end = next(r for r in records if r["run"] == 1 and "exit" in r)
    assert end["finished_epochs"] == EPOCHS and end["current_epoch"] == EPOCHS
