"""The job's lifecycle: its phases as a state machine, and the lines an operator reads.

**The machine.** A job's process moves through four independent phases, each a
small machine of its own (`Stop`, `Write`, `Train`, `Replay`), driven by the events
of `Event`. `TRANSITIONS` is the whole of it, as data: for each event, the phase it
may come in and the phase it leaves. `Lifecycle.fire` looks the event up and
raises `LifecycleError` -- before changing anything -- for an event its phase does
not allow, in the manner of h11's connection states. `Job` holds one `Lifecycle`
and asks it, instead of keeping flags: "is a stop asked" is ``stop is not
Stop.NONE``, "must a stop wait for a write" is ``write is not Write.IDLE``.

The events a signal handler fires (`Event.REQUEST`) and those of an error path
(`Event.PEER_LEFT`) are allowed in every phase they can arrive in, so that neither
ever raises from a handler or hides the error being handled.

**The lines.** Resumed from a checkpoint, a loop resumed mid-epoch, a checkpoint
written, the batch size changed, a stop requested. Each goes to the
``adaptdl.lifecycle`` logger at INFO; callers emit them on rank 0 only, so that a
job of many replicas prints each line once. The ``adaptdl`` logger's level
(``ADAPTDL_LOG_LEVEL``, default INFO) decides whether they show; the torch adapter
attaches a handler of its own when the program configured no logging (see
``adaptdl.torch._log``). The texts live here, in one place, so that tests and
documentation name them.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from types import MappingProxyType

from adaptdl.core.loop.boundary import EXIT_CODE_INTERRUPTED, EXIT_CODE_PREEMPTED

LOGGER_NAME = "adaptdl.lifecycle"
LOG = logging.getLogger(LOGGER_NAME)


class Stop(enum.Enum):
    """Where a stop (a scheduler's SIGTERM, a user's SIGINT) stands."""

    NONE = "none"  # no stop asked
    REQUESTED = "requested"  # asked: acts at the next point every replica reaches
    WAITING = "waiting"  # asked outside any loop: the replicas are given time to meet
    STOPPING = "stopping"  # acting on it: writing what can be written, then exiting
    STOPPED = "stopped"  # `Preempted` raised: the process is exiting


class Write(enum.Enum):
    """Whether a checkpoint is being written (a stop then waits for it to finish)."""

    IDLE = "idle"
    WRITING = "writing"  # a checkpoint, or the commit of one
    FINISHING = "finishing"  # the epoch loop's end: draining, then the final checkpoint
    FINISHING_WRITING = "finishing_writing"  # the final checkpoint itself


class Train(enum.Enum):
    """Where the program is in its epoch loop (`Job.remaining_epochs_until`)."""

    BEFORE = "before"  # no epoch loop has run in this process
    TRAINING = "training"  # an epoch loop runs (or was left by a ``break``)
    TRAINED = "trained"  # the epoch loop ended; its final checkpoint holds everything


class Replay(enum.Enum):
    """Whether the program re-runs code that ran before the restart."""

    REPLAYING = "replaying"  # restored inside a loop: until a loop that is not skipped starts
    LIVE = "live"


Phase = Stop | Write | Train | Replay


class Event(enum.Enum):
    """What happens to a job; each event moves exactly one of the four phases."""

    REQUEST = "request"  # a stop is asked (a signal handler): allowed in every phase
    WAIT = "wait"  # a stop asked outside any loop waits for the replicas to meet
    AGREE = "agree"  # the replicas agreed, at a point all reached, that one asked to stop
    ACT_ALONE = "act_alone"  # act without the replicas meeting: one replica, no wait, overdue
    PEER_LEFT = "peer_left"  # a collective failed while stopping: a stopping peer left
    EXIT = "exit"  # the stop is done: `Preempted` is raised
    BEGIN_WRITE = "begin_write"
    END_WRITE = "end_write"
    BEGIN_FINISH = "begin_finish"
    END_FINISH = "end_finish"
    BEGIN_EPOCHS = "begin_epochs"
    END_EPOCHS = "end_epochs"
    RESUME = "resume"  # a loop that is not skipped starts: the replay ends


def _table(pairs: Mapping[Phase, Phase]) -> Mapping[Phase, Phase]:
    return MappingProxyType(dict(pairs))


#: For each event, the phases it may come in and the phase it leaves. An event in a
#: phase that is not listed is a bug in the caller, and raises `LifecycleError`.
TRANSITIONS: Mapping[Event, Mapping[Phase, Phase]] = MappingProxyType(
    {
        # A signal may come at any time, a second one too: it never raises, and only
        # the first moves the phase.
        Event.REQUEST: _table({s: Stop.REQUESTED if s is Stop.NONE else s for s in Stop}),
        Event.WAIT: _table({Stop.REQUESTED: Stop.WAITING}),
        # A replica that got no signal stops as one asked, when a peer did.
        Event.AGREE: _table(
            {Stop.NONE: Stop.STOPPING, Stop.REQUESTED: Stop.STOPPING, Stop.WAITING: Stop.STOPPING}
        ),
        Event.ACT_ALONE: _table({Stop.REQUESTED: Stop.STOPPING, Stop.WAITING: Stop.STOPPING}),
        # An error path: allowed wherever a stop was asked, the exit already under way too.
        Event.PEER_LEFT: _table(
            {
                Stop.REQUESTED: Stop.STOPPED,
                Stop.WAITING: Stop.STOPPED,
                Stop.STOPPING: Stop.STOPPED,
                Stop.STOPPED: Stop.STOPPED,
            }
        ),
        Event.EXIT: _table({Stop.STOPPING: Stop.STOPPED}),
        Event.BEGIN_WRITE: _table(
            {Write.IDLE: Write.WRITING, Write.FINISHING: Write.FINISHING_WRITING}
        ),
        Event.END_WRITE: _table(
            {Write.WRITING: Write.IDLE, Write.FINISHING_WRITING: Write.FINISHING}
        ),
        Event.BEGIN_FINISH: _table({Write.IDLE: Write.FINISHING}),
        Event.END_FINISH: _table({Write.FINISHING: Write.IDLE}),
        # A program may leave an epoch loop by ``break`` and start another.
        Event.BEGIN_EPOCHS: _table({s: Train.TRAINING for s in Train}),
        Event.END_EPOCHS: _table({Train.TRAINING: Train.TRAINED}),
        Event.RESUME: _table({Replay.REPLAYING: Replay.LIVE}),
    }
)


def machine_of(event: Event) -> type[Phase]:
    """The phase (`Stop`, `Write`, `Train` or `Replay`) that ``event`` moves."""
    return type(next(iter(TRANSITIONS[event])))


class LifecycleError(RuntimeError):
    """An event came in a phase that does not allow it (nothing was changed)."""


class Lifecycle:
    """The four phases of one job's process, moved only by `fire`.

    Besides the phases it keeps the two values a stop carries: the exit status of
    the first request (`stop_code`) and when a stop outside any loop began waiting
    (`waiting_since`, set by `Event.WAIT`, cleared when the phase leaves WAITING).
    """

    def __init__(
        self,
        *,
        stop: Stop = Stop.NONE,
        write: Write = Write.IDLE,
        train: Train = Train.BEFORE,
        replay: Replay = Replay.LIVE,
        waiting_since: float | None = None,
    ) -> None:
        if (waiting_since is None) != (stop is not Stop.WAITING):
            raise ValueError(
                f"waiting_since must be given exactly when stop is Stop.WAITING; got "
                f"stop={stop.name}, waiting_since={waiting_since!r}"
            )
        self._phases: dict[type[Phase], Phase] = {
            Stop: stop,
            Write: write,
            Train: train,
            Replay: replay,
        }
        self.stop_code = EXIT_CODE_PREEMPTED
        self.waiting_since = waiting_since

    @property
    def stop(self) -> Stop:
        phase = self._phases[Stop]
        assert isinstance(phase, Stop)
        return phase

    @property
    def write(self) -> Write:
        phase = self._phases[Write]
        assert isinstance(phase, Write)
        return phase

    @property
    def train(self) -> Train:
        phase = self._phases[Train]
        assert isinstance(phase, Train)
        return phase

    @property
    def replay(self) -> Replay:
        phase = self._phases[Replay]
        assert isinstance(phase, Replay)
        return phase

    @property
    def phases(self) -> tuple[Stop, Write, Train, Replay]:
        return (self.stop, self.write, self.train, self.replay)

    def fire(self, event: Event, *, code: int | None = None, now: float | None = None) -> Phase:
        """Move the phase ``event`` belongs to; returns the phase it is in now.

        ``code`` goes with `Event.REQUEST` (the first request's code is kept) and
        ``now`` with `Event.WAIT` (when the wait began). Raises `LifecycleError`,
        changing nothing, when the current phase does not allow ``event``.
        """
        machine = machine_of(event)
        current = self._phases[machine]
        after = TRANSITIONS[event].get(current)
        if after is None:
            allowed = ", ".join(p.name for p in TRANSITIONS[event])
            raise LifecycleError(
                f"event {event.name} cannot come in phase {machine.__name__}.{current.name} "
                f"(it may come in: {allowed})"
            )
        if event is Event.REQUEST and current is Stop.NONE and code is not None:
            self.stop_code = code
        if event is Event.WAIT:
            if now is None:
                raise LifecycleError("event WAIT needs the time the wait began (now=)")
            self.waiting_since = now
        elif machine is Stop and after is not Stop.WAITING:
            self.waiting_since = None
        self._phases[machine] = after
        return after


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
