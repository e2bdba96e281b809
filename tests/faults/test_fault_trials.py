"""The CI version of the fault-injection suite: one real torchrun trial of four fault kinds.

The full suite (``nox -s faults``: ``python -m faults --trials 50 --jobs 3``) runs every
kind, several times, with random seeds (the node kind is ``tests/e2e/test_multinode.py``
here); this one runs a fixed seed: SIGKILL of a replica, SIGKILL inside
a checkpoint write, two SIGTERMs, a hung peer (the survivors must stop within
the collective timeout), and a second job on the same checkpoint directory (refused;
none of another job's files touched). Each trial checks that the job finishes its epochs, that
no sample is lost, that repeats are all counted replays, and that the checkpoint
directory holds a loadable checkpoint after every torchrun launch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from faults.run import KINDS, plan, read_records, report, run_trials

SEED = 20261202
CI_KINDS = ("kill", "kill_in_save", "double_sigterm", "hang", "second_job")


def test_the_plan_is_seeded_and_spreads_the_kinds() -> None:
    trials = plan(5 * len(KINDS), seed=5)
    assert trials == plan(5 * len(KINDS), seed=5) and trials != plan(5 * len(KINDS), seed=6)
    counts = {kind: sum(1 for k, _ in trials if k == kind) for kind in KINDS}
    assert counts == dict.fromkeys(KINDS, 5)
    assert sorted(k for k, _ in plan(len(CI_KINDS), SEED, CI_KINDS)) == sorted(CI_KINDS)


def test_unknown_kinds_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown fault kind 'meteor'"):
        run_trials(1, seed=1, kinds=["meteor"])


def test_a_record_line_cut_by_sigkill_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "run0-restart0-rank0.jsonl"
    path.write_text(json.dumps({"run": 0, "start": True}) + '\n{"run": 0, "ind')
    assert read_records(tmp_path) == [{"run": 0, "start": True}]


@pytest.mark.e2e
def test_fault_trials_lose_no_sample_and_count_every_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = run_trials(len(CI_KINDS), SEED, CI_KINDS, root=tmp_path)
    with capsys.disabled():
        report(results, SEED)
    failures = [f"{r.kind}: {r.error}" for r in results if r.error is not None]
    assert not failures, "\n\n".join(failures)
    assert sorted(r.kind for r in results) == sorted(CI_KINDS)
    for r in results:
        assert r.finished and r.lost == 0 and r.repeated <= r.replayed, r
    crashed = [r for r in results if r.kind in ("kill", "kill_in_save", "hang")]
    assert all(r.restarts >= 1 for r in crashed)
    (hang,) = [r for r in results if r.kind == "hang"]
    assert hang.stop_seconds is not None
    (second,) = [r for r in results if r.kind == "second_job"]
    assert second.foreign_touched == 0
