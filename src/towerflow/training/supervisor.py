"""``Supervisor``: TensorFlow's managed session for a parameter-server cluster.

Article 003's program: the chief (``is_chief=True``) initialises the
parameters on the ps tasks, or restores them from the latest checkpoint in
``logdir`` with no user code; it saves a checkpoint every ``save_model_secs``
and when the session ends, and writes summaries. The other workers wait until
the parameters are initialised and never write anything. A manual save still
works (to ``logdir`` or another directory; neither changes the schedule of
``logdir``), and SIGTERM (preemption) or SIGINT makes the chief checkpoint
after the step in flight and the program leave its loop (``should_stop()``; a
loop that does not look is ended at its next step with ``SystemExit(0)``); a
second signal, or ``stop_deadline`` seconds, abandons that checkpoint
(:class:`~towerflow.training.stopping.FinalCheckpointAbandoned`, an exit with
status ``128 + signal``) and leaves no partial one. A step that fails because a peer is
missing (``DeadlineExceededError``: a sync step waited ``step_timeout`` for a
dead worker; ``UnavailableError``: a ps task is gone) makes the chief save the
last consistent state before the error leaves the session; the error then
names the tasks that do not answer and says to restart them (a restarted
worker rejoins the running job)::

    server = towerflow.Server(cluster, "worker", task_index)
    sv = towerflow.Supervisor(is_chief=(task_index == 0), logdir="log/super",
                              save_model_secs=5, max_to_keep=1)
    with sv.managed_session(server.target, model=model,
                            optimizer=OptimizerConfig(lr=0.001)) as sess:
        while not sv.should_stop() and sess.global_step < 2000:
            result = sess.run_step(mse_loss, (x, y))
            sv.summary_computed(sess, {"loss_function": result.loss})
        sv.save(sess, directory="log/linear")   # a manual save elsewhere

The session's strategy comes from :func:`~towerflow.strategies.choose.choose_strategy`
(the one road every trainer takes): given the task's ``Server`` or its
``target``, the server's cluster — its ``ParameterServer`` strategy when it has
a ``ps`` job; given nothing, the environment's cluster, else one device.
Restoring, the save schedule, the non-finite check before saving and the
checkpoint metadata are those of the :class:`~towerflow.training.Trainer`
(:mod:`towerflow.training.session`).

TensorFlow's keyword arguments keep their meaning where towerflow has one and
are refused when the ``Supervisor`` is built, with what to use instead, where
it has none (see :data:`REFUSED_TF_ARGUMENTS`).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from towerflow.errors import FailedPreconditionError, InvalidArgumentError
from towerflow.strategies.base import LossFn, OptimizerConfig, StepResult, Strategy
from towerflow.training.session import (
    PEER_FAILURES,
    SaveSchedule,
    checkpoint_metadata,
    refuse_non_finite,
    restore_latest,
    save_before_stopping,
)
from towerflow.training.stopping import (
    DEFAULT_STOP_DEADLINE_S,
    FinalCheckpointAbandoned,
    StopSignals,
)
from towerflow.training.supervisor_saver import SupervisorSaver

__all__ = ["Supervisor", "ManagedSession", "REFUSED_TF_ARGUMENTS"]

log = logging.getLogger("towerflow.training")

_RUNS_AT_BUILD = ("the chief initialises the model's parameters when the session starts (the "
                  "model's own initialisation, or the latest checkpoint in logdir)")
#: TensorFlow ``Supervisor`` arguments towerflow has no use for, and what to do instead.
REFUSED_TF_ARGUMENTS: dict[str, str] = {
    "graph": "towerflow has no graph; pass the model to managed_session(..., model=model)",
    "init_op": f"{_RUNS_AT_BUILD}; to run code on a fresh model pass "
               "init_fn=lambda model: ... (it runs only when there is no checkpoint)",
    "init_feed_dict": "there is no feed_dict; pass init_fn=lambda model: ... to set values",
    "local_init_op": f"{_RUNS_AT_BUILD}; local state needs no op",
    "ready_op": "non-chief workers wait until the chief has initialised the ps tasks; tune "
                "the wait with init_timeout=SECONDS",
    "ready_for_local_init_op": "non-chief workers wait until the chief has initialised the ps "
                               "tasks; tune the wait with init_timeout=SECONDS",
    "recovery_wait_secs": "non-chief workers poll the ps tasks until the chief has "
                          "initialised them; tune the wait with init_timeout=SECONDS",
    "stop_grace_secs": "the supervisor runs no service threads to wait for; stop() returns "
                       "when the summary writer is closed",
    "checkpoint_basename": "checkpoints are named ckpt-NNNNNNNN in logdir; pass another "
                           "logdir (or save(directory=...)) to put them elsewhere",
    "session_manager": "the managed session is the supervisor's own; pass strategy= to "
                       "managed_session to run steps another way",
    "local_init_run_options": "there are no run options; remove the argument",
}
_SUMMARY_OP = ("towerflow has no summary ops: write scalars with sv.summary_computed(sess, "
               "{'loss': loss}); summary_op=None (no automatic summaries) is accepted")
_SAVER = ("towerflow saves with a towerflow.checkpoint.CheckpointManager: pass "
          "saver=CheckpointManager(logdir, max_to_keep=1), or saver=None to save nothing")
_WRITER = ("pass a towerflow.training.summaries.SummaryWriter, or summary_writer=None to "
           "write no summaries")


class ManagedSession:
    """What ``managed_session`` yields: run steps of the prepared model.

    Attributes:
        model: the prepared model (on this worker's device).
        strategy: the strategy running the steps.
        data_position: the loop's own place in its data (any JSON-able value, e.g.
            ``{"epoch": 2, "batch": 310}``): saved with every checkpoint the chief
            writes and, when the session restores one, set from it (None before
            any), so that a custom loop resumes where the checkpoint was taken.
    """

    __slots__ = ("model", "strategy", "data_position", "_supervisor")

    def __init__(self, supervisor: Supervisor, strategy: Strategy, model: nn.Module) -> None:
        self._supervisor = supervisor
        self.strategy = strategy
        self.model = model
        self.data_position: Any = supervisor._restored_position

    @property
    def restored_step(self) -> int | None:
        """The global step of the checkpoint this session restored, or None."""
        return self._supervisor.restored_from

    @property
    def global_step(self) -> int:
        """The shared global step (on a ps cluster, advanced by every worker)."""
        return self.strategy.global_step

    def release(self) -> None:
        """The session has ended: keep the user's model, drop its training wrapper.

        A ``DistributedDataParallel`` wrapper holds the process group; one
        still referenced when the interpreter exits is torn down after the
        group was destroyed, which can abort the process.
        """
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.model.module

    def run_step(self, loss_fn: LossFn, batch: Any, *, lr: float | None = None) -> StepResult:
        """One training step; the chief also checkpoints and summarises when they are due."""
        result = self.strategy.run_step(loss_fn, batch, lr=lr)
        self._supervisor._after_step(self, result)
        return result


def _refuse_tf_arguments(tf_arguments: Mapping[str, Any]) -> None:
    for name, value in tf_arguments.items():
        if name in REFUSED_TF_ARGUMENTS:
            raise InvalidArgumentError(
                f"Supervisor({name}={value!r}): {REFUSED_TF_ARGUMENTS[name]}."
            )
    if tf_arguments.get("summary_op", None) is not None:
        raise InvalidArgumentError(f"Supervisor(summary_op={tf_arguments['summary_op']!r}): "
                                   f"{_SUMMARY_OP}.")


def _known_strategy_options() -> frozenset[str]:
    from towerflow.strategies.base import STRATEGIES
    from towerflow.strategies.choose import strategy_options

    return frozenset({"device"}).union(*(strategy_options(kind) for kind in STRATEGIES))


class Supervisor:
    """Initialise or restore, checkpoint, summarise and stop a training session.

    Args:
        is_chief: whether this task initialises, restores and saves.
        logdir: checkpoints and summaries (chief only); None disables both.
        save_model_secs: seconds between checkpoints (0 or None: not by time).
        save_model_steps: global steps between checkpoints (0 or None: not by steps).
            Either way the chief also saves when the session ends.
        max_to_keep: checkpoints kept in ``logdir``.
        saver: a ``CheckpointManager`` to save with (its directory instead of
            ``logdir``), or None to save and restore nothing.
        summary_op: None only: no automatic summaries (``global_step/sec``).
        summary_writer: a ``SummaryWriter`` to write with, or None to write no
            summaries; by default one on ``logdir``.
        save_summaries_secs: seconds between the automatic ``global_step/sec``
            summaries (0 or None: none).
        global_step: an optional 0-d integer tensor kept equal to the global step.
        init_fn: ``init_fn(model)`` run by the chief when there is no checkpoint,
            before the parameters are sent to the ps tasks.
        stop_signals: signals that request a stop (SIGTERM: preemption; SIGINT: Ctrl-C).
        stop_deadline: seconds after a stop signal that the chief's final
            checkpoint may take (0 or None: no deadline).
        strategy_options: keyword arguments of the strategy the session trains
            with (``mode``, ``replicas_to_aggregate``, ``device_setter``... of the
            ``ParameterServer`` strategy).

    Raises:
        InvalidArgumentError: a TensorFlow argument towerflow has no use for
            (``init_op``, ``ready_op``...: the message says what to use), or an
            option no strategy takes.
    """

    _UNSET: Any = object()

    def __init__(self, is_chief: bool = True, logdir: str | Path | None = None, *,
                 save_model_secs: float | None = 600.0, save_model_steps: int | None = None,
                 max_to_keep: int | None = 5, saver: Any = _UNSET, summary_op: Any = _UNSET,
                 summary_writer: Any = _UNSET, save_summaries_secs: float | None = 120.0,
                 global_step: torch.Tensor | None = None,
                 init_fn: Callable[[nn.Module], None] | None = None,
                 stop_signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT),
                 stop_deadline: float | None = DEFAULT_STOP_DEADLINE_S,
                 **strategy_options: Any) -> None:
        _refuse_tf_arguments({**strategy_options, "summary_op": None if summary_op is
                              self._UNSET else summary_op})
        unknown = sorted(set(strategy_options) - _known_strategy_options())
        if unknown:
            raise InvalidArgumentError(
                f"Supervisor got unknown argument(s) {', '.join(unknown)}; it takes is_chief, "
                "logdir, save_model_secs, save_model_steps, max_to_keep, saver, summary_op, "
                "summary_writer, save_summaries_secs, global_step, init_fn, stop_signals, stop_deadline and "
                f"the strategies' options ({', '.join(sorted(_known_strategy_options()))})."
            )
        for name, value in (("save_model_secs", save_model_secs),
                            ("save_summaries_secs", save_summaries_secs)):
            if value is not None and value < 0:
                raise InvalidArgumentError(f"{name} must be >= 0, got {value}.")
        if global_step is not None and (global_step.dim() != 0 or global_step.is_floating_point()):
            raise InvalidArgumentError(
                "global_step must be a 0-d integer tensor, e.g. torch.zeros((), dtype=torch.int64)."
            )
        self.is_chief = bool(is_chief)
        self.logdir = None if logdir is None else Path(logdir)
        self.save_model_secs = save_model_secs or 0.0
        self.max_to_keep = max_to_keep
        self._manager = self._saver(saver)
        self._writer = self._summary_writer(summary_writer)
        self._writes_summaries = summary_writer is not None and (
            self._writer is not None or self.logdir is not None)
        self._schedule = SaveSchedule(save_model_steps, save_model_secs)
        self._summary_secs = 0.0 if summary_op is None else float(save_summaries_secs or 0.0)
        self.global_step_tensor = global_step
        self.init_fn = init_fn
        self.stop_signals = stop_signals
        self.stop_deadline = stop_deadline
        self._stopping = StopSignals(stop_signals, stop_deadline, self._on_stop_signal)
        self.strategy_options = strategy_options
        self.restored_from: int | None = None
        self._restored_position: Any = None  # the data position of the checkpoint restored
        self.preempted = False
        self._signalled = False  # a stop signal came (replicas in lockstep stop when agreed)
        self._lockstep = False
        self._preempt_saved = False
        self._stop = threading.Event()
        self._session: ManagedSession | None = None
        self._saved_step: int | None = None
        self._rate: tuple[float, int] | None = None
        self._cluster: Any = None  # the ps job's cluster/... scalars (ChiefClusterScalars)
        self._told_not_chief = False

    def _saver(self, saver: Any) -> Any:
        if saver is self._UNSET:
            if self.logdir is None:
                return None
            from towerflow.checkpoint import CheckpointManager

            return CheckpointManager(self.logdir, max_to_keep=self.max_to_keep)
        if saver is None:
            return None
        from towerflow.checkpoint import CheckpointManager

        if not isinstance(saver, CheckpointManager):
            raise InvalidArgumentError(f"Supervisor(saver={saver!r}): {_SAVER}.")
        return saver

    def _summary_writer(self, writer: Any) -> Any:
        if writer is self._UNSET or writer is None:
            return None
        from towerflow.training.summaries import SummaryWriter

        if not isinstance(writer, SummaryWriter):
            raise InvalidArgumentError(f"Supervisor(summary_writer={writer!r}): {_WRITER}.")
        return writer

    # -- stopping ------------------------------------------------------------------------
    def should_stop(self) -> bool:
        """True once a stop was requested (``stop()``, ``request_stop()``, SIGTERM)."""
        return self._stop.is_set()

    def request_stop(self) -> None:
        """Ask the training loop to stop (it checks :meth:`should_stop`)."""
        self._stop.set()

    def stop(self) -> None:
        """Request a stop and close the summary writer (the session saves when it ends)."""
        self.request_stop()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    # -- checkpoints and summaries -------------------------------------------------------
    @property
    def checkpoint_manager(self) -> Any:
        """The ``CheckpointManager`` the chief saves with (None: it saves nothing)."""
        return self._manager

    @property
    def saver(self) -> SupervisorSaver | None:
        """TensorFlow's ``sv.saver``: ``sv.saver.save(sess, path, global_step=step)`` saves
        as :meth:`save` does; its other attributes are :attr:`checkpoint_manager`'s."""
        return None if self._manager is None else SupervisorSaver(self, self._manager)

    def save(self, session: ManagedSession | None = None,
             directory: str | Path | None = None) -> Path | None:
        """Write a checkpoint now (chief only: elsewhere a warning says so and None is returned).

        A save to another ``directory`` leaves the schedule of ``logdir`` as
        it was: the periodic and final checkpoints there are still written.

        Args:
            session: the session to save (default: the open one).
            directory: another checkpoint directory (default: ``logdir``).
        """
        if not self.is_chief:
            if not self._told_not_chief:
                log.warning("Supervisor.save() on a non-chief task writes nothing: only the "
                            "chief (is_chief=True) saves checkpoints.")
                self._told_not_chief = True
            return None
        session = session or self._session
        if session is None:
            raise FailedPreconditionError("Supervisor.save() needs an open managed_session.")
        if directory is None:
            if self._manager is None:
                raise InvalidArgumentError(
                    "Supervisor has no logdir (or saver=None); pass directory= to save().")
            return self._save_to(self._manager, session, schedule=True)
        from towerflow.checkpoint import CheckpointManager

        return self._save_to(CheckpointManager(directory, max_to_keep=self.max_to_keep),
                             session, schedule=False)

    def _save_to(self, manager: Any, session: ManagedSession, *, schedule: bool,
                 step: int | None = None) -> Path:
        strategy = session.strategy
        groups = strategy.state_dict()
        metadata = checkpoint_metadata(strategy)
        if step is not None:  # TensorFlow's saver.save(..., global_step=step) names the step
            metadata["step"] = step
        if session.data_position is not None:
            metadata["data_position"] = session.data_position
        step = metadata["step"]
        refuse_non_finite({n: p.detach() for n, p in session.model.named_parameters()},
                          step, manager)
        path = manager.save(step, groups, metadata)
        if schedule:
            self._schedule.saved(step)
            self._saved_step = step
        log.info("saved checkpoint %s", path)
        return path

    def summary_computed(self, session: ManagedSession | None,
                         values: Mapping[str, float | torch.Tensor],
                         global_step: int | None = None) -> None:
        """Write scalar summaries (chief with a writer only; a no-op elsewhere)."""
        writer = self._summaries()
        if writer is None:
            return
        session = session or self._session
        step = global_step if global_step is not None else (
            session.global_step if session is not None else 0)
        writer.scalars(step, {k: float(v) for k, v in values.items()})

    def _summaries(self) -> Any:
        if not (self.is_chief and self._writes_summaries):
            return None
        if self._writer is None and self.logdir is not None:
            from towerflow.training.summaries import SummaryWriter

            self._writer = SummaryWriter(self.logdir)
        return self._writer

    # -- the session -----------------------------------------------------------------------
    @contextlib.contextmanager
    def managed_session(self, master: Any = None, *, model: nn.Module,
                        optimizer: OptimizerConfig | torch.optim.Optimizer | None = None,
                        strategy: Strategy | None = None) -> Iterator[ManagedSession]:
        """Prepare ``model``, restore or initialise it, and yield a :class:`ManagedSession`.

        Args:
            master: the task's ``towerflow.Server``, or its ``target``
                (``"grpc://host:port"``: the server of this process listening
                there, else the environment's cluster task at that address); None
                or ``""``: the environment's cluster, else this process alone.
            model: the model to train.
            optimizer: applied on the ps tasks (default SGD, lr 0.1): an
                ``OptimizerConfig`` or a ``torch.optim`` SGD / Adagrad / Adam over
                ``model``'s parameters, its parameter groups' settings kept.
            strategy: use this strategy instead of choosing one.

        Raises:
            InvalidArgumentError: ``master`` names no task this process knows.
        """
        owns = strategy is None
        strategy = strategy if strategy is not None else self._strategy_for(master)
        self._lockstep = strategy.lockstep
        finished, error = False, None
        try:
            with self._signals():
                prepared = strategy.prepare(model, OptimizerConfig() if optimizer is None
                                            else optimizer)
                self._restore_or_init(strategy, model)
                session = ManagedSession(self, strategy, prepared)
                self._session = session
                self._sync_global_step(strategy.global_step)
                self._rate = (time.monotonic(), strategy.global_step)
                try:
                    yield session
                except PEER_FAILURES as exc:
                    raise save_before_stopping(strategy, exc,
                                               lambda: self._save_before_stopping(session)
                                               ) from exc
                strategy.settle()  # the model holds every update this task sent
                self._final_save(session)
                finished = True
        except FinalCheckpointAbandoned:
            raise
        except SystemExit:
            if self.preempted and self._session is not None:
                self._final_save(self._session)
            raise
        except Exception as exc:  # a chief that failed before initialising tells its peers
            error = exc
            raise
        finally:
            # a session that raised did not finish: its peers are not told it did
            strategy.end_training(finished=finished, checkpoint_step=self._final_checkpoint(),
                                  error=error)
            ended, self._session = self._session, None
            if self._cluster is not None:
                self._cluster.close()
            if owns:
                if ended is not None:
                    ended.release()
                strategy.shutdown()
            if self._writer is not None:
                self._writer.flush()

    def _strategy_for(self, master: Any) -> Strategy:
        from towerflow.cluster import Server
        from towerflow.cluster.targets import resolve_target
        from towerflow.strategies.choose import choose_strategy

        options = dict(self.strategy_options)
        device = options.pop("device", None)
        if isinstance(master, Server):
            return choose_strategy(server=master, device=device, is_chief=self.is_chief,
                                   **options)
        if isinstance(master, str) and master:
            cluster, task, server = resolve_target(master)
            if server is not None:
                return choose_strategy(server=server, device=device, is_chief=self.is_chief,
                                       **options)
            return choose_strategy(cluster=cluster, task=task, device=device,
                                   is_chief=self.is_chief, **options)
        if master not in (None, ""):
            raise InvalidArgumentError(
                f"managed_session(master={master!r}): pass the task's towerflow.Server, its "
                "target ('grpc://host:port'), or None."
            )
        return choose_strategy(device=device, is_chief=self.is_chief, **options)

    def _restore_or_init(self, strategy: Strategy, model: nn.Module) -> None:
        # every task asks: mirrored replicas receive the chief's checkpoint from it
        ckpt = restore_latest(self._manager if self.is_chief else None, strategy)
        if ckpt is not None:
            self.restored_from = self._saved_step = ckpt.step
            self._restored_position = ckpt.metadata.get("data_position")
            return
        if self.is_chief and self.init_fn is not None:
            with torch.no_grad():
                self.init_fn(model)
        strategy.broadcast_model()  # mirrored replicas start from the chief's initialised model

    def _sync_global_step(self, step: int) -> None:
        if self.global_step_tensor is not None:
            self.global_step_tensor.fill_(step)

    def _after_step(self, session: ManagedSession, result: StepResult) -> None:
        step = result.global_step
        self._sync_global_step(step)
        if self._lockstep and not self.preempted \
                and session.strategy.agree_to_stop(self._signalled):
            self.preempted = True
            self.request_stop()
        if self.preempted:
            if self._preempt_saved:  # the loop ignores should_stop(): leave now
                raise SystemExit(0)
            self._final_save(session)
            self._preempt_saved = True
            return
        if self.is_chief and self._manager is not None and self._schedule.due(step):
            self.save(session)
        self._step_rate(step)

    def _step_rate(self, step: int) -> None:
        """TensorFlow's ``global_step/sec`` summary, every ``save_summaries_secs``."""
        if not self._summary_secs or self._rate is None:
            return
        then, first = self._rate
        now = time.monotonic()
        if now - then < self._summary_secs:
            return
        self._rate = (now, step)
        writer = self._summaries()
        if writer is not None:
            writer.scalars(step, {"global_step/sec": (step - first) / (now - then),
                                  **self._cluster_scalars()})

    def _cluster_scalars(self) -> dict[str, float]:
        """A ps job's ``cluster/...`` figures (per ps shard and worker), else none."""
        if self._session is None:
            return {}
        if self._cluster is None:
            from towerflow.ps.worker.observe import ChiefClusterScalars

            self._cluster = ChiefClusterScalars()
        return self._cluster.read(self._session.strategy)

    def _save_before_stopping(self, session: ManagedSession) -> tuple[Path, int] | None:
        """The chief's checkpoint when a step failed for a missing peer (None elsewhere)."""
        if not self.is_chief or self._manager is None:
            return None
        path = self._save_to(self._manager, session, schedule=True)
        return path, int(self._saved_step or 0)

    def _final_checkpoint(self) -> int | None:
        """The step of the last checkpoint the chief saved or restored; None elsewhere."""
        return self._saved_step if self.is_chief and self._manager is not None else None

    def _final_save(self, session: ManagedSession) -> None:
        if self.is_chief and self._manager is not None \
                and session.strategy.global_step != self._saved_step:
            if self.preempted:  # a second signal or the deadline abandons it
                with self._stopping.final_save():
                    self.save(session)
            else:
                self.save(session)

    def _on_stop_signal(self, signum: int) -> None:
        self._signalled = True
        if not self._lockstep:  # replicas in lockstep stop at the step they agree on
            self.preempted = True
            self.request_stop()

    def _signals(self) -> StopSignals:
        """A session's stop signals (installed while it runs, in the main thread)."""
        self._stopping = StopSignals(self.stop_signals, self.stop_deadline, self._on_stop_signal)
        return self._stopping

