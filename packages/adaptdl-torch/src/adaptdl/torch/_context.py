"""The process's default job: process groups, checkpoint store, stop signals.

Core keeps no module-level state; a training process has exactly one job, and the
torch adapter holds it here so that the seed's free functions
(``remaining_epochs_until``, ``current_dataloader``) can find it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import attrs

import torch
import torch.distributed as dist
from adaptdl.core.config import JobConfig
from adaptdl.core.job import Job
from adaptdl.core.loop.boundary import CheckpointPolicy
from adaptdl.core.persist.checkpoint import CheckpointStore
from adaptdl.core.persist.journal import Journal, journal_name
from adaptdl.core.persist.localfs import LocalShare, LocalStorage
from adaptdl.core.persist.shardedfiles import ShardedCheckpointStore
from adaptdl.core.persist.storage import StagingStorage, Storage
from adaptdl.core.stats.estimators import ESTIMATORS, EstimatorFactory
from adaptdl.core.stats.metrics import MetricsConfig
from adaptdl.core.topology import Topology
from adaptdl.torch import _log, _release, _signals
from adaptdl.torch.collective import TorchCollective, collective_timeout
from adaptdl.torch.rng import RngState

__all__ = ["current_job", "init_process_group", "is_initialized"]

LOG = logging.getLogger("adaptdl.torch")

_job: Job | None = None
_gloo_group: Any = None
_owns_process_group = False
_locked: Storage | None = None  # the checkpoint storage rank 0 holds for the job
_implicit_backend: str | None = None  # set when current_job() initialised the job itself


def is_initialized() -> bool:
    """Whether `init_process_group` has run in this process."""
    return _job is not None


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    world_size: int | None = None,
    rank: int | None = None,
    *,
    timeout: timedelta | None = None,
    storage: Storage | None = None,
    metrics_config: MetricsConfig | None = None,
    estimators: Mapping[str, EstimatorFactory] | None = None,
) -> None:
    """Join the job: set up ``torch.distributed``, the default job and its checkpoints.

    ``backend`` defaults to ``"nccl"`` when CUDA is available, else ``"gloo"``. Under
    ``torchrun`` the rendezvous comes from its environment variables; ``python
    train.py`` runs as one replica with an in-process store. If the default process
    group already exists it is used as is. Small values travel over a separate gloo
    group (the default group when it is gloo). ``init_method``, ``world_size`` and
    ``rank`` are the original AdaptDL's positional parameters: ``init_method`` names
    a rendezvous (e.g. ``tcp://host:port``) when torchrun's variables are absent;
    ``world_size`` and ``rank``, if given, must agree with the environment. ``timeout`` (default
    ``ADAPTDL_COLLECTIVE_TIMEOUT`` seconds, 300) bounds every collective.

    Checkpoints go to ``storage``, by default a directory named by
    ``ADAPTDL_CHECKPOINT_PATH`` (no checkpoints when unset); the newest checkpoint
    there is loaded now, by rank 0, and every replica restores that same one. Rank 0
    holds the storage's lock for the job's life: a second job
    on it is refused (`adaptdl.core.persist.storage.StorageLocked`), and a relaunch of the
    same job waits up to ``ADAPTDL_COLLECTIVE_TIMEOUT`` seconds for its previous run
    to let go. Every environment variable is read here, once, by
    `adaptdl.core.config.JobConfig.from_env`, into the job's `Job.config` (with
    ``timeout``, where given, as its collective timeout); nothing reads the
    environment afterwards. SIGTERM makes every
    replica checkpoint at the next optimiser step and exit with status 143, SIGINT
    likewise with 130; outside a training loop the replicas stop together at the next
    point they all reach, within ``ADAPTDL_STOP_WAIT`` seconds (see
    `adaptdl.torch._signals`).

    ``metrics_config`` (`adaptdl.core.stats.metrics.MetricsConfig`) picks the
    gradient-noise estimator by name from ``estimators`` (default
    `adaptdl.core.stats.estimators.ESTIMATORS`) and configures the EXPERIMENTAL loss
    floor (`report_loss`); by default core's estimator and the floor on.

    When an adaptdl.torch object made before this call (an `AdaptiveDataLoader`,
    the seed tutorial's order) already initialised the job with the default
    backend, this call only checks that it asks for nothing else.

    Raises RuntimeError when called twice (or, after an implicit initialisation,
    with another backend or any other argument), and ValueError for an unknown
    backend or inconsistent environment variables.
    """
    global _job, _gloo_group, _owns_process_group, _locked
    if _job is not None:
        _check_placement(_job.topology, world_size, rank)
        _accept_after_implicit(
            backend,
            timeout,
            init_method,
            storage,
            metrics_config=metrics_config,
            estimators=estimators,
        )
        return
    config = JobConfig.from_env(os.environ)  # the one read of the environment
    _log.configure(config.log_level)
    topology = config.topology
    _check_placement(topology, world_size, rank)
    if timeout is None:
        timeout = collective_timeout(config)
    else:
        # The job's config says what its collectives wait: the timeout given here.
        config = attrs.evolve(config, collective_timeout=timeout.total_seconds())
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl", "mpi", "ucc", "xccl"):
        raise ValueError(
            f"backend must be 'gloo' or 'nccl' (or None for automatic), got {backend!r}"
        )
    if not dist.is_initialized():
        _init_default_group(backend, config, timeout, init_method)
        _owns_process_group = True
    if dist.get_world_size() != topology.num_replicas or dist.get_rank() != topology.rank:
        raise ValueError(
            f"torch.distributed has rank {dist.get_rank()} of {dist.get_world_size()} but the "
            f"environment says rank {topology.rank} of {topology.num_replicas}: set RANK and "
            "WORLD_SIZE consistently (torchrun does)"
        )
    if topology.num_replicas > 1:
        _release.register_settle_at_exit()
    if dist.get_backend() == "gloo":
        _gloo_group = None  # the default group
    else:
        _gloo_group = dist.new_group(backend="gloo", timeout=timeout)
    collective = TorchCollective(_gloo_group)
    store: CheckpointStore | None = None
    journal = None
    policy = CheckpointPolicy.from_config(config)
    if storage is None and config.checkpoint_path is not None:
        storage = LocalStorage(config.checkpoint_path, owner=config.job_id or "")
    if storage is not None:
        if isinstance(storage, StagingStorage):
            # Staging lets sharded states (FSDP2) write their files into the checkpoint.
            store = ShardedCheckpointStore(storage, job_id=config.job_id)
        else:
            store = CheckpointStore(storage, job_id=config.job_id)
        store.check_writable()
        if topology.rank == 0:
            # The other replicas wait for rank 0 in the restore's collective: give up on
            # the lock well within its timeout, so that they see StorageLocked's message
            # rather than a collective timeout.
            storage.lock(wait=0.8 * timeout.total_seconds())
            _locked = storage
        # Beside the checkpoints (not inside one), one per job: counts what a crash replays.
        journal = Journal(storage, journal_name(config.job_id))
    try:
        _job = Job(
            topology,
            collective=collective,
            store=store,
            checkpoint_policy=policy,
            journal=journal,
            allow_missing_state=config.allow_missing_state,
            stop_wait=config.stop_wait,
            # Under a scheduler: rank 0 reports the job's hints and progress there.
            share=LocalShare(config.share_path) if config.share_path is not None else None,
            report_interval=config.report_interval,
            config=config,
            metrics_config=metrics_config,
            estimators=ESTIMATORS if estimators is None else estimators,
        )
    except BaseException:
        # A failed restore must not leave this process holding the directory: a retry
        # in it would wait on its own lock.
        if _locked is not None:
            _locked.unlock()
            _locked = None
        raise
    _job.register(RngState(_job), allow_missing=True)  # checkpoints older than RNG states
    collective.failed = _job.collective_failed
    _signals.install(lambda: _job)


def _check_placement(topology: Topology, world_size: int | None, rank: int | None) -> None:
    """ValueError unless the seed's ``world_size``/``rank`` agree with the environment."""
    for name, given, actual in (
        ("world_size", world_size, topology.num_replicas),
        ("rank", rank, topology.rank),
    ):
        if given is not None and given != actual:
            raise ValueError(
                f"init_process_group({name}={given!r}) disagrees with the environment, which "
                f"says {actual} (torchrun's RANK/WORLD_SIZE or ADAPTDL_REPLICA_RANK/"
                f"ADAPTDL_NUM_REPLICAS); omit {name} or launch with matching settings"
            )


def _accept_after_implicit(
    backend: str | None,
    timeout: timedelta | None,
    init_method: str | None,
    storage: Storage | None,
    **more: Any,
) -> None:
    """Accept an explicit call that repeats what the implicit initialisation did."""
    global _implicit_backend
    implicit = _implicit_backend
    if implicit is None:
        raise RuntimeError("adaptdl.torch.init_process_group() was already called in this process")
    given = {"timeout": timeout, "init_method": init_method, "storage": storage, **more}
    extra = [name for name, value in given.items() if value is not None]
    if (backend is not None and backend != implicit) or extra:
        asked = f"backend={backend!r}" if not extra else ", ".join(extra)
        raise RuntimeError(
            f"adaptdl.torch.init_process_group({asked}) comes after an adaptdl.torch object "
            f"(e.g. an AdaptiveDataLoader) initialised the job with backend={implicit!r} and "
            "default settings: call init_process_group before making adaptdl.torch objects"
        )
    _implicit_backend = None  # now explicitly initialised: a further call is an error
    LOG.info("adaptdl.torch.init_process_group(%r): already initialised with it", implicit)


def _init_default_group(
    backend: str, config: JobConfig, timeout: timedelta, init_method: str | None
) -> None:
    topology = config.topology
    restart = config.elastic_restart
    if init_method is None and config.master_addr is not None and restart is not None:
        # torchrun keeps one rendezvous store for all restarts of a launch; keys of the
        # attempt that died (gloo's peer addresses) would be read by the next one, whose
        # replicas then connect to dead ports. Each attempt gets its own key prefix.
        assert config.master_port is not None  # read with master_addr
        tcp = dist.TCPStore(  # type: ignore[attr-defined]
            config.master_addr,
            config.master_port,
            topology.num_replicas,
            is_master=not config.use_agent_store and topology.rank == 0,
            timeout=timeout,
            multi_tenant=True,
        )
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"adaptdl/attempt-{restart}", tcp),  # type: ignore[attr-defined]
            rank=topology.rank,
            world_size=topology.num_replicas,
            timeout=timeout,
        )
        return
    if init_method is not None or config.master_addr is not None:
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=topology.rank,
            world_size=topology.num_replicas,
            timeout=timeout,
        )
        return
    if topology.num_replicas != 1:
        raise RuntimeError(
            f"{topology.num_replicas} replicas requested but no rendezvous is configured "
            "(MASTER_ADDR is unset): launch with torchrun, or pass init_method to "
            "adaptdl.torch.init_process_group()"
        )
    # One replica without a launcher: a process group of one over an in-process store.
    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)


def current_job() -> Job:
    """The process's job; initialises it (`init_process_group` with its defaults) if needed.

    A later explicit `init_process_group` asking for the same is accepted (the seed
    tutorial makes its loaders first). Raises RuntimeError when the environment
    describes several replicas but no rendezvous (torchrun's) is configured.
    """
    global _implicit_backend
    if _job is None:
        LOG.debug("adaptdl.torch.init_process_group() not called yet: initialising it now")
        init_process_group()
        _implicit_backend = dist.get_backend()
    assert _job is not None
    return _job


def _reset() -> None:
    """Forget the default job and tear down what `init_process_group` set up (for tests)."""
    global _job, _gloo_group, _owns_process_group, _locked, _implicit_backend
    _implicit_backend = None
    if _locked is not None:
        _locked.unlock()
        _locked = None
    _signals.restore()
    if _gloo_group is not None and dist.is_initialized():
        dist.destroy_process_group(_gloo_group)
    if _owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
    _job = None
    _gloo_group = None
    _owns_process_group = False
