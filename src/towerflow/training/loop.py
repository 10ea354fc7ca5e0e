"""The training loop: one implementation for ``towerflow train`` and for your own model.

:class:`Trainer` gives any PyTorch model article 001's machinery — the strategy
(one device, mirrored replicas, or a parameter server), a learning-rate
schedule, moving averages of the parameters, the step log, the NaN guard,
TensorBoard summaries and checkpoints, and resuming from the latest checkpoint
when the same program runs again::

    import torch, towerflow
    from towerflow.strategies import OptimizerConfig

    def loss_fn(model, batch):
        images, labels = batch
        return torch.nn.functional.cross_entropy(model(images), labels)

    with towerflow.Trainer(MyNet(), loss_fn, dataset,          # Dataset or iterable
                           optimizer=OptimizerConfig("momentum", lr=0.05, momentum=0.9),
                           train_dir="runs/mine", batch_size=64) as trainer:
        trainer.fit(max_steps=2000)

The strategy defaults to the one :func:`~towerflow.strategies.choose.choose_strategy`
picks from the environment: :class:`~towerflow.strategies.Mirrored` when the
process was started as a replica (torchrun's ``RANK``/``WORLD_SIZE``, or a
``TF_CONFIG`` / Slurm cluster of several training tasks),
:class:`~towerflow.strategies.ParameterServer` when that cluster has a ``ps``
job, else :class:`~towerflow.strategies.SingleDevice`; so the same script runs
on one GPU, on N GPUs under ``torchrun --nproc-per-node N`` and on N machines.
No host synchronisation happens per step: the loss is read only on log,
summary and checkpoint steps. A step that fails because a peer is missing
(``DeadlineExceededError`` / ``UnavailableError``) makes the chief checkpoint
the last consistent state first; the error names the tasks that do not answer
and the way out.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

from towerflow.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NanLossDuringTrainingError,
)
from towerflow.strategies.base import LossFn, OptimizerConfig, Strategy
from towerflow.training.config import TrainConfig
from towerflow.training.ema import ExponentialMovingAverage
from towerflow.training.hooks import (
    CheckpointHook,
    Hook,
    NanGuard,
    ProgressHook,
    StepContext,
    StepLogHook,
    SummaryHook,
    non_finite_tensor,
)
from towerflow.training.pipeline import Pipeline, ReadAhead, Transform, make_pipeline
from towerflow.training.session import (
    PEER_FAILURES,
    checkpoint_metadata,
    restore_latest,
    save_before_stopping,
)
from towerflow.training.stopping import StopSignals

__all__ = ["Trainer", "TrainResult", "default_strategy"]

log = logging.getLogger("towerflow.training")

Schedule = Callable[[int], float]


def default_strategy(device: str | torch.device | None = None) -> Strategy:
    """The environment's strategy (:func:`~towerflow.strategies.choose.choose_strategy`)."""
    from towerflow.strategies.choose import choose_strategy

    return choose_strategy(device=device)


@dataclass(frozen=True, slots=True)
class TrainResult:
    """How :meth:`Trainer.fit` ended.

    Attributes:
        step: the global step reached.
        loss: the last loss read (mean over replicas), None if none was read.
        restored_from: the step of the checkpoint the run resumed from, or None.
    """

    step: int
    loss: float | None
    restored_from: int | None


class Trainer:
    """Trains a model with a strategy, a schedule, moving averages, logs, summaries, checkpoints.

    Args:
        model: the user's ``nn.Module``.
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``; ``model`` is the
            strategy's (possibly DDP-wrapped) module, ``batch`` is on the device.
        data: a :class:`towerflow.data.Dataset` (sharded per replica, prefetched,
            resumable) or any iterable of batches (shard it yourself with
            ``trainer.strategy.rank`` / ``world_size``).
        strategy: how steps run; see :func:`default_strategy`.
        optimizer: the optimizer (default SGD, lr 0.1): an ``OptimizerConfig`` or a
            ``torch.optim`` SGD / Adagrad / Adam over ``model``'s parameters, each
            parameter group's settings kept (under every strategy; a schedule
            scales every group's learning rate by the same factor).
        schedule: ``step -> learning rate`` (e.g. :class:`ExponentialDecay`);
            None keeps the optimizer's ``lr``.
        config: loop options; keyword ``options`` override single fields of it
            (``train_dir=...``, ``batch_size=...``, ``max_steps=...``...).
        transform: ``(images, labels) -> (images, labels)`` applied on the device
            to each batch of a Dataset (e.g. distortion).
        hooks: extra :class:`Hook` objects.
        metadata: extra JSON-able facts to store in every checkpoint.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, data: Any, *,
                 strategy: Strategy | None = None,
                 optimizer: OptimizerConfig | torch.optim.Optimizer | None = None,
                 schedule: Schedule | None = None, config: TrainConfig | None = None,
                 transform: Transform | None = None, hooks: Sequence[Hook] = (),
                 metadata: dict[str, Any] | None = None, **options: Any) -> None:
        if not isinstance(model, nn.Module):
            raise InvalidArgumentError(
                f"Trainer needs a torch.nn.Module, got {type(model).__name__}."
            )
        self.config = (config or TrainConfig()).replace(**options)
        self.model = model
        self.loss_fn = loss_fn
        self.schedule = schedule
        self.optimizer_config = OptimizerConfig() if optimizer is None else optimizer
        self._owns_strategy = strategy is None
        self.strategy = strategy if strategy is not None else default_strategy()
        self._data = data
        self._transform = transform
        self._extra_hooks = list(hooks)
        self._metadata = dict(metadata or {})
        self.ema: ExponentialMovingAverage | None = None
        self._pipeline: Pipeline | None = None
        self._train_model: nn.Module | None = None
        self._manager: Any = None
        self._restored_from: int | None = None
        self._position: dict[str, Any] | None = None
        self._saver: CheckpointHook | None = None
        self._stop = StopSignals(deadline_s=None)  # installed by fit()
        self._stopped_short = False  # the last steps were left to other workers (fit)

    # -- read-only facts for hooks --------------------------------------------------------
    @property
    def max_steps(self) -> int:
        return self.config.max_steps

    @property
    def global_step(self) -> int:
        return self.strategy.global_step

    @property
    def restored_from(self) -> int | None:
        """The step of the checkpoint this run resumed from, or None."""
        return self._restored_from

    # -- setup ----------------------------------------------------------------------------
    def _setup(self) -> None:
        if self._train_model is None:
            self._train_model = self.strategy.prepare(self.model, self.optimizer_config)
            if self.config.ema_decay is not None and self.strategy.is_chief:
                self.ema = ExponentialMovingAverage(dict(self.model.named_parameters()),
                                                    decay=self.config.ema_decay)
            if self.config.restore:
                self._position = self._restore()
            self.strategy.check_restored_step(self._restored_from or 0)
        if self._pipeline is None:
            world = self.strategy.world_size
            self._pipeline = make_pipeline(
                self._data, device=self.strategy.device, batch_size=self.config.batch_size,
                rank=self.strategy.rank, world_size=world, seed=self.config.seed,
                capacity=self.config.prefetch_capacity or 2 * world,
                transform=self._transform, position=self._position)
            if self.strategy.reads_ahead:
                self._pipeline = ReadAhead(self._pipeline)

    def _checkpoint_manager(self) -> Any:
        if self._manager is None and self.config.train_dir is not None:
            from towerflow.checkpoint import CheckpointManager

            self._manager = CheckpointManager(self.config.train_dir,
                                              max_to_keep=self.config.max_to_keep)
        return self._manager

    def _restore(self) -> dict[str, Any] | None:
        """Resume from the latest checkpoint; return the saved data position."""
        manager = self._checkpoint_manager()
        if manager is None:
            return None
        ckpt = restore_latest(manager, self.strategy, self.strategy.device)
        if ckpt is None:
            return None
        meta = ckpt.metadata
        if self.ema is not None and "ema" in ckpt.groups:
            self.ema.load_state_dict(ckpt.groups["ema"])
        self._restore_schedule(meta.get("schedule"))
        self._restored_from = ckpt.step
        return meta.get("data")

    def _restore_schedule(self, saved: dict[str, Any] | None) -> None:
        from_dict = getattr(type(self.schedule), "from_dict", None)
        if saved is None or from_dict is None:
            return
        restored = from_dict(saved)
        if restored != self.schedule:
            log.warning("using the learning-rate schedule of the checkpoint (%s) instead of %s; "
                        "start a new train_dir to change it", restored, self.schedule)
        self.schedule = restored

    def _hooks(self) -> list[Hook]:
        cfg = self.config
        hooks: list[Hook] = [ProgressHook(cfg.progress), StepLogHook(cfg.log_every)]
        if cfg.train_dir is not None:
            from towerflow.training.summaries import SummaryWriter

            train_dir = cfg.train_dir
            if cfg.summary_every:
                hooks.append(SummaryHook(lambda: SummaryWriter(train_dir), cfg.summary_every))
            self._saver = CheckpointHook(self._checkpoint_manager(), cfg.checkpoint_every)
            hooks.append(self._saver)
        return hooks + self._extra_hooks

    # -- checkpoint state -----------------------------------------------------------------
    def checkpoint_state(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
        """Groups (``model``, ``optimizer``, ``ema``...) and metadata of a checkpoint now."""
        groups = self.strategy.state_dict()
        if self.ema is not None:
            groups["ema"] = self.ema.state_dict()
        metadata = checkpoint_metadata(self.strategy, {**self._metadata,
                                                       "batch_size": self.config.batch_size})
        as_dict = getattr(self.schedule, "as_dict", None)
        if as_dict is not None:
            metadata["schedule"] = as_dict()
        position = self._pipeline.position() if self._pipeline is not None else self._position
        if position is not None:
            metadata["data"] = position
        return groups, metadata

    def _save_before_stopping(self) -> tuple[Path, int] | None:
        """The chief's checkpoint when a step failed for a missing peer (None elsewhere)."""
        manager = self._checkpoint_manager()
        if manager is None or not self.strategy.is_chief:
            return None
        bad = self.non_finite_state()
        if bad is not None:
            raise NanLossDuringTrainingError(f"{bad} is not finite")
        groups, metadata = self.checkpoint_state()
        step = int(metadata["step"])
        return manager.save(step, groups, metadata), step

    def non_finite_state(self) -> str | None:
        """Name of a parameter or moving average holding NaN/inf, or None."""
        tensors = {name: p.detach() for name, p in self.model.named_parameters()}
        if self.ema is not None:
            tensors.update({f"ema/{k}": v for k, v in self.ema.shadow.items()})
        return non_finite_tensor(tensors)

    # -- the loop -------------------------------------------------------------------------
    def fit(self, max_steps: int | None = None) -> TrainResult:
        """Train until the global step reaches ``max_steps`` (default ``config.max_steps``).

        SIGTERM and SIGINT (in the main thread) stop it the way a scheduler
        expects: every replica finishes the step in flight, the chief writes a
        checkpoint at that step, and ``fit`` returns; a second signal, or
        ``config.stop_deadline`` seconds passing, abandons that checkpoint
        (:class:`~towerflow.training.stopping.FinalCheckpointAbandoned`).

        Raises:
            NanLossDuringTrainingError: the loss became NaN or infinite
                (``Model diverged with loss = NaN``); no checkpoint of the
                diverged model is written.
        """
        if max_steps is not None:
            self.config = self.config.replace(max_steps=max_steps)
        try:
            with StopSignals(deadline_s=self.config.stop_deadline) as self._stop:
                result = self._fit()
        except BaseException as exc:  # its peers must not count it finished
            self.strategy.end_training(finished=False, error=exc)
            raise
        self.strategy.end_training(finished=True, checkpoint_step=self._final_checkpoint())
        return result

    def _final_checkpoint(self) -> int | None:
        """The step of the last checkpoint the chief wrote or resumed from; None elsewhere."""
        if not self.strategy.is_chief or self._checkpoint_manager() is None:
            return None
        saved = self._saver.saved_step if self._saver is not None else None
        return saved if saved is not None else self._restored_from

    def _fit(self) -> TrainResult:
        self._setup()
        if self.global_step >= self.config.max_steps and self.strategy.is_chief:
            log.warning("%s already holds global step %d, which reaches max_steps %d: nothing "
                        "to train. Raise max_steps (--max-steps) or start another train_dir.",
                        repr(str(self.config.train_dir)) if self.config.train_dir else
                        "this run", self.global_step, self.config.max_steps)
        self.strategy.stop_at(self.config.max_steps)
        self._stopped_short = False
        hooks = self._hooks()
        for hook in hooks:
            hook.begin(self)
        ctx: StepContext | None = None
        error: BaseException | None = None
        last_loss: float | None = None
        try:
            for ctx in self._steps(hooks):
                if ctx.loss is not None:
                    last_loss = ctx.loss
                for hook in hooks:
                    hook.after_step(ctx)
            self.strategy.settle()  # the model holds every update this replica sent
            self._save_on_stop(ctx)
            self._save_after_peers(ctx)
        except PEER_FAILURES as exc:
            error = save_before_stopping(self.strategy, exc, self._save_before_stopping)
            raise error from exc
        except BaseException as exc:
            error = exc
            raise
        finally:
            for hook in reversed(hooks):
                with contextlib.suppress(Exception):
                    hook.end(ctx, error)
            self._close_pipeline()
        return TrainResult(self.global_step, last_loss, self._restored_from)

    def _save_on_stop(self, ctx: StepContext | None) -> None:
        """After a stop signal: the chief's checkpoint at the step reached, within the deadline."""
        signum = self._stop.requested
        if signum is None or ctx is None:
            return
        saver = self._saver
        if saver is None or not self.strategy.is_chief:
            log.info("stopped by signal %d at global step %d", signum, ctx.step)
            return
        with self._stop.final_save():
            path = saver.save_now(ctx.step)
        log.info("stopped by signal %d at global step %d; its checkpoint is %s: running the "
                 "same command again resumes from it", signum, ctx.step, path)

    def _save_after_peers(self, ctx: StepContext | None) -> None:
        """Asynchronous ps training: the chief's final checkpoint again once the other
        workers finished (bounded), so that it holds every push they were answered."""
        if ctx is None or self._stop.requested is not None or self._saver is None \
                or not self.strategy.is_chief:
            return
        # a chief that left the last steps to the others saves once they have pushed them
        if self.strategy.wait_for_peers(self.config.peers_wait) or self._stopped_short:
            self._saver.save_current()

    def _steps(self, hooks: Sequence[Hook]) -> Iterator[StepContext]:
        pipeline = self._pipeline
        if pipeline is None:
            raise FailedPreconditionError("The input pipeline is closed; call fit() to train.")
        strategy = self.strategy
        guard = NanGuard(self._checkpoint_manager())
        step = strategy.global_step
        while step < self.config.max_steps:
            batch = next(pipeline)
            if isinstance(pipeline, ReadAhead) and step + 1 < self.config.max_steps:
                strategy.ahead(pipeline.peek())
            lr = self.schedule(step) if self.schedule is not None else None
            with self._placement_log(step):
                result = strategy.run_step(self.loss_fn, batch, lr=lr)
            if result.stopped:  # the steps left are other workers' (asynchronous ps)
                self._stopped_short = True
                return
            step = result.global_step
            if self.ema is not None:
                strategy.settle()  # the average of the parameters with this step's update
                self.ema.update(num_updates=step - 1)
            guard.observe(step, result.loss)  # on the device: no host sync
            loss: float | None = None
            if any(hook.wants_loss(step) for hook in hooks):
                loss = guard.read(strategy, result.loss, step)
            global_batch = pipeline.examples_per_batch() * strategy.batches_per_step
            yield StepContext(step, self.config.max_steps, lr, loss, global_batch)
            if strategy.agree_to_stop(self._stop.requested is not None):
                return

    def _placement_log(self, step: int) -> contextlib.AbstractContextManager[Any]:
        """Log the placement of every operation of the first step when asked to."""
        if not self.config.log_device_placement or step != (self._restored_from or 0):
            return contextlib.nullcontext()
        from towerflow.devices import configure

        return configure(log_device_placement=True)

    def _close_pipeline(self) -> None:
        if self._pipeline is not None:
            self._position = self._pipeline.position()
            self._pipeline.close()
            self._pipeline = None

    # -- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the input pipeline and release the strategy if the trainer created it."""
        self._close_pipeline()
        if self._owns_strategy:
            self._train_model = None  # a DDP wrapper holds the process group
            self.strategy.shutdown()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
