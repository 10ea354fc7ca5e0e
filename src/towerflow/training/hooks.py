"""What the loop does around the steps: step log, NaN guard, summaries, checkpoints, progress.

Each hook is told about every step through a :class:`StepContext`. Reading
the loss synchronises the host with the device, so the loop reads it only on
steps where some hook asks for it (:meth:`Hook.wants_loss`): every 10 steps
for the log, every 100 for summaries, before every checkpoint. Every replica
runs the same hooks (the loss read is a collective); only the chief writes.

The step log has article 001's format, timestamp first::

    2026-11-22 10:00:00.123456: step 10, loss = 2.30 (1234.5 examples/sec; 0.104 sec/batch)

where examples/sec counts the global batch (all replicas) and sec/batch is, as
the article computes it, the mean wall time of one step since the previous
line divided by the batches one step consumes (``duration / num_gpus``).

The NaN guard (:class:`NanGuard`) folds every step's loss into an on-device
"first non-finite step" tensor without synchronising; it is read together
with the loss on the steps that read the loss anyway, and names the exact step
at which the loss first became NaN or infinite.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

import torch

from towerflow.errors import FailedPreconditionError, NanLossDuringTrainingError

if TYPE_CHECKING:
    from towerflow.checkpoint import CheckpointManager
    from towerflow.strategies.base import Strategy
    from towerflow.training.summaries import SummaryWriter

__all__ = [
    "NanLossDuringTrainingError",
    "StepContext",
    "TrainerView",
    "Hook",
    "StepLogHook",
    "SummaryHook",
    "CheckpointHook",
    "ProgressHook",
    "NanGuard",
    "check_finite_loss",
    "format_step_line",
]

log = logging.getLogger("towerflow.training")


@dataclass(slots=True)
class StepContext:
    """One finished step, as the hooks see it.

    Attributes:
        step: the global step after the update.
        max_steps: where training stops.
        lr: the learning rate of the step (None when no schedule is used).
        loss: the loss averaged over replicas, or None when no hook asked for it.
        global_batch: examples one global step consumes (every replica's batch in
            all-reduce training, one worker's batch in async parameter-server training).
    """

    step: int
    max_steps: int
    lr: float | None
    loss: float | None
    global_batch: int


def _newest(manager: CheckpointManager | None) -> Path | None:
    saved = manager.checkpoints() if manager is not None else []
    return saved[-1] if saved else None


def _checkpoint_note(newest: Path | None) -> str:
    """Where the newest checkpoint (always finite) is, or ``""`` when none was written."""
    return f"; the newest checkpoint, {str(newest)!r}, holds finite parameters" if newest else ""


def _diverged(step: int, loss: float, newest: Path | None,
              read_at: int | None = None) -> NanLossDuringTrainingError:
    seen = f", read at step {read_at}" if read_at is not None and read_at != step else ""
    return NanLossDuringTrainingError(
        f"Model diverged with loss = NaN at step {step} (loss {loss}{seen})"
        f"{_checkpoint_note(newest)}. Lower the learning rate (--lr) or check the input data."
    )


def refuse_to_save(bad: str | None, step: int, manager: CheckpointManager | None) -> None:
    """Raise instead of saving a model whose tensor ``bad`` is not finite (None: finite).

    The message names the newest checkpoint of ``manager`` (always finite) only
    when there is one.
    """
    if bad is None:
        return
    raise NanLossDuringTrainingError(
        f"Model diverged with loss = NaN: {bad} is not finite at step {step} and was not "
        f"saved{_checkpoint_note(_newest(manager))}. Lower the learning rate (--lr)."
    )


def check_finite_loss(loss: float, step: int, train_dir: Any = None) -> None:
    """Raise :class:`NanLossDuringTrainingError` when ``loss`` is NaN or infinite.

    The message names the newest checkpoint in ``train_dir`` (if any), which the
    loop only ever writes from finite parameters.

    Example:
        >>> check_finite_loss(2.3, 10)
        >>> try:
        ...     check_finite_loss(float("nan"), 20)
        ... except NanLossDuringTrainingError as exc:
        ...     print(str(exc)[:41])
        Model diverged with loss = NaN at step 20
    """
    if math.isfinite(loss):
        return
    newest = None
    if train_dir is not None and Path(train_dir).is_dir():
        from towerflow.checkpoint import latest_checkpoint

        newest = latest_checkpoint(train_dir)
    raise _diverged(step, loss, newest)


def format_step_line(step: int, loss: float, examples_per_sec: float, sec_per_batch: float,
                     now: datetime | None = None) -> str:
    """Article 001's step log line, stamped with ``now`` (default: the current time).

    Example:
        >>> format_step_line(10, 2.3012, 1234.54, 0.1037, datetime(2026, 11, 22, 10))
        '2026-11-22 10:00:00.000000: step 10, loss = 2.30 (1234.5 examples/sec; 0.104 sec/batch)'
    """
    stamp = (now or datetime.now()).isoformat(sep=" ", timespec="microseconds")
    return (f"{stamp}: step {step}, loss = {loss:.2f} ({examples_per_sec:.1f} examples/sec; "
            f"{sec_per_batch:.3f} sec/batch)")


# a step number travels as two float32 halves, each exact after an all-reduce
_HALF = 4096
_WINDOW = 256  # losses checked together by NanGuard


class NanGuard:
    """The exact step at which the loss first became NaN or infinite, with no sync per step.

    :meth:`observe` runs every step and only queues device work: it keeps an
    on-device tensor holding the first step whose loss was not finite (-1
    while there is none). :meth:`read` runs on the steps where the loss is read
    anyway; it reduces the loss and every replica's first bad step in one
    collective and raises :class:`NanLossDuringTrainingError` naming the
    earliest.

    Args:
        manager: the run's checkpoints, named in the message when there are
            any (None: the run writes none).

    Example:
        >>> import torch
        >>> class One:  # a single process: the mean over replicas is the value
        ...     rank, world_size = 0, 1
        ...     def reduce_mean(self, value): return value
        >>> guard = NanGuard()
        >>> for step, loss in enumerate([2.3, 2.1, float("nan"), 2.0], start=1):
        ...     guard.observe(step, torch.tensor(loss))
        >>> try:
        ...     guard.read(One(), torch.tensor(2.0), 4)
        ... except NanLossDuringTrainingError as exc:
        ...     print(str(exc)[:40])
        Model diverged with loss = NaN at step 3
    """

    def __init__(self, manager: CheckpointManager | None = None) -> None:
        self.manager = manager
        self._first: torch.Tensor | None = None
        self._losses: torch.Tensor | None = None  # this window's losses, on their device
        self._steps: list[int] = []  # the steps of those losses

    def observe(self, step: int, loss: torch.Tensor) -> None:
        """Record ``step`` if its loss is the first non-finite one (device work only).

        One copy per step: the loss goes into a window of ``_WINDOW`` losses on
        its device, checked all at once when the window is full or read.
        """
        loss = loss.detach()
        window = self._losses
        if loss.numel() != 1:  # not a scalar loss: checked on its own
            self._fold()
            self._steps.append(step)
            self._fold(torch.isfinite(loss).all().reshape(1))
            return
        if window is None or window.device != loss.device or window.dtype != loss.dtype:
            self._fold()
            window = self._losses = torch.empty(_WINDOW, dtype=loss.dtype, device=loss.device)
        window[len(self._steps)] = loss.reshape(())
        self._steps.append(step)
        if len(self._steps) == _WINDOW:
            self._fold()

    def _fold(self, finite: torch.Tensor | None = None) -> None:
        """Fold the window (or ``finite``, flags of its steps) into the first bad step."""
        if not self._steps:
            return
        if finite is None:
            finite = torch.isfinite(self._losses[:len(self._steps)])  # type: ignore[index]
        device = finite.device
        if self._first is None:
            self._first = torch.full((), -1, dtype=torch.int64, device=device)
        steps = torch.tensor(self._steps, dtype=torch.int64)
        if device.type == "cuda":  # an asynchronous copy: no host sync
            steps = steps.pin_memory().to(device, non_blocking=True)
        first_bad = steps[(~finite).to(torch.uint8).argmax()]
        keep = finite.all() | (self._first.to(device) >= 0)
        self._first = torch.where(keep, self._first.to(device), first_bad)
        self._steps = []

    def read(self, strategy: Any, loss: torch.Tensor, step: int) -> float:
        """The loss of ``step`` averaged over replicas; raise if any replica saw a bad loss.

        Every replica calls it on the same steps (it is one collective).
        """
        self._fold()
        world, rank = strategy.world_size, strategy.rank
        loss = loss.detach().reshape(()).to(torch.float32)
        packed = torch.zeros(1 + 2 * world, dtype=torch.float32, device=loss.device)
        packed[0] = loss
        if self._first is not None:
            first = (self._first + 1).to(loss.device)  # 0: no bad step on this replica
            packed[1 + 2 * rank] = torch.div(first, _HALF, rounding_mode="floor")
            packed[2 + 2 * rank] = first % _HALF
        values = [v * world for v in strategy.reduce_mean(packed).cpu().tolist()]
        mean_loss = values[0] / world
        firsts = [round(values[1 + 2 * i]) * _HALF + round(values[2 + 2 * i]) - 1
                  for i in range(world)]
        bad = [first for first in firsts if first >= 0]
        if bad or not math.isfinite(mean_loss):
            raise _diverged(min(bad, default=step), mean_loss, _newest(self.manager),
                           read_at=step)
        return mean_loss


class _Rate:
    """Steps and wall time since the previous reading."""

    __slots__ = ("_step", "_time")

    def __init__(self, step: int) -> None:
        self._step = step
        self._time = time.perf_counter()

    def read(self, step: int, global_batch: int, batches: int = 1) -> tuple[float, float]:
        """``(examples/sec, sec/batch)`` since the last read; resets the interval.

        A step's duration is the interval over the steps in it; sec/batch
        divides it by the ``batches`` one step consumes, as article 001 divides
        by ``num_gpus``.
        """
        now = time.perf_counter()
        steps = max(step - self._step, 1)
        duration = max(now - self._time, 1e-9) / steps
        self._step, self._time = step, now
        return global_batch / duration, duration / max(batches, 1)


class StepPeriod:
    """When an every-``N``-steps action is due: the first step of each new multiple of ``N``.

    A step that lands on a multiple is due, as is the first step past one the
    loop never saw: in asynchronous parameter-server training the other
    workers' pushes advance the global step too, so one worker's steps skip
    numbers and ``step % N == 0`` would miss most multiples.

    ``start`` is the step the loop resumes from; None takes it from the first
    step asked about (the step before it).

    Example:
        >>> period = StepPeriod(10, start=0)
        >>> [s for s in (3, 9, 11, 12, 20, 37) if period.due(s) and period.fired(s) is None]
        [11, 20, 37]
    """

    __slots__ = ("every", "_last")

    def __init__(self, every: int, start: int | None = 0) -> None:
        self.every = every
        self._last: int | None = None
        if start is not None and every > 0:
            self._last = start // every

    def due(self, step: int) -> bool:
        """Whether ``step`` is the first step at or past a multiple not yet acted on."""
        if self.every <= 0:
            return False
        if self._last is None:
            self._last = (step - 1) // self.every
        return step // self.every > self._last

    def fired(self, step: int) -> None:
        """Record that the action ran at ``step``."""
        if self.every > 0:
            self._last = step // self.every


class TrainerView(Protocol):
    """What a hook sees of the :class:`~towerflow.training.loop.Trainer` that runs it."""

    model: torch.nn.Module
    strategy: Strategy

    @property
    def max_steps(self) -> int:
        """Where training stops."""
        ...

    @property
    def global_step(self) -> int:
        """The global step now."""
        ...

    def checkpoint_state(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
        """Groups and metadata of a checkpoint now."""
        ...

    def non_finite_state(self) -> str | None:
        """Name of a parameter or moving average holding NaN/inf, or None."""
        ...


class Hook:
    """Base class: override what you need. ``begin`` runs after restoring."""

    def begin(self, trainer: TrainerView) -> None:
        """Called once before the first step, with the prepared trainer."""

    def wants_loss(self, step: int) -> bool:
        """Whether the loss of ``step`` must be read (the same answer on every replica)."""
        return False

    def after_step(self, ctx: StepContext) -> None:
        """Called after every step."""

    def end(self, ctx: StepContext | None, error: BaseException | None) -> None:
        """Called once when the loop stops (``error`` is what stopped it, if anything)."""


class _PeriodicHook(Hook):
    """A hook that acts on the loss every ``self._period`` steps (:class:`StepPeriod`)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self._rate = _Rate(0)
        self._period = StepPeriod(every)

    def begin(self, trainer: TrainerView) -> None:
        """Count from the step the loop starts at."""
        self._rate = _Rate(trainer.global_step)
        self._period = StepPeriod(self.every, trainer.global_step)

    def wants_loss(self, step: int) -> bool:
        return self._period.due(step)

    def after_step(self, ctx: StepContext) -> None:
        if ctx.loss is None or not self._period.due(ctx.step):
            return
        self._period.fired(ctx.step)
        self._report(ctx)

    def _report(self, ctx: StepContext) -> None:
        """Act at ``ctx`` (a due step whose loss was read)."""


class StepLogHook(_PeriodicHook):
    """Print ``<time>: step N, loss = ...`` every ``every`` steps (chief only)."""

    def __init__(self, every: int = 10, stream: TextIO | None = None) -> None:
        super().__init__(every)
        self.stream = stream
        self._chief = True
        self._batches = 1

    def begin(self, trainer: TrainerView) -> None:
        super().begin(trainer)
        self._chief = trainer.strategy.is_chief
        self._batches = trainer.strategy.batches_per_step

    def _report(self, ctx: StepContext) -> None:
        examples_per_sec, sec_per_batch = self._rate.read(ctx.step, ctx.global_batch,
                                                          self._batches)
        if self._chief:
            line = format_step_line(ctx.step, ctx.loss, examples_per_sec, sec_per_batch)
            print(line, file=self.stream or sys.stdout, flush=True)


class SummaryHook(_PeriodicHook):
    """TensorBoard scalars and histograms every ``every`` steps (chief only).

    With ps tasks (a ``ParameterServer`` strategy) the scalars include the
    job's ``cluster/...`` figures per ps shard and per replica
    (:class:`~towerflow.ps.worker.observe.ChiefClusterScalars`), as the Supervisor's do.
    """

    def __init__(self, writer_factory: Any, every: int = 100) -> None:
        super().__init__(every)
        self._factory = writer_factory
        self._writer: SummaryWriter | None = None
        self._trainer: TrainerView | None = None
        self._cluster: Any = None

    def begin(self, trainer: TrainerView) -> None:
        super().begin(trainer)
        self._trainer = trainer
        if trainer.strategy.is_chief:
            from towerflow.ps.worker.observe import ChiefClusterScalars

            self._writer = self._factory()
            self._cluster = ChiefClusterScalars()

    def _report(self, ctx: StepContext) -> None:
        examples_per_sec, _ = self._rate.read(ctx.step, ctx.global_batch)
        if self._writer is None or self._trainer is None:
            return
        scalars = {"loss": ctx.loss, "examples_per_sec": examples_per_sec}
        if ctx.lr is not None:
            scalars["learning_rate"] = ctx.lr
        if self._cluster is not None:
            scalars.update(self._cluster.read(self._trainer.strategy))
        from towerflow.training.summaries import parameter_histograms

        self._writer.scalars(ctx.step, scalars)
        self._trainer.strategy.settle()
        self._writer.histograms(ctx.step, parameter_histograms(
            self._trainer.model.named_parameters()))

    def end(self, ctx: StepContext | None, error: BaseException | None) -> None:
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class CheckpointHook(Hook):
    """Save every ``every`` steps and at the last step; never a non-finite model."""

    def __init__(self, manager: CheckpointManager, every: int = 1000) -> None:
        self.manager = manager
        self.every = every
        self.saved_step: int | None = None  # of the last checkpoint it wrote
        self._path: Path | None = None
        self._trainer: TrainerView | None = None
        self._period = StepPeriod(every)

    def begin(self, trainer: TrainerView) -> None:
        self._trainer = trainer
        self._period = StepPeriod(self.every, trainer.global_step)

    def _due(self, step: int, max_steps: int) -> bool:
        # >=: in asynchronous training another worker's push may carry the step past max_steps
        return self._period.due(step) or step >= max_steps

    def wants_loss(self, step: int) -> bool:
        trainer = self._trainer
        return trainer is not None and self._due(step, trainer.max_steps)

    def after_step(self, ctx: StepContext) -> None:
        trainer = self._trainer
        if trainer is None or not self._due(ctx.step, ctx.max_steps):
            return
        self._period.fired(ctx.step)
        refuse_to_save(trainer.non_finite_state(), ctx.step, self.manager)
        if trainer.strategy.is_chief:
            self._write(trainer, ctx.step)

    def save_now(self, step: int) -> Path:
        """The chief's checkpoint of ``step`` now (kept when it was just written); its path."""
        trainer = self._trainer
        if trainer is None:
            raise FailedPreconditionError("CheckpointHook.save_now before begin(trainer).")
        if self.saved_step == step and self._path is not None:
            return self._path
        refuse_to_save(trainer.non_finite_state(), step, self.manager)
        return self._write(trainer, step)

    def save_current(self) -> Path:
        """The chief's checkpoint of the state as it is now, at the step it holds."""
        trainer = self._trainer
        if trainer is None:
            raise FailedPreconditionError("CheckpointHook.save_current before begin(trainer).")
        return self._write(trainer, None)

    def _write(self, trainer: TrainerView, step: int | None) -> Path:
        groups, metadata = trainer.checkpoint_state()
        step = int(metadata["step"]) if step is None else step
        self._path = self.manager.save(step, groups, metadata)
        self.saved_step = step
        log.info("saved checkpoint %s", self._path)
        return self._path


class ProgressHook(Hook):
    """A ``rich`` progress bar on stderr, shown only when stderr is a terminal."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = enabled
        self._progress: Any = None
        self._task: Any = None

    def begin(self, trainer: TrainerView) -> None:
        enabled = sys.stderr.isatty() if self.enabled is None else self.enabled
        if not (enabled and trainer.strategy.is_chief):
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

        self._progress = Progress(
            "[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
            TimeRemainingColumn(), console=Console(stderr=True), transient=True,
        )
        self._progress.start()
        self._task = self._progress.add_task(
            "training", total=trainer.max_steps, completed=trainer.global_step)

    def after_step(self, ctx: StepContext) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=ctx.step)

    def end(self, ctx: StepContext | None, error: BaseException | None) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def non_finite_tensor(named: dict[str, torch.Tensor]) -> str | None:
    """The name of the first tensor holding a NaN or an infinity, or None."""
    names = list(named)
    if not names:
        return None
    flags = torch.stack([torch.isfinite(named[n]).all() for n in names]).cpu()
    for name, ok in zip(names, flags.tolist(), strict=True):
        if not ok:
            return name
    return None
