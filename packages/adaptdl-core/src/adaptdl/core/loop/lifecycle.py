"""The job's lifecycle lines: what an operator reads to follow a job.

Resumed from a checkpoint, a loop resumed mid-epoch, a checkpoint written, the
batch size changed, a stop requested. Each goes to the ``adaptdl.lifecycle``
logger at INFO; callers emit them on rank 0 only, so that a job of many replicas
prints each line once. The ``adaptdl`` logger's level (``ADAPTDL_LOG_LEVEL``,
default INFO) decides whether they show; the torch adapter attaches a handler of
its own when the program configured no logging (see ``adaptdl.torch._log``).
The texts live here, in one place, so that tests and documentation name them.
"""

from __future__ import annotations

import logging

from adaptdl.core.loop.boundary import EXIT_CODE_INTERRUPTED, EXIT_CODE_PREEMPTED

LOGGER_NAME = "adaptdl.lifecycle"
LOG = logging.getLogger(LOGGER_NAME)


def resumed(
    where: str, *, epoch: int, replicas: int, replicas_before: int | None, restart: int
) -> None:
    """The job resumed from checkpoint ``where`` with ``epoch`` epochs finished."""
    before = "" if replicas_before is None else f", written by {replicas_before}"
    LOG.info(
        "resumed from checkpoint %s at epoch %d on %d replica%s%s (restart %d)",
        where,
        epoch,
        replicas,
        "" if replicas == 1 else "s",
        before,
        restart,
    )


def loop_resumed(name: str, *, epoch: int, index: int, dataset_len: int) -> None:
    """Loop ``name`` resumes ``epoch`` at global sample ``index`` (its pass is index // n)."""
    LOG.info(
        "%s resumes epoch %d at sample index %d (pass %d of a %d-sample dataset)",
        name,
        epoch,
        index,
        index // dataset_len,
        dataset_len,
    )


def checkpoint_written(where: str, *, seconds: float, epoch: int | None, steps: int) -> None:
    """Checkpoint ``where`` was written in ``seconds`` (all replicas, barrier included)."""
    at = _at(epoch)
    LOG.info("checkpoint %s written in %.3f s %s, at step %d", where, seconds, at, steps)


def checkpoint_started(where: str, *, epoch: int | None, steps: int) -> None:
    """Checkpoint ``where`` was taken; its files are written in the background."""
    at = "between epochs" if epoch is None else f"in epoch {epoch}"
    LOG.info(
        "checkpoint %s started %s, at step %d: its files are saved in the background",
        where,
        at,
        steps,
    )


def batch_size_changed(
    name: str, *, local: int, micro_batches: int, replicas: int, total: int
) -> None:
    """``name``'s batch size is now ``local`` x ``micro_batches`` x ``replicas`` = ``total``."""
    LOG.info(
        "%s batch size %d local x %d micro-batch%s x %d replica%s = %d per optimiser step",
        name,
        local,
        micro_batches,
        "" if micro_batches == 1 else "es",
        replicas,
        "" if replicas == 1 else "s",
        total,
    )


def _cause(exit_code: int) -> str:
    return {EXIT_CODE_PREEMPTED: "SIGTERM", EXIT_CODE_INTERRUPTED: "SIGINT"}.get(
        exit_code, "requested"
    )


def _at(epoch: int | None) -> str:
    return "between epochs" if epoch is None else f"in epoch {epoch}"


def stopping(*, epoch: int | None, steps: int, exit_code: int) -> None:
    """A stop was requested (a signal): the job checkpoints now and exits with ``exit_code``.

    Said only where a checkpoint follows; `stopping_without_checkpoint` says the rest.
    """
    LOG.info(
        "stop requested (%s): checkpointing %s at step %d, then exiting with status %d",
        _cause(exit_code),
        _at(epoch),
        steps,
        exit_code,
    )


def stop_waits(*, epoch: int | None, steps: int, exit_code: int, seconds: float) -> None:
    """A stop outside any loop waits for a point every replica reaches, ``seconds`` at most."""
    LOG.info(
        "stop requested (%s) outside a loop %s at step %d: waiting up to %.0f s for every "
        "replica to reach the next loop's step boundary or the next epoch, to write a "
        "checkpoint there together; then exiting with status %d",
        _cause(exit_code),
        _at(epoch),
        steps,
        seconds,
        exit_code,
    )


def stopping_without_checkpoint(
    *, epoch: int | None, steps: int, exit_code: int, reason: str
) -> None:
    """A stop ends the process with ``exit_code`` and writes no checkpoint, for ``reason``."""
    LOG.info(
        "stop requested (%s): exiting with status %d %s at step %d without a checkpoint: %s",
        _cause(exit_code),
        exit_code,
        _at(epoch),
        steps,
        reason,
    )


def stopped_after_training(*, steps: int, exit_code: int) -> None:
    """A stop requested during the last epoch acts once the final checkpoint is written."""
    LOG.info(
        "stop requested (%s): the epoch loop's final checkpoint is written (step %d); "
        "exiting with status %d",
        _cause(exit_code),
        steps,
        exit_code,
    )
