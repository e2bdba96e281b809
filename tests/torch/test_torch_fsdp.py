"""AdaptiveFSDP and sharded checkpoints (issue 15): statistics equal to DDP's, checkpoints
resharded at another world size, and DCP metadata that would run code refused unrun."""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.fsdp import fully_shard
from torch.utils.data import TensorDataset

import adaptdl.torch as adl
import torch
from adaptdl.core.collective import decode, encode
from adaptdl.core.persist.checkpoint import CheckpointError
from adaptdl.core.persist.manifest import MANIFEST, digest
from adaptdl.core.persist.shardedfiles import FILES_ENTRY, ShardedCheckpointStore
from adaptdl.torch import _context
from adaptdl.torch.dcp import SafeLoadPlanner, read_metadata
from adaptdl.torch.fsdp import AdaptiveFSDP
from adaptdl.torch.launch import torchrun_command
from adaptdl.torch.scaling_rules import LinearScale

SCRIPT = Path(__file__).with_name("fsdp_replicas.py")


class Payload:
    """Unpickling this runs ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def test_adaptive_fsdp_is_exported_and_imported_only_when_used() -> None:
    """A DDP program (every replica of most launches) loads neither FSDP2, DTensor nor
    DCP; ``adaptdl.torch.AdaptiveFSDP`` is the class, and ``import *`` exports it."""
    code = (
        "import sys, adaptdl.torch as adl\n"
        "heavy = ('torch.distributed.checkpoint', 'torch.distributed.tensor',"
        " 'torch.distributed.fsdp', 'adaptdl.torch.fsdp')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "from adaptdl.torch import *\n"
        "from adaptdl.torch.fsdp import AdaptiveFSDP as Class\n"
        "print(AdaptiveFSDP is Class is adl.AdaptiveFSDP)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[]", "True"], done.stdout
    with pytest.raises(AttributeError, match="has no attribute 'AdaptiveFSPD'"):
        adl.AdaptiveFSPD  # noqa: B018


# --------------------------------------------------------------------- metadata, unit


def test_a_metadata_file_with_a_reduce_payload_is_refused_unrun(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match=r"\.metadata.*refused global posix\.system"):
        read_metadata(path)
    assert not marker.exists()


def test_a_payload_nested_inside_real_metadata_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(Metadata({}, planner_data=Payload(marker))))
    with pytest.raises(CheckpointError, match=r"refused global posix\.system"):
        read_metadata(path)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (pickle.dumps({"not": "metadata"}), "holds a dict"),
        (pickle.dumps(Metadata({}))[:-5], "cannot be read"),
        (pickle.dumps(eval), r"refused global builtins\.eval"),
    ],
)
def test_other_bad_metadata_is_a_checkpoint_error(
    tmp_path: Path, data: bytes, problem: str
) -> None:
    path = tmp_path / ".metadata"
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=problem):
        read_metadata(path)


def test_a_symlinked_metadata_file_is_not_followed(tmp_path: Path) -> None:
    (tmp_path / "real").write_bytes(pickle.dumps(Metadata({})))
    (tmp_path / ".metadata").symlink_to(tmp_path / "real")
    with pytest.raises(CheckpointError, match="missing or unreadable"):
        read_metadata(tmp_path / ".metadata")


def test_non_tensor_values_load_with_weights_only(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    planner = SafeLoadPlanner()
    planner.set_up_planner({"lr": 0.0}, Metadata({}), is_coordinator=True)
    item = ReadItem(
        LoadItemType.BYTE_IO,
        MetadataIndex("lr"),
        torch.Size(),
        MetadataIndex("lr"),
        torch.Size(),
        torch.Size(),
    )
    buffer = io.BytesIO()
    torch.save(0.25, buffer)
    buffer.seek(0)
    planner.load_bytes(item, buffer)
    assert planner.original_state_dict == {"lr": 0.25}
    buffer = io.BytesIO(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match="weights_only=True"):
        planner.load_bytes(item, buffer)
    assert not marker.exists()


# --------------------------------------------------------------------- one replica, in process


def data(n: int = 24) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=gen)
    return TensorDataset(torch.arange(n), x, x.sum(1, keepdim=True))


def build(
    with_loader: bool = True, background: bool = False
) -> tuple[Any, torch.nn.Module, Any, AdaptiveFSDP]:
    loader = None
    if with_loader:
        adl.init_process_group("gloo")
        loader = adl.AdaptiveDataLoader(data(), batch_size=4)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    fully_shard(model[0])
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    return loader, model, optimizer, AdaptiveFSDP(model, optimizer, async_checkpoint=background)


def full_params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]  # type: ignore[attr-defined]


def test_bad_arguments_are_refused() -> None:
    adl.init_process_group("gloo")
    plain = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="fully_shard"):
        AdaptiveFSDP(plain, torch.optim.SGD(plain.parameters(), lr=1))
    fully_shard(plain)
    with pytest.raises(TypeError, match="async_checkpoint"):
        AdaptiveFSDP(plain, torch.optim.SGD(plain.parameters(), lr=1), async_checkpoint=1)  # type: ignore[arg-type]


def train(net: Any, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(net(x), y).backward()
    optimizer.step()


def test_accumulated_micro_batches_take_one_full_batch_step() -> None:
    adl.init_process_group("gloo")
    dataset = data(32)
    loader = adl.AdaptiveDataLoader(dataset, batch_size=16)
    loader.autoscale_batch_size(32, (1, 16), gradient_accumulation=True)
    _context.current_job().batch_size_decision = lambda query: (4, 3)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    reference = copy.deepcopy(model)
    fully_shard(model[0])
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = AdaptiveFSDP(model, optimizer, scaling_rule=LinearScale())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    steps, batch = 0, []
    for _ in adl.remaining_epochs_until(1):
        for idx, x, y in loader:
            batch.append(idx)
            train(wrapped, optimizer, x, y)
            helper = adl.current_dataloader()
            if helper is not None and helper.is_optim_step():
                steps += 1
                _, whole_x, whole_y = dataset[torch.cat(batch)]
                batch = []
                train(reference, ref_opt, whole_x, whole_y)  # the whole batch at once
                for p, q in zip(full_params(model), reference.parameters(), strict=True):
                    torch.testing.assert_close(p, q.detach())
    assert steps == 2
    assert wrapped.gns is not None and wrapped.gns.num_updates == 2


def test_gradients_of_a_loop_left_mid_accumulation_belong_to_no_step() -> None:
    adl.init_process_group("gloo")
    loader = adl.AdaptiveDataLoader(data(32), batch_size=16)
    loader.autoscale_batch_size(32, (1, 16), gradient_accumulation=True)
    _context.current_job().batch_size_decision = lambda query: (4, 3)
    _, _, optimizer, wrapped = build(with_loader=False)
    for epoch in adl.remaining_epochs_until(2):
        for i, (_, x, y) in enumerate(loader):
            optimizer.zero_grad()
            if epoch == 1:  # the new loop starts from clean gradients, unsharded ones too
                assert wrapped._unsharded and all(p.grad is None for p in wrapped._unsharded)
            torch.nn.functional.mse_loss(wrapped(x), y).backward()
            optimizer.step()
            if epoch == 0 and i == 1:
                assert any(p.grad is not None for p in wrapped._unsharded)
                break  # two micro-batches accumulated, unreduced
            if epoch == 1:
                break


def test_a_sharded_grad_scaler_scales_and_unscales_the_statistics() -> None:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    adl.init_process_group("gloo")
    loader = adl.AdaptiveDataLoader(data(), batch_size=4)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    wrapped = AdaptiveFSDP(model, optimizer, mp_scaler=scaler)
    plain = copy.deepcopy(wrapped.gns)
    for _ in adl.remaining_epochs_until(1):
        for _idx, x, y in loader:
            optimizer.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(wrapped(x), y)).backward()
            scaler.step(optimizer)
            scaler.update()
    assert scaler.get_scale() > 2.0**10 and wrapped.progress == 6
    assert plain is None and wrapped.gns is not None
    # Unscaled: the estimate is of the gradient, not of 2**10 times it.
    assert 0 < wrapped.gns.var < 1e4


def test_a_checkpoint_of_an_optimizer_without_state_is_no_training_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCP steps an optimiser that has no state, with zero gradients, to create it."""
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path))
    loader, model, optimizer, wrapped = build()
    for _ in adl.remaining_epochs_until(1):
        for _idx, x, y in loader:
            train(wrapped, optimizer, x, y)
            optimizer.zero_grad()
            optimizer.state.clear()  # as a stateless optimiser has none
            progress, params = wrapped.progress, full_params(model)
            _context.current_job().checkpoint()
            assert wrapped.progress == progress > 0
            assert all(torch.equal(a, b) for a, b in zip(full_params(model), params, strict=True))
            break


def checkpoint_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, background: bool = False
) -> list[torch.Tensor]:
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path / "ck"))
    loader, model, optimizer, wrapped = build(background=background)
    for _ in adl.remaining_epochs_until(1):
        for _idx, x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(wrapped(x), y).backward()
            optimizer.step()
    assert wrapped.gns is not None and wrapped.progress > 0
    # The finished epoch loop wrote its final checkpoint, ckpt-000001.
    saved = full_params(model)
    _context._reset()
    return saved


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_a_restart_restores_the_sharded_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, background: bool
) -> None:
    saved = checkpoint_one(tmp_path, monkeypatch, background)
    _, model, optimizer, _ = build()
    assert _context.current_job().restored_from == "ckpt-000001"
    for a, b in zip(full_params(model), saved, strict=True):
        assert torch.equal(a, b)
    assert all(s["step"] > 0 for s in optimizer.state.values())


def test_the_background_writers_group_waits_the_timeout_the_job_started_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path))
    monkeypatch.setenv("ADAPTDL_COLLECTIVE_TIMEOUT", "7")
    loader, _, optimizer, wrapped = build(background=True)
    monkeypatch.setenv("ADAPTDL_COLLECTIVE_TIMEOUT", "9")  # after start: changes nothing
    timeouts = []
    new_group = dist.new_group

    def recording_new_group(*args: Any, **kwargs: Any) -> Any:
        timeouts.append(kwargs.get("timeout"))
        return new_group(*args, **kwargs)

    monkeypatch.setattr(dist, "new_group", recording_new_group)
    for _ in adl.remaining_epochs_until(1):
        for _idx, x, y in loader:
            train(wrapped, optimizer, x, y)
    # The final checkpoint made the writing thread's group.
    assert _context.current_job().checkpoints_written == 1
    assert timeouts == [timedelta(seconds=7)]


def _rewrite(checkpoint: Path, file: str, data: bytes) -> None:
    """Replace ``file`` and re-hash the listing and the manifest, as an attacker would."""
    (checkpoint / file).write_bytes(data)
    manifest = decode((checkpoint / MANIFEST).read_bytes())
    record = manifest["entries"][FILES_ENTRY]
    listing = decode((checkpoint / record["file"]).read_bytes())
    state, name = file.split("/")
    listing["files"][state][name] = [len(data), hashlib.sha256(data).hexdigest()]
    raw = encode(listing)
    (checkpoint / record["file"]).write_bytes(raw)
    record.update(size=len(raw), sha256=hashlib.sha256(raw).hexdigest())
    del manifest["digest"]
    manifest["digest"] = digest(manifest)
    (checkpoint / MANIFEST).write_bytes(encode(manifest))


def test_a_crafted_checkpoint_is_refused_without_running_its_payload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint_one(tmp_path, monkeypatch)
    marker = tmp_path / "ran"
    _rewrite(
        tmp_path / "ck" / "ckpt-000001", "adaptdl-fsdp/.metadata", pickle.dumps(Payload(marker))
    )
    with pytest.raises(CheckpointError, match=r"\.metadata.*refused global posix\.system"):
        build()
    assert not marker.exists()


def test_a_damaged_shard_is_detected_and_never_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint_one(tmp_path, monkeypatch)
    shard = tmp_path / "ck" / "ckpt-000001" / "adaptdl-fsdp" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp"):
        build()


# --------------------------------------------------------------------- torchrun


def torchrun(
    mode: str, nproc: int, out: Path, *, check: bool = True, **env: str
) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    command = torchrun_command(SCRIPT, nproc, args=[mode, str(out)])
    done = subprocess.run(command, env=full_env, capture_output=True, text=True, timeout=240)
    if check:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def results(out: Path, mode: str, rank: int = 0) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((out / f"{mode}-rank{rank}.json").read_text())
    return loaded


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("adam", "hsdp"),
    [(False, False), (True, False), (False, True)],
    ids=["SGD-AdaScale", "Adam-AdamScale", "HSDP"],
)
def test_noise_statistics_under_fsdp2_equal_those_under_ddp(
    tmp_path: Path, adam: bool, hsdp: bool
) -> None:
    # HSDP (a replicate dimension): each shard is held by several replicas, and its
    # square counts once in the reduced gradient's norm.
    env = {"FSDP_ADAM": "1"} if adam else {}
    if hsdp:
        env["FSDP_HSDP"] = "1"
    torchrun("ddp", 2, tmp_path, **env)
    torchrun("fsdp", 2, tmp_path, **env)
    ddp, fsdp = results(tmp_path, "ddp"), results(tmp_path, "fsdp")
    assert fsdp["updates"] == ddp["updates"] > 0
    assert fsdp["progress"] == pytest.approx(ddp["progress"], rel=1e-6)
    for key in ("sqr", "var"):
        assert len(fsdp[key]) == 2  # per parameter group
        assert fsdp[key] == pytest.approx(ddp[key], rel=1e-5), key
    for a, b in zip(fsdp["params"], ddp["params"], strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    assert results(tmp_path, "fsdp", 1)["sqr"] == fsdp["sqr"]
    if adam:
        assert fsdp["floor"] is None and ddp["floor"] is None  # no loss reported
    else:
        # report_loss folds the losses alike under both wrappers: each optimiser step
        # those reported since the last one (every micro-batch is reported after its
        # step call, so the first step folds its first micro-batch's).
        assert fsdp["floor"]["steps"] == ddp["floor"]["steps"] == fsdp["steps"] > 0
        assert fsdp["floor"]["loss_sum"] == pytest.approx(ddp["floor"]["loss_sum"], rel=1e-5)


@pytest.mark.e2e
def test_bf16_fsdp2_measures_finite_statistics(tmp_path: Path) -> None:
    torchrun("fsdp", 2, tmp_path, FSDP_BF16="1")
    fsdp = results(tmp_path, "fsdp")
    assert fsdp["updates"] > 0 and all(v > 0 for v in fsdp["sqr"] + fsdp["var"])


@pytest.mark.e2e
def test_a_sharded_checkpoint_of_2_replicas_restores_resharded_on_3(tmp_path: Path) -> None:
    env = {"ADAPTDL_CHECKPOINT_PATH": str(tmp_path / "ck")}
    torchrun("save", 2, tmp_path, **env)
    files = sorted(os.listdir(tmp_path / "ck" / "ckpt-000001" / "adaptdl-fsdp"))
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one per replica
    torchrun("load", 3, tmp_path, **env)
    saved = results(tmp_path, "save")
    assert_restored(tmp_path, 3, "ckpt-000001", saved)
    assert results(tmp_path, "load", 2)["lr"] == saved["lr"] == [0.005]


def assert_restored(out: Path, nproc: int, label: str, saved: dict[str, Any]) -> None:
    """Every replica of ``load`` restored ``label``, holding the model and optimiser ``saved``."""
    for rank in range(nproc):
        loaded = results(out, "load", rank)
        assert loaded["restored"] == label
        assert loaded["model"] == saved["model"]
        assert loaded["optim"] == saved["optim"] and saved["optim"]


@pytest.fixture(scope="module")
def stopped_in_flight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 replicas, checkpoints in the background, each write slowed by a second: a
    checkpoint at the second step, SIGTERM while it is written, a stop checkpoint."""
    out = tmp_path_factory.mktemp("async-stop")
    done = torchrun(
        "async-stop",
        2,
        out,
        check=False,
        ADAPTDL_CHECKPOINT_PATH=str(out / "ck"),
        FSDP_SLOW_WRITE="1",
    )
    assert "exitcode: 143" in done.stderr.replace("  ", " "), done.stderr[-3000:]
    return out


def copy_checkpoints(source: Path, tmp_path: Path) -> dict[str, str]:
    shutil.copytree(source / "ck", tmp_path / "ck")
    return {"ADAPTDL_CHECKPOINT_PATH": str(tmp_path / "ck"), "FSDP_COUNT_CHECKS": "1"}


def checked(out: Path, nproc: int) -> list[str]:
    return sorted(name for rank in range(nproc) for name in results(out, "load", rank)["checked"])


def distcp_files(label: str) -> list[str]:
    return [
        f"{label}/adaptdl-fsdp/{name}" for name in (".metadata", "__0_0.distcp", "__1_0.distcp")
    ]


@pytest.mark.e2e
def test_a_checkpoint_in_flight_at_a_stop_is_committed_and_restored_resharded(
    stopped_in_flight: Path, tmp_path: Path
) -> None:
    env = copy_checkpoints(stopped_in_flight, tmp_path)
    store = ShardedCheckpointStore(tmp_path / "ck")
    assert store.labels() == ["ckpt-000001", "ckpt-000002"]  # the one in flight, the stop's
    for label in store.labels():
        store.load_label(label)  # complete: every file matches its record
    torchrun("load", 3, tmp_path, **env)
    assert_restored(tmp_path, 3, "ckpt-000002", results(stopped_in_flight, "async-stop"))
    # Each file hashed by one replica, not by all three.
    assert checked(tmp_path, 3) == sorted(distcp_files("ckpt-000002"))


@pytest.mark.e2e
def test_a_damaged_shard_makes_every_replica_fall_back(
    stopped_in_flight: Path, tmp_path: Path
) -> None:
    env = copy_checkpoints(stopped_in_flight, tmp_path)
    shard = tmp_path / "ck" / "ckpt-000002" / "adaptdl-fsdp" / "__1_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    torchrun("load", 3, tmp_path, **env)
    assert [results(tmp_path, "load", r)["restored"] for r in range(3)] == ["ckpt-000001"] * 3
    assert checked(tmp_path, 3) == sorted(
        distcp_files("ckpt-000001") + distcp_files("ckpt-000002")
    )


@pytest.mark.e2e
def test_a_checkpoint_killed_in_flight_never_appears(tmp_path: Path) -> None:
    env = {"ADAPTDL_CHECKPOINT_PATH": str(tmp_path / "ck")}
    done = torchrun("async-kill", 2, tmp_path, check=False, FSDP_SLOW_WRITE="2", **env)
    assert done.returncode != 0
    assert ShardedCheckpointStore(tmp_path / "ck").labels() == ["ckpt-000001"]
    committed = results(tmp_path, "async-kill")  # written once ckpt-000001 was committed
    torchrun("load", 2, tmp_path, **env)
    assert_restored(tmp_path, 2, "ckpt-000001", committed)


@pytest.mark.e2e
def test_a_sharded_grad_scaler_skips_a_step_on_every_replica_when_one_shard_is_infinite(
    tmp_path: Path,
) -> None:
    torchrun("scaler", 2, tmp_path)
    ranks = [results(tmp_path, "scaler", rank) for rank in range(2)]
    for r in ranks:
        # Only replica 1's shard was infinite at the third step: both skip it.
        assert r["changed"] == [True, True, False] + [True] * 5
        assert r["scales"][1:3] == [2.0**12, 2.0**11]
        assert r["progress"] == 7 and all(v > 0 for v in r["var"] + r["sqr"])
    assert ranks[0]["scales"] == ranks[1]["scales"] and ranks[0]["var"] == ranks[1]["var"]


@pytest.mark.e2e
@pytest.mark.parametrize("reduce_fp16", [False, True], ids=["fp32", "fp16-reduce"])
def test_fsdp2s_flat_local_norms_equal_the_per_parameter_ones(
    tmp_path: Path, reduce_fp16: bool
) -> None:
    # fp16-reduce: FSDP2 divides the flat gradient before reducing it, so the first
    # measured step finds it unusable, is dropped, and the hooks measure from then on.
    env = {"FSDP_REDUCE_FP16": "1"} if reduce_fp16 else {}
    for out in ("hooks", "fused"):
        (tmp_path / out).mkdir()
        extra = {"FSDP_NORMS": "hooks"} if out == "hooks" else {}
        torchrun("norms", 2, tmp_path / out, **env, **extra)
    steps = 64 // 8
    for rank in range(2):
        hooks = results(tmp_path / "hooks", "norms", rank)
        fused = results(tmp_path / "fused", "norms", rank)
        assert hooks["fusable"] and fused["fusable"] and hooks["flats"] == []
        assert fused["armed"] == hooks["armed"] == 0  # no hook left armed after a step
        assert len(hooks["measured"]) == steps
        if reduce_fp16:
            # Both modules' flat gradients of the first step, then none.
            assert sorted(fused["flats"]) == [0, 1]
            expected = hooks["measured"][1:]
        else:
            # Two modules with parameters, one optimiser group each: two flat norms a step.
            assert sorted(fused["flats"]) == [0] * steps + [1] * steps
            expected = hooks["measured"]
        assert len(fused["measured"]) == len(expected)
        for f, h in zip(fused["measured"], expected, strict=True):
            assert f["local"] == pytest.approx(h["local"], rel=1e-6)
            assert f["total"] == pytest.approx(h["total"], rel=1e-6)
