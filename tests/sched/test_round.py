"""The allocation round: its checks of a policy's answer, and how it names each change."""

from __future__ import annotations

import pytest
from tests.sched.views import View, profiled_hints

from adaptdl.sched.policies import FifoPolicy, PolluxPolicy, TiresiasPolicy, make_policy
from adaptdl.sched.round import AllocationError, ChangeKind, allocation_round, check_allocation
from adaptdl.sched.view import ClusterState, JobView


def _state(*jobs: JobView, nodes: int = 2, gpus: int = 4, **kw: object) -> ClusterState:
    up = kw.pop("up", (True,) * nodes)
    return ClusterState(
        time=100.0,
        num_nodes=nodes,
        gpus_per_node=gpus,
        up=up,  # type: ignore[arg-type]
        jobs=jobs,
        interval=60.0,
        restart_penalty=30.0,
        **kw,  # type: ignore[arg-type]
    )


class Fixed:
    """A policy that answers what it is told to."""

    name = "fixed"
    adaptive = False

    def __init__(self, answer: dict[str, list[int]]) -> None:
        self.answer = answer

    def allocate(self, state: ClusterState) -> dict[str, list[int]]:
        return self.answer


def test_each_change_is_named_by_what_the_job_had_and_gets() -> None:
    jobs = [
        View("new"),
        View("back", started=10.0),
        View("grow", nodes=[0], started=0.0),
        View("move", nodes=[0, 0], started=0.0),
        View("stop", nodes=[1], started=0.0),
        View("same", nodes=[1, 1], started=0.0),
    ]
    answer = {"new": [2], "back": [0], "grow": [0, 1], "move": [1, 0], "same": [1, 1]}
    done = allocation_round(Fixed(answer), _state(*jobs, nodes=3))
    kinds = {c.job: c.kind for c in done.changes}
    assert kinds == {
        "new": ChangeKind.START,
        "back": ChangeKind.RESUME,
        "grow": ChangeKind.RESIZE,
        "move": ChangeKind.MOVE,
        "stop": ChangeKind.SUSPEND,
    }
    assert [c.job for c in done.changes if not c.restart] == ["new"]
    assert done.nodes("move") == (0, 1) and done.nodes("stop") == ()


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ({"ghost": [0]}, "'ghost', not an active job"),
        ({"a": [2]}, r"node 2; nodes are 0\.\.1"),
        ({"a": [1]}, "node 1, which is down"),
        ({"a": [0, 0, 0, 0, 0]}, "5 GPUs on node 0, which has 4"),
        ({"b": [0]}, r"gave 'b' 1 GPUs; it takes 2\.\.3"),
        ({"b": [0, 0, 0, 0]}, r"gave 'b' 4 GPUs; it takes 2\.\.3"),
    ],
)
def test_an_answer_the_cluster_or_a_job_cannot_hold_is_refused(
    answer: dict[str, list[int]], message: str
) -> None:
    state = _state(
        View("a", max_replicas=8), View("b", min_replicas=2, max_replicas=3), up=(True, False)
    )
    with pytest.raises(AllocationError, match=message):
        check_allocation(state, answer, "fixed")


def test_a_smaller_node_is_filled_no_further_than_its_gpus() -> None:
    state = _state(View("a", max_replicas=8), nodes=2, gpus=4, node_gpus=(4, 2))
    assert state.total_gpus == 6
    with pytest.raises(AllocationError, match="3 GPUs on node 1, which has 2"):
        check_allocation(state, {"a": [1, 1, 1]}, "fixed")


def test_cluster_state_refuses_mismatched_nodes() -> None:
    with pytest.raises(ValueError, match="node_gpus has 1 entries for num_nodes=2"):
        _state(View("a"), node_gpus=(4,))
    with pytest.raises(ValueError, match=r"each must be in \[0, gpus_per_node=4\]"):
        _state(View("a"), node_gpus=(4, 5))


def test_pollux_holds_each_job_within_its_min_and_max() -> None:
    wide = View("wide", min_replicas=3, max_replicas=5, hints=profiled_hints((1, 2, 4, 8)))
    narrow = View("narrow", submit=1.0, max_replicas=1, hints=profiled_hints((1, 2, 4, 8)))
    done = allocation_round(PolluxPolicy(), _state(wide, narrow, nodes=4))
    assert 3 <= len(done.nodes("wide")) <= 5
    assert len(done.nodes("narrow")) == 1


def test_pollux_leaves_a_job_waiting_rather_than_below_its_minimum() -> None:
    first = View("first", max_replicas=4, hints=profiled_hints((1, 2, 4)))
    big = View("big", submit=1.0, min_replicas=4, max_replicas=4, hints=profiled_hints((4,)))
    done = allocation_round(PolluxPolicy(), _state(first, big, nodes=1))
    assert done.nodes("big") in ((), (0, 0, 0, 0))
    assert len(done.nodes("first")) + len(done.nodes("big")) <= 4


@pytest.mark.parametrize("policy", [FifoPolicy, TiresiasPolicy])
def test_fixed_size_policies_give_the_request_cut_to_max_and_never_below_min(
    policy: type,
) -> None:
    over = View("over", requested_replicas=6, max_replicas=2)
    too_big = View("too-big", submit=1.0, requested_replicas=12, min_replicas=9, max_replicas=12)
    done = allocation_round(policy(), _state(over, too_big))
    assert len(done.nodes("over")) == 2
    assert done.nodes("too-big") == ()


def test_optimus_refuses_jobs_without_an_oracle() -> None:
    with pytest.raises(TypeError, match="optimus needs each job's true speed"):
        make_policy("optimus").allocate(_state(View("a")))


@pytest.mark.parametrize(("cost", "grows"), [(0.0, True), (1700.0, False)])
def test_pollux_weighs_a_resize_against_the_jobs_measured_restart_cost(
    cost: float, grows: bool
) -> None:
    # The same job and cluster: a cheap restart is worth the gain of more GPUs, one
    # costing nearly the whole horizon (max_horizon 1800 s) is not.
    job = View(
        "a",
        nodes=[0],
        started=0.0,
        max_replicas=4,
        restart_cost=cost,
        hints=profiled_hints((1, 2, 4)),
    )
    done = allocation_round(PolluxPolicy(), _state(job, nodes=1))
    assert (len(done.nodes("a")) > 1) is grows
