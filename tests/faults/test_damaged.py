"""Damaged, foreign and crafted checkpoints met through the torch API: fallback or a clear error.

The store's own checks are proven in tests/core/test_checkpoint.py; here a real job
(AdaptiveDataLoader, AdaptiveDataParallel, periodic checkpoints) writes the
checkpoints, they are damaged on disk, and the next `init_process_group` must
resume from the previous complete one with a warning, or refuse with an error that
says what is wrong and which directory to remove. A crafted pickle payload in the
model entry, with a manifest rewritten to match it, must be refused without running.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
from torch.utils.data import TensorDataset

import adaptdl.torch as adl
import torch
from adaptdl.core.collective import encode
from adaptdl.core.loop.boundary import Preempted
from adaptdl.core.persist.checkpoint import CheckpointError, CheckpointStore
from adaptdl.core.persist.manifest import MANIFEST
from adaptdl.torch import _context

N = 24


def dataset(n: int = N) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.arange(n), torch.randn(n, 2, generator=gen))


def train(stop_after: int | None, n: int = N) -> list[int]:
    """Train 2 epochs over ``n`` samples; stop (as SIGTERM would) after ``stop_after`` steps."""
    adl.init_process_group("gloo")
    job = _context.current_job()
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    adp = adl.AdaptiveDataParallel(model, optimizer)
    loader = adl.AdaptiveDataLoader(dataset(n), batch_size=4, shuffle=True)
    seen: list[int] = []
    steps = 0
    try:
        for _ in adl.remaining_epochs_until(2):
            for index, x in loader:
                optimizer.zero_grad()
                adp(x).pow(2).mean().backward()
                optimizer.step()
                seen.extend(index.tolist())
                steps += 1
                if steps == stop_after:
                    job.request_stop()
    finally:
        _context._reset()
    return seen


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A checkpoint directory holding two checkpoints of a job stopped after 3 steps."""
    ckpt = tmp_path / "ckpt"
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(ckpt))
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_STEPS", "1")
    with pytest.raises(Preempted):
        train(stop_after=3)
    assert len(CheckpointStore(ckpt).labels()) == 2
    return ckpt


def newest(root: Path) -> Path:
    return root / CheckpointStore(root).labels()[-1]


def entry_file(checkpoint: Path, prefix: str) -> Path:
    listing = json.loads((checkpoint / MANIFEST).read_text())["entries"]
    (name,) = [name for name in listing if name.startswith(prefix)]
    return checkpoint / listing[name]["file"]


def truncate(root: Path) -> None:
    path = entry_file(newest(root), "adaptdl-dataparallel")
    path.write_bytes(path.read_bytes()[:-7])


def flip(root: Path) -> None:
    path = entry_file(newest(root), "adaptdl-dataparallel")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def remove_manifest(root: Path) -> None:
    (newest(root) / MANIFEST).unlink()


def future_schema(root: Path) -> None:
    path = newest(root) / MANIFEST
    path.write_text(path.read_text().replace("adaptdl.checkpoint/1", "adaptdl.checkpoint/7"))


DAMAGES: list[tuple[Callable[[Path], None], str]] = [
    (truncate, "truncated or overwritten"),
    (flip, "does not match its SHA-256"),
    (remove_manifest, "manifest.json is missing"),
    (future_schema, "unknown schema 'adaptdl.checkpoint/7'"),
]


@pytest.mark.parametrize(("damage", "reason"), DAMAGES, ids=[d.__name__ for d, _ in DAMAGES])
def test_a_damaged_newest_checkpoint_resumes_from_the_previous_with_a_warning(
    root: Path, caplog: pytest.LogCaptureFixture, damage: Callable[[Path], None], reason: str
) -> None:
    older, damaged = CheckpointStore(root).labels()
    damage(root)
    with caplog.at_level(logging.WARNING, logger="adaptdl.core.persist.checkpoint"):
        adl.init_process_group("gloo")
    assert _context.current_job().restored_from == older
    (warning,) = [
        r.getMessage() for r in caplog.records if r.name == "adaptdl.core.persist.checkpoint"
    ]
    assert reason in warning and str(root / damaged) in warning
    assert f"falling back to the older checkpoint {older}" in warning


@pytest.mark.parametrize(("damage", "reason"), DAMAGES, ids=[d.__name__ for d, _ in DAMAGES])
def test_when_every_checkpoint_is_damaged_start_fails_naming_what_and_where(
    root: Path, damage: Callable[[Path], None], reason: str
) -> None:
    older = root / CheckpointStore(root).labels()[0]
    damage(root)
    (older / MANIFEST).write_text("{ not json")
    with pytest.raises(CheckpointError) as info:
        adl.init_process_group("gloo")
    message = str(info.value)
    assert reason in message and "manifest.json is not valid JSON" in message
    assert f"'{older}'" in message and "Remove" in message


def test_a_checkpoint_of_another_job_is_refused_at_start(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    CheckpointStore(root, job_id="job-a").save({"x": b"1"})  # newest: another job's
    monkeypatch.setenv("ADAPTDL_JOB_ID", "job-b")
    with pytest.raises(CheckpointError) as info:
        adl.init_process_group("gloo")
    message = str(info.value)
    assert "belongs to job 'job-a', not to this job 'job-b'" in message
    assert "belongs to job None" in message  # the older ones were written without a job id
    assert f"'{root}" in message and "Remove" in message


def test_resuming_a_loop_over_a_dataset_of_another_length_is_refused(root: Path) -> None:
    with pytest.raises(CheckpointError) as info:
        train(stop_after=None, n=N + 4)
    message = str(info.value)
    assert f"dataset of {N} samples" in message and f"now has {N + 4}" in message
    assert "dataset changed since the checkpoint" in message
    assert f"remove '{root}'" in message
    # With the original dataset, the job resumes and finishes.
    train(stop_after=None)


# -- a crafted pickle payload -------------------------------------------------------------


def crafted_torch_file(reference: bytes, marker: Path) -> bytes:
    """``reference`` (a torch.save zip) with its pickle replaced by os.system("touch marker").

    The pickle is written opcode by opcode; nothing here pickles or unpickles.
    """
    payload = b"cposix\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."
    out = io.BytesIO()
    with (
        zipfile.ZipFile(io.BytesIO(reference)) as src,
        zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst,
    ):
        for info in src.infolist():
            data = payload if info.filename.endswith("/data.pkl") else src.read(info)
            dst.writestr(info.filename, data)
    return out.getvalue()


def rewrite_entry(checkpoint: Path, prefix: str, data: bytes) -> None:
    """Replace an entry and rewrite the manifest to match, as an attacker could."""
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    (name,) = [name for name in manifest["entries"] if name.startswith(prefix)]
    record = manifest["entries"][name]
    (checkpoint / record["file"]).write_bytes(data)
    record["size"] = len(data)
    record["sha256"] = hashlib.sha256(data).hexdigest()
    del manifest["digest"]
    manifest["digest"] = hashlib.sha256(encode(manifest)).hexdigest()
    (checkpoint / MANIFEST).write_bytes(encode(manifest))


def test_a_crafted_pickle_in_the_model_entry_with_a_matching_manifest_never_runs(
    root: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    checkpoint = newest(root)
    reference = entry_file(checkpoint, "adaptdl-dataparallel").read_bytes()
    rewrite_entry(checkpoint, "adaptdl-dataparallel", crafted_torch_file(reference, marker))
    assert CheckpointStore(root).load() is not None  # the store's checks all pass
    adl.init_process_group("gloo")
    with pytest.raises(CheckpointError) as info:
        adl.AdaptiveDataParallel(torch.nn.Linear(2, 1), torch.optim.SGD([torch.zeros(1)], lr=1))
    message = str(info.value)
    assert "weights_only=True" in message and "posix.system" in message  # refused, not broken
    assert f"'{checkpoint}'" in message and "Remove that checkpoint directory" in message
    assert not marker.exists()


def test_a_json_entry_that_decodes_but_is_not_the_state_is_a_clear_error(root: Path) -> None:
    checkpoint = newest(root)
    rewrite_entry(checkpoint, "adaptdl-dataloader", b'{"current_index": -5}')
    adl.init_process_group("gloo")
    with pytest.raises(CheckpointError) as info:
        adl.AdaptiveDataLoader(dataset(), batch_size=4)
    message = str(info.value)
    assert f"checkpoint '{checkpoint}': its entry 'adaptdl-dataloader-0'" in message
    assert "KeyError" in message or "ValueError" in message
