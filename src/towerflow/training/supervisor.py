"""``Supervisor``: TensorFlow's managed session for a parameter-server cluster.

Article 003's program: the chief (``is_chief=True``) initialises the
parameters on the ps tasks, or restores them from the latest checkpoint in
``logdir`` with no user code; it saves a checkpoint every ``save_model_secs``
and when the session ends, and writes summaries. The other workers wait until
the parameters are initialised and never write anything. A manual save still
works, and SIGTERM (preemption) makes the chief checkpoint and the program
leave its loop (``should_stop()``; a loop that does not look is ended at
its next step with ``SystemExit(0)``)::

    sv = towerflow.Supervisor(is_chief=(task_index == 0), logdir="log/super",
                              save_model_secs=5, max_to_keep=1)
    with sv.managed_session(server, model=model, optimizer=OptimizerConfig(lr=0.001)) as sess:
        while not sv.should_stop() and sess.global_step < 2000:
            result = sess.run_step(mse_loss, (x, y))
            sv.summary_computed(sess, {"loss_function": result.loss})
    sv.save()            # a manual save (chief only)

The session's strategy is the cluster's :class:`~towerflow.strategies.ParameterServer`
when the server's cluster has a ``ps`` job, else one device of this process.
Given the task's ``Server``, the strategy uses it (the ps tasks' heartbeats
reach the worker through it); given no master, it starts one itself.
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

from towerflow.errors import FailedPreconditionError, InvalidArgumentError
from towerflow.strategies.base import LossFn, OptimizerConfig, StepResult, Strategy

__all__ = ["Supervisor", "ManagedSession"]

log = logging.getLogger("towerflow.training")


class ManagedSession:
    """What ``managed_session`` yields: run steps of the prepared model.

    Attributes:
        model: the prepared model (on this worker's device).
        strategy: the strategy running the steps.
    """

    __slots__ = ("model", "strategy", "_supervisor")

    def __init__(self, supervisor: Supervisor, strategy: Strategy, model: nn.Module) -> None:
        self._supervisor = supervisor
        self.strategy = strategy
        self.model = model

    @property
    def global_step(self) -> int:
        """The shared global step (on a ps cluster, advanced by every worker)."""
        return self.strategy.global_step

    def run_step(self, loss_fn: LossFn, batch: Any, *, lr: float | None = None) -> StepResult:
        """One training step; the chief also checkpoints when ``save_model_secs`` have passed."""
        result = self.strategy.run_step(loss_fn, batch, lr=lr)
        self._supervisor._after_step(self, result.global_step)
        return result


class Supervisor:
    """Initialise or restore, checkpoint, summarise and stop a training session.

    Args:
        is_chief: whether this task initialises, restores and saves.
        logdir: checkpoints and summaries (chief only); None disables both.
        save_model_secs: seconds between checkpoints (0 or None: only at the end).
        max_to_keep: checkpoints kept in ``logdir``.
        global_step: an optional 0-d integer tensor kept equal to the global step.
        init_fn: ``init_fn(model)`` run by the chief when there is no checkpoint,
            before the parameters are sent to the ps tasks.
        stop_signals: signals that request a stop (SIGTERM: preemption).
        strategy_options: keyword arguments of the ``ParameterServer`` strategy
            the session builds (``mode``, ``replicas_to_aggregate``, ``staleness``...).
    """

    def __init__(self, is_chief: bool = True, logdir: str | Path | None = None, *,
                 save_model_secs: float | None = 600.0, max_to_keep: int | None = 5,
                 global_step: torch.Tensor | None = None,
                 init_fn: Callable[[nn.Module], None] | None = None,
                 stop_signals: tuple[int, ...] = (signal.SIGTERM,),
                 **strategy_options: Any) -> None:
        if save_model_secs is not None and save_model_secs < 0:
            raise InvalidArgumentError(f"save_model_secs must be >= 0, got {save_model_secs}.")
        if global_step is not None and (global_step.dim() != 0 or global_step.is_floating_point()):
            raise InvalidArgumentError(
                "global_step must be a 0-d integer tensor, e.g. torch.zeros((), dtype=torch.int64)."
            )
        self.is_chief = bool(is_chief)
        self.logdir = None if logdir is None else Path(logdir)
        self.save_model_secs = save_model_secs or 0.0
        self.max_to_keep = max_to_keep
        self.global_step_tensor = global_step
        self.init_fn = init_fn
        self.stop_signals = stop_signals
        self.strategy_options = strategy_options
        self.restored_from: int | None = None
        self.preempted = False
        self._preempt_saved = False
        self._stop = threading.Event()
        self._manager: Any = None
        self._writer: Any = None
        self._session: ManagedSession | None = None
        self._last_save = time.monotonic()
        self._saved_step: int | None = None

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
        """The ``CheckpointManager`` of ``logdir`` (None without a logdir)."""
        if self._manager is None and self.logdir is not None:
            from towerflow.checkpoint import CheckpointManager

            self._manager = CheckpointManager(self.logdir, max_to_keep=self.max_to_keep)
        return self._manager

    def save(self, session: ManagedSession | None = None,
             directory: str | Path | None = None) -> Path | None:
        """Write a checkpoint now (chief only; others return None).

        Args:
            session: the session to save (default: the open one).
            directory: another checkpoint directory (default: ``logdir``).
        """
        if not self.is_chief:
            return None
        session = session or self._session
        if session is None:
            raise FailedPreconditionError("Supervisor.save() needs an open managed_session.")
        if directory is not None:
            from towerflow.checkpoint import CheckpointManager

            manager = CheckpointManager(directory, max_to_keep=self.max_to_keep)
        else:
            manager = self.checkpoint_manager
            if manager is None:
                raise InvalidArgumentError("Supervisor has no logdir; pass directory= to save().")
        strategy = session.strategy
        groups = strategy.state_dict()
        meta = strategy.state_metadata()
        step = int(meta.get("global_step", strategy.global_step))  # the step of the tensors
        path = manager.save(step, groups, {"step": step, "strategy": meta})
        self._last_save, self._saved_step = time.monotonic(), step
        log.info("saved checkpoint %s", path)
        return path

    def summary_computed(self, session: ManagedSession | None,
                         values: Mapping[str, float | torch.Tensor],
                         global_step: int | None = None) -> None:
        """Write scalar summaries (chief with a logdir only; a no-op elsewhere)."""
        if not self.is_chief or self.logdir is None:
            return
        if self._writer is None:
            from towerflow.training.summaries import SummaryWriter

            self._writer = SummaryWriter(self.logdir)
        session = session or self._session
        step = global_step if global_step is not None else (
            session.global_step if session is not None else 0)
        self._writer.scalars(step, {k: float(v) for k, v in values.items()})

    # -- the session -----------------------------------------------------------------------
    @contextlib.contextmanager
    def managed_session(self, master: Any = None, *, model: nn.Module,
                        optimizer: OptimizerConfig | None = None,
                        strategy: Strategy | None = None) -> Iterator[ManagedSession]:
        """Prepare ``model``, restore or initialise it, and yield a :class:`ManagedSession`.

        Args:
            master: the task's ``towerflow.Server`` (or its ``target``, the
                cluster then coming from ``TF_CONFIG``); None trains locally.
            model: the model to train.
            optimizer: applied on the ps tasks (default SGD, lr 0.1).
            strategy: use this strategy instead of building one from ``master``.
        """
        owns = strategy is None
        strategy = strategy if strategy is not None else self._strategy_for(master)
        try:
            with self._signals():
                prepared = strategy.prepare(model, optimizer or OptimizerConfig())
                self._restore_or_init(strategy, model)
                session = ManagedSession(self, strategy, prepared)
                self._session = session
                self._after_step(session, strategy.global_step, check=False)
                yield session
                self._final_save(session)
        except SystemExit:
            if self.preempted and self._session is not None:
                self._final_save(self._session)
            raise
        finally:
            self._session = None
            if owns:
                strategy.shutdown()
            if self._writer is not None:
                self._writer.flush()

    def _strategy_for(self, master: Any) -> Strategy:
        from towerflow.cluster import Server, resolve_cluster

        credentials, server = None, True  # True: the strategy serves this task itself
        if isinstance(master, Server):
            cluster, task, credentials = master.cluster, master.task, master.credentials
            server = master
        else:
            cluster, task = resolve_cluster()
            if isinstance(master, str) and cluster is not None:
                task = _task_at(cluster, master) or task
                server = False  # a target: this task's server runs elsewhere in the process
        if cluster is not None and task is not None and "ps" in cluster.jobs:
            from towerflow.strategies.parameter_server import ParameterServer

            options = dict(self.strategy_options)
            options.setdefault("is_chief", self.is_chief)
            options.setdefault("server", server)
            return ParameterServer(cluster, task, credentials=credentials, **options)
        from towerflow.strategies.single import SingleDevice

        return SingleDevice(self.strategy_options.get("device"))

    def _restore_or_init(self, strategy: Strategy, model: nn.Module) -> None:
        if not self.is_chief:
            return
        manager = self.checkpoint_manager
        ckpt = manager.restore(device="cpu") if manager is not None else None
        if ckpt is not None:
            strategy.load_state(ckpt.groups, ckpt.metadata.get("strategy"))
            self.restored_from = ckpt.step
            self._saved_step = ckpt.step
            log.info("restored %s at step %d", ckpt.path, ckpt.step)
        elif self.init_fn is not None:
            with torch.no_grad():
                self.init_fn(model)

    def _after_step(self, session: ManagedSession, step: int, *, check: bool = True) -> None:
        if self.global_step_tensor is not None:
            self.global_step_tensor.fill_(step)
        if not check:
            return
        if self.preempted:
            if self._preempt_saved:  # the loop ignores should_stop(): leave now
                raise SystemExit(0)
            self._final_save(session)
            self._preempt_saved = True
            return
        due = self.save_model_secs and time.monotonic() - self._last_save >= self.save_model_secs
        if due and self.is_chief and self.logdir is not None:
            self.save(session)

    def _final_save(self, session: ManagedSession) -> None:
        if self.is_chief and self.logdir is not None \
                and session.strategy.global_step != self._saved_step:
            self.save(session)

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.getsignal(sig) for sig in self.stop_signals}

        def handle(signum: int, frame: object) -> None:
            log.info("received signal %d; saving and stopping", signum)
            self.preempted = True
            self.request_stop()

        try:
            for sig in self.stop_signals:
                signal.signal(sig, handle)
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _task_at(cluster: Any, target: str) -> Any:
    from towerflow.cluster import TaskInfo
    from towerflow.cluster.spec import strip_scheme

    address = strip_scheme(target)
    for task, task_address in cluster.tasks():
        if task_address == address:
            return TaskInfo(task.job_name, task.task_index)
    return None
