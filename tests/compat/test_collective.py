"""adaptdl.collective: the original's functions over the job's collective (one replica here;
two replicas under torchrun in tests/e2e/compat)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import adaptdl.collective as collective
import adaptdl.torch as adl
from adaptdl.core.collective import add


def test_using_it_before_initialisation_says_what_to_call() -> None:
    for call in (
        lambda: collective.allreduce(1),
        lambda: collective.allreduce_async(1),
        lambda: collective.broadcast(1),
        collective.teardown,
    ):
        with pytest.raises(RuntimeError, match="init_process_group"):
            call()


def test_initialize_joins_the_job_once() -> None:
    collective.initialize()
    assert adl.is_initialized()
    with pytest.raises(RuntimeError, match="already initialized"):
        collective.initialize()
    with pytest.raises(RuntimeError, match="already"):
        adl.init_process_group()


def test_initialize_after_init_process_group_is_refused_like_the_original() -> None:
    adl.init_process_group()
    with pytest.raises(RuntimeError, match="already initialized"):
        collective.initialize()


@pytest.mark.parametrize(("kwarg", "value"), [("replica_rank", 1), ("num_replicas", 2)])
def test_initialize_refuses_a_topology_other_than_the_environments(kwarg: str, value: int) -> None:
    with pytest.raises(ValueError, match=f"{kwarg}={value} differs from the environment"):
        collective.initialize(**{kwarg: value})
    assert not adl.is_initialized()


def test_initialize_accepts_the_environments_topology() -> None:
    collective.initialize(replica_rank=0, num_replicas=1)
    assert adl.is_initialized()


def test_master_address_and_port_come_together() -> None:
    with pytest.raises(ValueError, match="master_addr and master_port together"):
        collective.initialize(master_addr="127.0.0.1")


def test_the_default_reduction_is_plus_as_in_the_original() -> None:
    adl.init_process_group()
    assert collective.allreduce(3) == 3
    assert collective.allreduce([1, 2]) == [1, 2]
    assert collective.default_reduce_fn([1], [2]) == [1, 2]  # lists concatenate
    assert collective.default_reduce_fn(1.5, 2) == 3.5
    assert collective.allreduce({"a": 1}, add) == {"a": 1}


@given(
    value=st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
        max_leaves=8,
    )
)
def test_json_values_travel_unchanged(value: object) -> None:
    if not adl.is_initialized():
        adl.init_process_group()
    assert collective.broadcast(value) == value
    assert collective.allreduce(value, lambda a, b: a) == value
    assert collective.allreduce_async(value, lambda a, b: a).result() == value


def test_a_value_that_is_not_json_is_a_type_error() -> None:
    adl.init_process_group()
    with pytest.raises(TypeError):
        collective.broadcast(object())
    with pytest.raises(TypeError):
        collective.allreduce({1, 2})


def test_a_tuple_arrives_as_a_list() -> None:
    adl.init_process_group()
    assert collective.broadcast((1, 2)) == [1, 2]


def test_teardown_after_init_returns() -> None:
    adl.init_process_group()
    collective.teardown()
