"""Job replay through the real core: exactly once per epoch, whatever the timeline."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptdl.sim.replay import (
    Scenario,
    SimCollective,
    TimelineEvent,
    builtin_scenarios,
    even_placement,
    load_scenario,
    run_replay,
)


def _small(timeline: tuple[TimelineEvent, ...], adaptive: bool, seed: int = 0) -> Scenario:
    return Scenario(
        name="t",
        application="replay-small",
        epochs=3,
        dataset_size=500,
        init_batch_size=16,
        max_batch_size=256 if adaptive else None,
        local_bsz_bounds=(4, 64) if adaptive else None,
        gradient_accumulation=adaptive,
        replicas=2,
        timeline=timeline,
        restart_penalty=5.0,
        checkpoint_interval=3.0,
        seed=seed,
    )


events = st.lists(
    st.one_of(
        st.builds(
            lambda t, r: TimelineEvent(t, "resize", replicas=r),
            st.floats(0, 40),
            st.integers(1, 7),
        ),
        st.builds(
            lambda t, d, r: TimelineEvent(t, "preempt", replicas=r, duration=d),
            st.floats(0, 40),
            st.floats(0, 20),
            st.integers(1, 7),
        ),
        st.builds(lambda t: TimelineEvent(t, "crash"), st.floats(0, 40)),
    ),
    max_size=8,
).map(lambda es: tuple(sorted(es, key=lambda e: e.time)))


@settings(max_examples=40, deadline=None)
@given(timeline=events, adaptive=st.booleans(), seed=st.integers(0, 3))
def test_every_sample_consumed_once_per_epoch(
    timeline: tuple[TimelineEvent, ...], adaptive: bool, seed: int
) -> None:
    report = run_replay(_small(timeline, adaptive, seed))
    assert report.exactly_once, report.epochs
    for e in report.epochs:
        # A fixed-batch epoch is one full pass; an adaptive loop at least most of one.
        assert e.samples >= (500 if not adaptive else 1)
    # Crashes happen while the job runs; one due after it finished never happens.
    assert report.crashes <= sum(e.kind == "crash" for e in timeline)
    assert report.restarts >= report.crashes


def test_same_scenario_same_report() -> None:
    timeline = (
        TimelineEvent(2.0, "resize", replicas=3),
        TimelineEvent(6.0, "crash"),
        TimelineEvent(9.0, "preempt", duration=4.0, replicas=5, nodes=2),
    )
    sc = _small(timeline, adaptive=True, seed=1)
    assert run_replay(sc).to_json() == run_replay(sc).to_json()


def test_adaptive_replay_grows_the_batch_size_through_the_core() -> None:
    report = run_replay(builtin_scenarios()["elastic"])
    sizes = [row[4] for row in report.timeline]
    assert max(sizes) > sizes[0] == 32
    assert any(row[5] > 0 for row in report.timeline)  # goodput from the core model
    assert report.crashes == 2 and report.restarts >= 4
    assert report.restart_seconds == 30.0 * report.restarts


def test_crash_replays_the_work_since_the_checkpoint() -> None:
    report = run_replay(builtin_scenarios()["crashy"])
    assert report.crashes > 0
    assert sum(e.replayed for e in report.epochs) > 0
    assert report.exactly_once


def test_scenario_json_round_trip(tmp_path: Path) -> None:
    sc = builtin_scenarios()["elastic"]
    path = tmp_path / "s.json"
    path.write_text(json.dumps(sc.to_dict()))
    assert load_scenario(path) == sc


def test_bad_scenario_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"name": "x", "application": "replay-small", "epochs": 0}))
    with pytest.raises(ValueError, match=r"s\.json: bad scenario"):
        load_scenario(path)


def test_timeline_event_validation() -> None:
    with pytest.raises(ValueError, match="event kind"):
        TimelineEvent(1.0, "explode")
    with pytest.raises(ValueError, match="resize event needs replicas"):
        TimelineEvent(1.0, "resize")


def test_sim_collective_folds_identical_replicas() -> None:
    c = SimCollective(3)
    assert c.allreduce(2) == 6
    assert c.allgather("x") == ["x", "x", "x"]
    assert c.broadcast([1, 2]) == [1, 2]


@pytest.mark.parametrize("value", [np.int64(1), {1: "int key"}, (object(),)])
def test_sim_collective_checks_the_wire_format_like_real_replicas(value: object) -> None:
    c = SimCollective(2)
    for op in (c.broadcast, c.allreduce, c.allgather, c.allreduce_async):
        with pytest.raises(TypeError, match="cannot travel"):
            op(value)
    assert c.broadcast((1, 2)) == [1, 2]  # tuples arrive as lists, as between processes
    with pytest.raises(ValueError, match="root"):
        c.broadcast(1, root=2)


@given(st.integers(1, 64), st.data())
def test_even_placement_uses_every_node_within_one_replica(
    replicas: int, data: st.DataObject
) -> None:
    nodes = data.draw(st.integers(1, replicas))
    placement = even_placement(replicas, nodes)
    assert len(placement) == nodes and sum(placement) == replicas
    assert min(placement) >= 1 and max(placement) - min(placement) <= 1
    assert list(placement) == sorted(placement, reverse=True)


def test_even_placement_rejects_more_nodes_than_replicas() -> None:
    with pytest.raises(ValueError, match="nodes"):
        even_placement(2, 3)
