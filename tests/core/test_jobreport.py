"""What a job tells its scheduler (adaptdl.core.jobreport): the progress record, the
share directory, and when rank 0 reports at step boundaries."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tests.core.test_loader import shard_batches
from tests.fakes import ManualClock
from tests.threadcollective import run_replicas

from adaptdl.core import jobreport
from adaptdl.core.decide.hints import validate_hints
from adaptdl.core.job import Job
from adaptdl.core.jobreport import HINTS_FILE, PROGRESS_FILE, REPORT_INTERVAL
from adaptdl.core.loop.loader import LoaderHelper
from adaptdl.core.persist.localfs import LocalShare
from adaptdl.core.topology import Topology


class MemoryShare:
    """A share in memory that counts what was published."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.published: list[str] = []

    def publish(self, name: str, data: bytes) -> None:
        self.files[name] = data
        self.published.append(name)

    def read(self, name: str, limit: int | None = None) -> bytes:
        if name not in self.files:
            raise FileNotFoundError(name)
        return self.files[name][:limit]


class BrokenShare(MemoryShare):
    def publish(self, name: str, data: bytes) -> None:
        raise OSError(28, "No space left on device")


@given(
    replicas=st.integers(1, 4096),
    step=st.integers(0, 2**40),
    batch_size=st.integers(1, 2**20),
    when=st.floats(0.0, 4e9, allow_nan=False),
)
def test_a_progress_record_round_trips_through_a_share(replicas, step, batch_size, when):
    share = MemoryShare()
    record = jobreport.progress_record(
        replicas=replicas, step=step, batch_size=batch_size, time=when
    )
    jobreport.publish_progress(share, record)
    assert jobreport.read_progress(share) == record
    assert json.loads(share.files[PROGRESS_FILE]) == record


@pytest.mark.parametrize(
    ("key", "value"),
    [("replicas", 0), ("step", -1), ("batch_size", 0), ("time", -1.0), ("step", 1.5)],
)
def test_a_bad_progress_record_names_the_key(key, value):
    record = {"replicas": 1, "step": 0, "batch_size": 1, "time": 0.0, key: value}
    with pytest.raises(ValueError, match=key):
        jobreport.validate_progress(record)
    with pytest.raises(ValueError, match="unexpected"):
        jobreport.validate_progress({**record, key: 1, "extra": 1} | {"time": 1.0})


def test_unreadable_reports_read_as_none():
    share = MemoryShare()
    assert jobreport.read_progress(share) is None and jobreport.read_hints(share) is None
    share.files[PROGRESS_FILE] = b'{"replicas": 1, '
    share.files[HINTS_FILE] = b'{"schema": "other/1"}'
    assert jobreport.read_progress(share) is None and jobreport.read_hints(share) is None


def test_local_share_replaces_whole_files_and_leaves_nothing_behind(tmp_path: Path):
    share = LocalShare(tmp_path / "share")  # made at the first publish
    share.publish(PROGRESS_FILE, b"old")
    share.publish(PROGRESS_FILE, b"new")
    assert share.read(PROGRESS_FILE) == b"new"
    assert share.read(PROGRESS_FILE, 2) == b"ne"
    assert os.listdir(tmp_path / "share") == [PROGRESS_FILE]
    with pytest.raises(ValueError, match="name"):
        share.publish("../escape", b"x")
    (tmp_path / "share" / "link").symlink_to(tmp_path / "share" / PROGRESS_FILE)
    with pytest.raises(OSError):
        share.read("link")  # never followed


def job_with(share, clock, **kwargs):
    return Job(Topology(), share=share, clock=clock, **kwargs)


def test_rank0_reports_at_the_first_step_then_every_interval():
    share, clock = MemoryShare(), ManualClock()
    job = job_with(share, clock)
    job.step_boundary()
    assert share.published == [PROGRESS_FILE]  # no loader: no hints, the record alone
    first = jobreport.read_progress(share)
    assert first is not None and first["step"] == 1 and first["replicas"] == 1
    clock.now += REPORT_INTERVAL / 2
    job.step_boundary()
    job.step_boundary(training=False)  # a validation loop's boundary never reports
    assert len(share.published) == 1
    clock.now += REPORT_INTERVAL
    job.step_boundary()
    assert len(share.published) == 2
    assert jobreport.read_progress(share)["step"] == 3


def test_a_batch_size_change_is_reported_at_the_next_step():
    share, clock = MemoryShare(), ManualClock()
    job = job_with(share, clock)
    job.step_boundary()
    job.batch_size_changed()
    assert job.reporter is not None and job.reporter.due == -math.inf
    job.step_boundary()
    assert len(share.published) == 2


def test_a_training_loop_publishes_valid_hints_and_each_new_batch_size():
    share, clock = MemoryShare(), ManualClock(tick=0.01)
    job = job_with(share, clock)
    # 4 a replica in the first epoch (3 steps of 12 samples), 8 in the second.
    job.batch_size_decision = lambda query: (4 if job.epoch.current_epoch == 0 else 8, 0)
    loader = LoaderHelper(job, batch_size=4)
    loader.autoscale_batch_size(16, local_bsz_bounds=(2, 8))
    loader.train()
    for _epoch in job.epoch.remaining_epochs_until(2):
        for _batch in loader.iterate(12, shard_batches(12, 0, 1)):
            job.metrics.add_progress(1.0)  # what the model wrapper records
    hints = validate_hints(json.loads(share.files[HINTS_FILE]))
    assert hints["init_batch_size"] == 4 and hints["max_batch_size"] == 16
    assert hints["local_bsz_bounds"] == [2, 8]
    # The first step of the process, then the first at the new size; nothing between.
    assert share.published == [HINTS_FILE, PROGRESS_FILE] * 2
    last = jobreport.read_progress(share)
    assert last is not None and (last["step"], last["batch_size"]) == (4, 8)


def test_only_rank0_reports():
    shares = [MemoryShare(), MemoryShare()]

    def replica(collective):
        rank = collective.rank
        job = Job(Topology(rank=rank, num_replicas=2), collective=collective, share=shares[rank])
        job.step_boundary()
        job.drain()
        return job.reporter is not None

    assert run_replicas(2, replica) == [True, False]
    assert shares[0].published and not shares[1].published


def test_a_share_that_fails_is_logged_once_and_training_goes_on(caplog):
    clock = ManualClock()
    job = job_with(BrokenShare(), clock)
    for _ in range(3):
        clock.now += REPORT_INTERVAL
        job.step_boundary()
    warnings = [r for r in caplog.records if "cannot publish" in r.getMessage()]
    assert len(warnings) == 1
    assert job.global_step == 3


def test_the_hints_carry_the_estimators_statistics_not_the_floors_credit(monkeypatch):
    """The scheduler rates a job by its estimator's noise statistics, as the adapters'
    hints do: the loss floor's credit (`model_grad_params`) stays the job's own."""
    from adaptdl.core.goodput import GradParams
    from adaptdl.core.stats.metrics import MetricsState

    own, credited = GradParams(sqr=2.0, var=3.0), GradParams(sqr=2.0, var=30.0)
    monkeypatch.setattr(MetricsState, "grad_params", lambda self: own)
    monkeypatch.setattr(MetricsState, "model_grad_params", lambda self: credited)
    share, clock = MemoryShare(), ManualClock(tick=0.01)
    job = job_with(share, clock)
    loader = LoaderHelper(job, batch_size=4)
    loader.autoscale_batch_size(16, local_bsz_bounds=(2, 8))
    loader.train()
    for _epoch in job.epoch.remaining_epochs_until(1):
        for _batch in loader.iterate(12, shard_batches(12, 0, 1)):
            job.metrics.add_progress(1.0)
    hints = validate_hints(json.loads(share.files[HINTS_FILE]))
    assert hints["grad_params"] == own.to_dict()
