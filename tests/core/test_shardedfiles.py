"""Sharded checkpoint files (issue 15): every replica writes its own files inside the atomic
checkpoint, a restore at another size sees all of them, and a damaged file falls back."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adaptdl.core.checkpoint import CheckpointError
from adaptdl.core.collective import ThreadCollective, run_replicas
from adaptdl.core.job import Job
from adaptdl.core.shardedfiles import (
    FILES_ENTRY,
    FileRecord,
    FileState,
    ShardedCheckpointStore,
    decode_listing,
    encode_listing,
)
from adaptdl.core.topology import Topology


class Shards:
    """A FileState: a list of numbers, each replica writing the slice it owns."""

    name = "shards"

    def __init__(self, rank: int, replicas: int, values: list[int]) -> None:
        self.rank, self.replicas, self.values = rank, replicas, values
        self.restored: list[int] | None = None

    def to_bytes(self) -> bytes:
        return json.dumps({"length": len(self.values)}).encode()

    def from_bytes(self, data: bytes) -> None:
        self.length = json.loads(data)["length"]

    def write_files(self, directory: Path) -> list[str]:
        mine = self.values[self.rank :: self.replicas]
        name = f"part-{self.rank}-of-{self.replicas}.json"
        (directory / name).write_text(json.dumps([self.rank, self.replicas, mine]))
        return [name]

    def read_files(self, directory: Path) -> None:
        out = [0] * self.length
        for path in directory.iterdir():
            rank, replicas, part = json.loads(path.read_text())
            out[rank::replicas] = part
        self.restored = out


def run(tmp_path: Path, replicas: int, values: list[int], saves: int = 1) -> list[Any]:
    def replica(collective: ThreadCollective) -> list[int] | None:
        store = ShardedCheckpointStore(tmp_path, job_id="j")
        job = Job(
            Topology(rank=collective.rank, num_replicas=replicas),
            collective=collective,
            store=store,
        )
        state = Shards(collective.rank, replicas, values)
        job.register(state)
        for _ in range(saves):
            job.checkpoint()
        return state.restored

    return run_replicas(replicas, replica, timeout=30)


def test_every_replica_writes_its_own_files_into_one_checkpoint(tmp_path: Path) -> None:
    assert isinstance(Shards(0, 1, []), FileState)
    run(tmp_path, 3, list(range(10)))
    files = sorted(os.listdir(tmp_path / "ckpt-000001" / "shards"))
    assert files == [f"part-{r}-of-3.json" for r in range(3)]
    listing = decode_listing(
        ShardedCheckpointStore(tmp_path, job_id="j").load().entries[FILES_ENTRY]  # type: ignore[union-attr]
    )
    assert sorted(listing["shards"]) == files
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]  # staging renamed


def test_a_restore_at_another_size_sees_every_replicas_files(tmp_path: Path) -> None:
    values = list(range(11))
    run(tmp_path, 3, values)
    assert run(tmp_path, 2, []) == [values, values]


def test_debris_under_the_next_name_moves_the_files_to_the_name_after(tmp_path: Path) -> None:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "ckpt-000001").write_text("not a checkpoint")
    run(tmp_path, 2, [1, 2, 3])
    assert sorted(os.listdir(tmp_path / "ckpt-000002" / "shards")) == [
        "part-0-of-2.json",
        "part-1-of-2.json",
    ]
    assert run(tmp_path, 1, []) == [[1, 2, 3]]


def test_two_checkpoints_are_kept(tmp_path: Path) -> None:
    run(tmp_path, 2, [1, 2, 3], saves=3)
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("ckpt-")) == [
        "ckpt-000002",
        "ckpt-000003",
    ]


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove", "symlink"])
def test_a_damaged_file_falls_back_to_the_older_checkpoint(tmp_path: Path, damage: str) -> None:
    run(tmp_path, 2, [1, 2, 3])
    run(tmp_path, 2, [4, 5, 6])  # resumes (restored [1, 2, 3]) and saves ckpt-000002
    victim = tmp_path / "ckpt-000002" / "shards" / "part-1-of-2.json"
    if damage == "flip":
        data = victim.read_bytes()
        victim.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:-1])
    elif damage == "remove":
        victim.unlink()
    else:
        target = tmp_path / "elsewhere"
        target.write_bytes(victim.read_bytes())
        victim.unlink()
        victim.symlink_to(target)
    store = ShardedCheckpointStore(tmp_path, job_id="j")
    checkpoint = store.load()
    assert checkpoint is not None and checkpoint.label == "ckpt-000001"
    with pytest.raises(CheckpointError, match=r"part-1-of-2\.json"):
        store.load_label("ckpt-000002")


def test_a_file_state_without_a_checkpoint_directory_is_refused() -> None:
    from adaptdl.core.checkpoint import MemoryCheckpointStore

    job = Job(store=MemoryCheckpointStore())
    job.register(Shards(0, 1, [1]))
    with pytest.raises(CheckpointError, match=r"'shards'.*ShardedCheckpointStore"):
        job.checkpoint()


names = st.text(alphabet="abc_.-0", min_size=1, max_size=8).filter(lambda n: n not in (".", ".."))
hexdigits = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)
records = st.builds(FileRecord, st.integers(0, 2**40), hexdigits)


@given(st.dictionaries(names, st.dictionaries(names, records, max_size=3), max_size=3))
def test_listing_round_trips(listing: dict[str, dict[str, FileRecord]]) -> None:
    assert decode_listing(encode_listing(listing)) == listing


@pytest.mark.parametrize("bad", ["..", ".", "a/b", "/abs", ""])
def test_a_listing_naming_a_path_outside_its_directory_is_refused(bad: str) -> None:
    data = json.dumps({"schema": "adaptdl.files/1", "files": {"s": {bad: [1, "0" * 64]}}}).encode()
    with pytest.raises(ValueError, match="file name"):
        decode_listing(data)
