"""The job's environment, as the functions programs written for the original AdaptDL call.

Once the job has started (`adaptdl.torch.init_process_group`, or the first
adaptdl.torch object made), each function answers from the job's configuration
(`Job.config`), read from the environment once at start: a variable changed
later changes nothing, as it changes nothing else in the job. Before, it answers
from :meth:`adaptdl.core.config.JobConfig.from_env` at the time of the call, as
the original did (so a program that sets a variable before asking sees it). Under
torchrun the replica's place in the job comes from torchrun's variables; the
``ADAPTDL_*`` variables a scheduler sets win over them (see `adaptdl.core.config`):

======================  ==================================  ==========================
function                value                               when nothing is set
======================  ==================================  ==========================
`replica_rank`          ``ADAPTDL_REPLICA_RANK``, ``RANK``  0
`num_replicas`          ``ADAPTDL_NUM_REPLICAS``,           1
                        ``WORLD_SIZE``
`num_nodes`             ``ADAPTDL_NUM_NODES``,              ceil(replicas /
                        ``GROUP_WORLD_SIZE``                ``LOCAL_WORLD_SIZE``)
`num_restarts`          ``ADAPTDL_NUM_RESTARTS``,           0
                        ``TORCHELASTIC_RESTART_COUNT``
`checkpoint_path`       ``ADAPTDL_CHECKPOINT_PATH``         None
`share_path`            ``ADAPTDL_SHARE_PATH``              None
`job_id`                ``ADAPTDL_JOB_ID``                  None
`master_addr`           ``MASTER_ADDR`` (torchrun's)        ``"0.0.0.0"``
`master_port`           ``MASTER_PORT`` (torchrun's)        0
======================  ==================================  ==========================

Three functions name concepts that torchrun has no counterpart for, and answer
as a job outside the original's scheduler did: `supervisor_url` and
`adaptdl_sched_version` are None (rank 0 is found by torchrun's rendezvous, not
by asking a supervisor) and `from_ray` is False (there is no Ray Tune
integration). A malformed value raises ValueError naming the variable.
"""

from __future__ import annotations

from adaptdl.core.config import JobConfig
from adaptdl.torch import _context

__all__ = [
    "adaptdl_sched_version",
    "checkpoint_path",
    "from_ray",
    "job_id",
    "master_addr",
    "master_port",
    "num_nodes",
    "num_replicas",
    "num_restarts",
    "replica_rank",
    "share_path",
    "supervisor_url",
]

# What the original answered for an unset rendezvous address and port.
_ANY_ADDRESS = "0.0.0.0"


def _config() -> JobConfig:
    """The running job's configuration; before the job starts, the environment's now."""
    if _context.is_initialized():
        return _context.current_job().config
    return JobConfig.from_env()


def checkpoint_path() -> str | None:
    """The checkpoint directory, or None when checkpoints are off."""
    return _config().checkpoint_path


def share_path() -> str | None:
    """A directory every replica of the job shares (datasets, artefacts), or None if unset."""
    return _config().share_path


def job_id() -> str | None:
    """The job's name, which tells its checkpoints apart from other jobs', or None if unset."""
    return _config().job_id


def master_addr() -> str:
    """The address of the rank 0 replica's rendezvous, ``"0.0.0.0"`` when none is set."""
    return _config().master_addr or _ANY_ADDRESS


def master_port() -> int:
    """The port of the rank 0 replica's rendezvous, 0 when none is set."""
    return _config().master_port or 0


def replica_rank() -> int:
    """This replica's rank, from 0 to `num_replicas` - 1."""
    return _config().topology.rank


def num_replicas() -> int:
    """The number of replicas (processes) in the job."""
    return _config().topology.num_replicas


def num_nodes() -> int:
    """The number of distinct nodes the replicas run on."""
    return _config().topology.num_nodes


def num_restarts() -> int:
    """How many times the job has been restarted (0 for its first run)."""
    return _config().topology.num_restarts


def supervisor_url() -> str | None:
    """None: torchrun's rendezvous takes the place of the original scheduler's supervisor."""
    return None


def adaptdl_sched_version() -> str | None:
    """None: no AdaptDL scheduler launches the job, so there is no scheduler version to check."""
    return None


def from_ray() -> bool:
    """False: jobs run under torchrun, never inside a Ray Tune trial."""
    return False
