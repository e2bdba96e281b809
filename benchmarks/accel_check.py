"""The prepared accelerator check: the NCCL path end to end, and GPU speed ratios.

Where CUDA exists it starts torchrun with one process per GPU (NCCL) and runs,
in one short go (about three minutes on one H200):

1. elastic: an adaptive job (``autoscale_batch_size`` with accumulation, AdaScale,
   bf16 autocast) that rank 0 stops with SIGTERM mid-epoch; every replica must
   checkpoint and exit 143; a second launch resumes from the checkpoint and
   finishes. Every sample of every epoch is checked consumed exactly once from
   the indices the training loops received. The same again with the model
   sharded by FSDP2 (``fully_shard``, bf16 parameters) under `AdaptiveFSDP`: its
   checkpoint is DCP shards that every replica writes, resharded on resume.
2. speed: `AdaptiveDataParallel` against ``DistributedDataParallel`` (step time of
   a ~50M-parameter MLP in bf16 autocast), and `AdaptiveDataLoader` against
   ``DataLoader`` (samples per second into GPU memory), in alternating rounds,
   printed as ratios (CUDA-synchronised wall time: the work is on the GPU).

Without CUDA it prints one "skipped" line and exits 0. ``--cpu`` runs the very
same code on CPU with gloo and 2 processes at toy sizes: the project's tests use
it to keep this script working on machines without a GPU.

    python3 benchmarks/accel_check.py              # on a GPU machine; no install needed
    python3 benchmarks/accel_check.py --cpu --quick

It needs torch, numpy, scipy and attrs; the adaptdl sources are taken from this
checkout when adaptdl is not installed. Figures go to stdout and, as JSON, to
``$OUT/accel_check.json`` when ``OUT`` is set (or ``--out FILE``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "packages" / f"adaptdl-{p}" / "src" for p in ("core", "torch", "sim")]
SIGTERM_EXIT = 128 + signal.SIGTERM


def _sources_env() -> dict[str, str]:
    """The environment for workers: this checkout's sources first on PYTHONPATH."""
    path = os.pathsep.join([*(str(s) for s in SOURCES), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path.rstrip(os.pathsep), "OMP_NUM_THREADS": "1"}


# -- workers (run under torchrun) -----------------------------------------------------


def _setup(cpu: bool) -> tuple[Any, Any]:
    import adaptdl.torch as adl
    import torch

    adl.init_process_group("gloo" if cpu else "nccl")
    if cpu:
        torch.set_num_threads(1)
        return torch.device("cpu"), torch.bfloat16
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    return torch.device("cuda", local), torch.bfloat16


class _Indexed:
    """A map-style dataset of (index, features, label) held in host memory."""

    def __init__(self, n: int, width: int, classes: int) -> None:
        import torch

        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, width, generator=gen)
        self.y = torch.randint(0, classes, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, Any, Any]:
        return i, self.x[i], self.y[i]


def _mlp(width: int, hidden: int, depth: int, classes: int) -> Any:
    import torch

    layers: list[Any] = [torch.nn.Linear(width, hidden), torch.nn.ReLU()]
    for _ in range(depth):
        layers += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(hidden, classes))
    return torch.nn.Sequential(*layers)


def worker_elastic(args: argparse.Namespace) -> None:
    """Adaptive training; rank 0 raises SIGTERM after ``--stop-after`` steps (run 0)."""
    import adaptdl.torch as adl
    import torch

    device, dtype = _setup(args.cpu)
    rank = int(os.environ["RANK"])
    n, width = (512, 16) if args.cpu else (65536, 256)
    dataset = _Indexed(n, width, 10)
    loader = adl.AdaptiveDataLoader(dataset, batch_size=32, shuffle=True, pin_memory=not args.cpu)
    loader.autoscale_batch_size(
        1024 if args.cpu else 8192, local_bsz_bounds=(16, 512), gradient_accumulation=True
    )
    torch.manual_seed(0)
    model = _mlp(width, 64 if args.cpu else 1024, 2, 10).to(device)
    if args.fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    adp: Any
    if args.fsdp:
        adp = adl.AdaptiveFSDP(model, optimizer)
    else:
        adp = adl.AdaptiveDataParallel(model, optimizer)
    record = Path(args.record) / f"run{args.attempt}-rank{rank}.jsonl"

    def train(out: Any) -> None:
        steps = 0
        for epoch in adl.remaining_epochs_until(args.epochs):
            for idx, x, y in loader:
                loss = _train_step(adp, optimizer, x, y, device, dtype)
                steps += 1
                helper = adl.current_dataloader()
                assert helper is not None
                entry = {
                    "epoch": epoch,
                    # The loop's index before this batch is counted: which pass of the
                    # epoch it belongs to (an adaptive epoch ends on statistical progress,
                    # so it may run into a second pass of the data).
                    "pass": helper.current_index // n,
                    "indices": idx.tolist(),
                    "batch_size": helper.current_batch_size,
                    "accumulation_steps": helper.accumulation_steps,
                    "gain": float(adp.gain),
                    "loss": float(loss),
                }
                out.write(json.dumps(entry) + "\n")
                out.flush()
                if args.attempt == 0 and rank == 0 and steps == args.stop_after:
                    os.kill(os.getpid(), signal.SIGTERM)

    with record.open("a", encoding="utf-8") as out:
        try:
            train(out)
        except SystemExit as exc:
            # The library turns SIGTERM into a checkpoint and SystemExit(143).
            out.write(json.dumps({"exit": exc.code}) + "\n")
            raise


def _train_step(net: Any, optimizer: Any, x: Any, y: Any, device: Any, dtype: Any) -> Any:
    """One optimiser step in autocast, the same on every side; returns the loss."""
    import torch

    x = x.to(device, non_blocking=True)
    y = y.to(device, non_blocking=True)
    with torch.autocast(device.type, dtype=dtype):
        loss = torch.nn.functional.cross_entropy(net(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _timed(fn: Any, device: Any) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def worker_speed(args: argparse.Namespace) -> None:
    """Alternating rounds: DDP against AdaptiveDataParallel, DataLoader against ours."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    import adaptdl.torch as adl
    import torch

    device, dtype = _setup(args.cpu)
    replicas = dist.get_world_size()
    width, hidden, depth = (16, 64, 2) if args.cpu else (1024, 4096, 3)
    local_bsz, steps = (16, 4) if args.cpu else (256, 20)
    n = local_bsz * replicas * steps
    dataset = _Indexed(n, width, 10)
    ids = [device.index] if device.type == "cuda" else None

    # The job's epochs that the adaptive side has run: one pass per timed call, never a
    # catch-up of the epochs that the other side's calls numbered.
    passes = [0]

    def build(adaptive: bool) -> Any:
        torch.manual_seed(0)
        model = _mlp(width, hidden, depth, 10).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        if adaptive:
            net = adl.AdaptiveDataParallel(model, optimizer, device_ids=ids)
            loader: Any = adl.AdaptiveDataLoader(
                dataset, batch_size=local_bsz * replicas, shuffle=True, pin_memory=not args.cpu
            )
        else:
            net = DistributedDataParallel(model, device_ids=ids)
            sampler = DistributedSampler(dataset, shuffle=True)
            loader = DataLoader(
                dataset, batch_size=local_bsz, sampler=sampler, pin_memory=not args.cpu
            )

        def one_epoch(epoch: int, one_pass: Any) -> None:
            if adaptive:
                # The job's epoch counts only this side's passes; driven by the shared
                # round counter, remaining_epochs_until would run every skipped epoch.
                for _ in adl.remaining_epochs_until(passes[0] + 1):
                    one_pass()
                passes[0] += 1
            else:
                sampler.set_epoch(epoch)
                one_pass()

        def train_pass() -> None:
            for _, x, y in loader:
                _train_step(net, optimizer, x, y, device, dtype)

        def load_pass() -> None:
            for _, x, _ in loader:
                x.to(device, non_blocking=True)

        return (lambda e: one_epoch(e, train_pass)), (lambda e: one_epoch(e, load_pass))

    sides = {"plain": build(False), "adaptive": build(True)}
    rounds = 2 if args.quick else 6
    times: dict[str, dict[str, list[float]]] = {
        kind: {side: [] for side in sides} for kind in ("step", "load")
    }
    epoch = 0
    for r in range(rounds + 1):  # round 0 warms up
        for side in list(sides) if r % 2 else list(sides)[::-1]:
            train_round, load_round = sides[side]
            for kind, fn in (("step", train_round), ("load", load_round)):
                dist.barrier()
                elapsed = _timed(lambda fn=fn, e=epoch: fn(e), device)
                epoch += 1
                if r:
                    times[kind][side].append(elapsed / (steps if kind == "step" else n))
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(times), flush=True)


# -- the launcher ------------------------------------------------------------------


def _torchrun(nproc: int, *worker_args: str, env: dict[str, str], timeout: float) -> Any:
    from adaptdl.torch.launch import torchrun_command

    command = torchrun_command(
        Path(__file__).resolve(), nproc, args=worker_args, monitor_interval=0.5
    )
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def _fail(what: str, done: Any) -> None:
    print(done.stdout[-4000:], done.stderr[-4000:], file=sys.stderr)
    raise SystemExit(f"accelerator check failed: {what} (torchrun exit {done.returncode})")


def check_elastic(nproc: int, cpu: bool, tmp: Path, fsdp: bool = False) -> dict[str, Any]:
    """Run 0 stopped by SIGTERM, run 1 resumes; exactly-once over every epoch.

    With ``fsdp`` the model is sharded by FSDP2 and checkpointed as DCP shards.
    """
    records = tmp / "records"
    records.mkdir()
    env = {**_sources_env(), "ADAPTDL_CHECKPOINT_PATH": str(tmp / "ckpt")}
    epochs = 2
    common = ["--worker=elastic", f"--record={records}", f"--epochs={epochs}"]
    if cpu:
        common.append("--cpu")
    if fsdp:
        common.append("--fsdp")
    started = time.perf_counter()
    first = _torchrun(nproc, *common, "--attempt=0", "--stop-after=5", env=env, timeout=300)
    stop_s = time.perf_counter() - started
    if first.returncode == 0:
        _fail("the run stopped by SIGTERM exited 0", first)
    started = time.perf_counter()
    second = _torchrun(nproc, *common, "--attempt=1", env=env, timeout=300)
    resume_s = time.perf_counter() - started
    if second.returncode != 0:
        _fail("the resumed run did not finish", second)
    seen: dict[tuple[int, int], collections.Counter[int]] = collections.defaultdict(
        collections.Counter
    )
    batch_sizes, gains, stop_exits = set(), [], []
    for path in records.glob("run*-rank*.jsonl"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if "exit" in entry:
                if path.name.startswith("run0-"):
                    stop_exits.append(entry["exit"])
                continue
            seen[entry["epoch"], entry["pass"]].update(entry["indices"])
            batch_sizes.add((entry["batch_size"], entry["accumulation_steps"]))
            gains.append(entry["gain"])
    n = 512 if cpu else 65536
    # Exactly once per pass: every pass but an epoch's last is whole; none repeats a
    # sample beyond the padding that keeps replicas in step (under one per replica).
    last = {e: max(p for ep, p in seen if ep == e) for e, _ in seen}
    whole = {(e, p) for e, p in seen if p < last[e]} | {(e, 0) for e in range(epochs)}
    lost = sum(n - len(seen[k]) for k in whole)
    repeated = sum(c - 1 for counts in seen.values() for c in counts.values() if c > 1)
    if stop_exits != [SIGTERM_EXIT] * nproc:
        raise SystemExit(f"accelerator check failed: replicas exited {stop_exits} on SIGTERM")
    if lost:
        raise SystemExit(f"accelerator check failed: {lost} samples lost across the restart")
    if repeated > (nproc - 1) * len(seen):
        raise SystemExit(f"accelerator check failed: {repeated} samples repeated in a pass")
    return {
        "model": "FSDP2" if fsdp else "DDP",
        "replicas": nproc,
        "samples_lost": lost,
        "samples_repeated_in_a_pass": repeated,
        "passes": len(seen),
        "batch_configs_seen": sorted(batch_sizes),
        "max_gain": max(gains),
        "stopped_run_s": round(stop_s, 1),
        "resumed_run_s": round(resume_s, 1),
    }


def check_speed(nproc: int, cpu: bool, quick: bool) -> dict[str, Any]:
    args = ["--worker=speed"] + (["--cpu"] if cpu else []) + (["--quick"] if quick else [])
    done = _torchrun(nproc, *args, env=_sources_env(), timeout=400)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        _fail("the speed workers failed", done)
    times = json.loads(lines[-1][len("RESULT ") :])
    step, load = times["step"], times["load"]
    return {
        "adp_over_ddp_step_time_best": min(step["adaptive"]) / min(step["plain"]),
        "adp_over_ddp_step_time_median": statistics.median(step["adaptive"])
        / statistics.median(step["plain"]),
        "ddp_step_ms_best": 1e3 * min(step["plain"]),
        "loader_throughput_ratio_best": min(load["plain"]) / min(load["adaptive"]),
        "loader_throughput_ratio_median": statistics.median(load["plain"])
        / statistics.median(load["adaptive"]),
        "dataloader_samples_per_s_best": 1 / min(load["plain"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run on CPU with gloo (toy sizes)")
    parser.add_argument("--quick", action="store_true", help="fewer speed rounds")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--worker", choices=["elastic", "speed"], help=argparse.SUPPRESS)
    parser.add_argument("--record", help=argparse.SUPPRESS)
    parser.add_argument("--fsdp", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--attempt", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--stop-after", type=int, default=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        (worker_elastic if args.worker == "elastic" else worker_speed)(args)
        return 0
    for src in reversed(SOURCES):
        sys.path.insert(0, str(src))
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("accelerator check skipped: no CUDA device (torch.cuda.is_available() is False)")
        return 0
    nproc = 2 if args.cpu else torch.cuda.device_count()
    device = "CPU (gloo)" if args.cpu else torch.cuda.get_device_name(0) + " (NCCL)"
    print(f"accelerator check: {nproc} x {device}, torch {torch.__version__}", flush=True)
    figures: dict[str, Any] = {"device": device, "processes": nproc, "torch": torch.__version__}
    with tempfile.TemporaryDirectory(prefix="adaptdl-accel-") as tmp:
        figures["elastic"] = check_elastic(nproc, args.cpu, Path(tmp))
    print("elastic:", json.dumps(figures["elastic"]), flush=True)
    with tempfile.TemporaryDirectory(prefix="adaptdl-accel-fsdp-") as tmp:
        figures["elastic_fsdp"] = check_elastic(nproc, args.cpu, Path(tmp), fsdp=True)
    print("elastic (FSDP2):", json.dumps(figures["elastic_fsdp"]), flush=True)
    figures["speed"] = check_speed(nproc, args.cpu, args.quick)
    speed = figures["speed"]
    print(
        f"speed: AdaptiveDataParallel / DDP step time {speed['adp_over_ddp_step_time_best']:.3f} "
        f"(median {speed['adp_over_ddp_step_time_median']:.3f}; DDP "
        f"{speed['ddp_step_ms_best']:.2f} ms/step); AdaptiveDataLoader / DataLoader "
        f"throughput {speed['loader_throughput_ratio_best']:.3f} "
        f"(median {speed['loader_throughput_ratio_median']:.3f})",
        flush=True,
    )
    out = args.out
    if out is None and "OUT" in os.environ:
        out = Path(os.environ["OUT"]) / "accel_check.json"
    if out is not None:
        out.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
