"""Bad input through the public torch API: an error naming the argument, the value and the rule.

Argument checks of the loader, the data-parallel wrapper and the core state
machines are proven in tests/core and tests/torch; here every environment
variable the library reads is given garbage at `init_process_group`, the
checkpoint directory is unusable at start, and a few arguments are given through
the torch API that the other tests reach only through core.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import TensorDataset

import adaptdl.torch as adl
import torch
from adaptdl.core.persist.checkpoint import CheckpointError
from adaptdl.core.persist.localfs import LocalStorage
from adaptdl.torch import _context

GARBAGE = [
    ("RANK", "zero"),
    ("RANK", "-1"),
    ("WORLD_SIZE", "0"),
    ("WORLD_SIZE", "2.0"),
    ("LOCAL_WORLD_SIZE", "-4"),
    ("LOCAL_WORLD_SIZE", "many"),
    ("GROUP_WORLD_SIZE", "0"),
    ("GROUP_WORLD_SIZE", "1/2"),
    ("TORCHELASTIC_RESTART_COUNT", "-1"),
    ("TORCHELASTIC_RESTART_COUNT", "first"),
    ("ADAPTDL_REPLICA_RANK", "r0"),
    ("ADAPTDL_NUM_REPLICAS", "0"),
    ("ADAPTDL_NUM_NODES", "none"),
    ("ADAPTDL_NUM_RESTARTS", "-2"),
    ("ADAPTDL_CHECKPOINT_INTERVAL", "soon"),
    ("ADAPTDL_CHECKPOINT_INTERVAL", "inf"),
    ("ADAPTDL_CHECKPOINT_INTERVAL", "-60"),
    ("ADAPTDL_CHECKPOINT_STEPS", "1e3"),
    ("ADAPTDL_CHECKPOINT_STEPS", "-1"),
    ("ADAPTDL_COLLECTIVE_TIMEOUT", "0"),
    ("ADAPTDL_COLLECTIVE_TIMEOUT", "-5"),
    ("ADAPTDL_COLLECTIVE_TIMEOUT", "nan"),
    ("ADAPTDL_COLLECTIVE_TIMEOUT", "30s"),
]


@pytest.mark.parametrize(("variable", "value"), GARBAGE, ids=[f"{v}={x}" for v, x in GARBAGE])
def test_garbage_in_an_environment_variable_fails_at_start_naming_it(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError) as info:
        adl.init_process_group("gloo")
    message = str(info.value)
    assert f"{variable}={value!r}" in message and "must be" in message
    assert not _context.is_initialized()


def test_a_garbage_master_port_under_torchrun_names_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "http",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "RANK": "0",
        "WORLD_SIZE": "1",
    }.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"MASTER_PORT='http' must be a port number"):
        adl.init_process_group("gloo")


def test_inconsistent_rank_and_world_size_fail_naming_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"RANK=3 must be less than WORLD_SIZE=3"):
        adl.init_process_group("gloo")


def test_an_unwritable_checkpoint_directory_is_reported_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(blocker / "ckpt"))
    with pytest.raises(CheckpointError) as info:
        adl.init_process_group("gloo")
    message = str(info.value)
    assert f"'{blocker / 'ckpt'}' cannot be created or written" in message
    assert "choose a writable directory" in message


class FullDisk(LocalStorage):
    """A directory on a disk with no space left."""

    @staticmethod
    def write_durably(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def test_a_full_disk_is_reported_at_start(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as info:
        adl.init_process_group("gloo", storage=FullDisk(tmp_path / "ckpt"))
    message = str(info.value)
    assert f"'{tmp_path / 'ckpt'}'" in message and "No space left on device" in message


def test_an_empty_dataset_is_refused_naming_its_length() -> None:
    loader = adl.AdaptiveDataLoader(TensorDataset(torch.zeros(0, 2)), batch_size=4)
    with pytest.raises(ValueError, match=r"dataset length must be >= 1, got 0"):
        for _ in adl.remaining_epochs_until(1):
            for _batch in loader:
                pass


@pytest.mark.parametrize("epochs", [-1, 2.0, "3", None])
def test_a_bad_epoch_count_is_refused_naming_it(epochs: Any) -> None:
    with pytest.raises(ValueError, match="epoch") as info:
        list(adl.remaining_epochs_until(epochs))
    assert repr(epochs) in str(info.value)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((3,), "max_batch_size must be an int >= batch_size=4, got 3"),
        ((8.0,), "max_batch_size must be an int >= batch_size=4, got 8.0"),
        ((16, (5, 8)), "local_bsz_bounds min must be <= batch_size=4, got (5, 8)"),
        ((16, (1, 2)), "local_bsz_bounds max must be >= batch_size=4, got (1, 2)"),
        ((16, (3, 2)), "local_bsz_bounds must have min <= max, got (3, 2)"),
        ((16, ("1", 8)), "local_bsz_bounds min must be None or an int >= 1"),
    ],
)
def test_bad_autoscale_arguments_name_the_argument_the_value_and_the_rule(
    args: tuple[Any, ...], message: str
) -> None:
    loader = adl.AdaptiveDataLoader(TensorDataset(torch.zeros(8, 2)), batch_size=4)
    with pytest.raises(ValueError) as info:
        loader.autoscale_batch_size(*args)
    assert message in str(info.value)


@pytest.mark.parametrize("batch_size", [0, -3, 2.5, "8", True])
def test_a_bad_batch_size_names_the_value(batch_size: Any) -> None:
    with pytest.raises(ValueError) as info:
        adl.AdaptiveDataLoader(TensorDataset(torch.zeros(8, 2)), batch_size=batch_size)
    assert f"batch_size must be an int >= 1, got {batch_size!r}" in str(info.value)
