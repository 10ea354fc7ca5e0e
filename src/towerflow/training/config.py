"""Options of the training loop, as one dataclass.

Example:
    >>> cfg = TrainConfig(train_dir="runs/c10", max_steps=100)
    >>> cfg.replace(batch_size=64).batch_size
    64
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from towerflow.errors import InvalidArgumentError

__all__ = ["TrainConfig"]


@dataclass(frozen=True)
class TrainConfig:
    """What the loop does when (article 001's flags and constants).

    Attributes:
        train_dir: where checkpoints and TensorBoard event files go; None keeps
            nothing on disk.
        max_steps: train until the global step reaches this.
        batch_size: examples per replica per step (a global step consumes
            ``batch_size x strategy.batches_per_step``: every replica's batch in
            all-reduce training, one worker's in async parameter-server training).
        log_every: print ``step N, loss = ...`` every this many steps (and
            check the loss for NaN then).
        summary_every: write TensorBoard summaries every this many steps (0: never).
        checkpoint_every: save a checkpoint every this many steps (0: only at
            the last step).
        max_to_keep: checkpoints kept (None keeps all).
        ema_decay: moving-average decay of the parameters (None: no averages).
        seed: seed of the data order and the augmentation.
        prefetch_capacity: batches queued on the device ahead of the step
            (default ``2 x world_size``, the article's queue).
        progress: show a progress bar; None shows one when stderr is a terminal.
        log_device_placement: log where each operation of the first step runs.
        restore: resume from the latest checkpoint in ``train_dir`` when there is one.
        stop_deadline: seconds after SIGTERM / SIGINT that the final checkpoint may
            take (the step in flight finishes first); past it, or on a second
            signal, the checkpoint is abandoned and no partial one is left
            (0: no deadline).
        peers_wait: seconds the chief of an asynchronous ps job waits, after its
            last step, for the other workers to finish before its final checkpoint.
    """

    train_dir: str | Path | None = None
    max_steps: int = 1000
    batch_size: int = 128
    log_every: int = 10
    summary_every: int = 100
    checkpoint_every: int = 1000
    max_to_keep: int | None = 5
    ema_decay: float | None = 0.9999
    seed: int = 0
    prefetch_capacity: int | None = None
    progress: bool | None = None
    log_device_placement: bool = False
    restore: bool = True
    stop_deadline: float = 30.0
    peers_wait: float = 60.0

    def __post_init__(self) -> None:
        for name in ("max_steps", "batch_size", "log_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(
                    f"TrainConfig.{name} must be a positive integer, got {value!r}."
                )
        for name in ("summary_every", "checkpoint_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise InvalidArgumentError(
                    f"TrainConfig.{name} must be a non-negative integer (0 disables), "
                    f"got {value!r}."
                )
        if not isinstance(self.stop_deadline, int | float) or self.stop_deadline < 0:
            raise InvalidArgumentError(
                f"TrainConfig.stop_deadline must be a number of seconds >= 0 (0: no deadline), "
                f"got {self.stop_deadline!r}.")
        if self.train_dir is not None:
            from towerflow.checkpoint.files import check_directory

            check_directory(self.train_dir, "the train directory")
        if self.max_to_keep is not None and self.max_to_keep < 1:
            raise InvalidArgumentError(
                f"TrainConfig.max_to_keep must be at least 1 or None, got {self.max_to_keep!r}."
            )

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes`` applied (unknown names are an error)."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise InvalidArgumentError(
                f"Unknown training option(s) {', '.join(unknown)}; known options: "
                f"{', '.join(sorted(known))}."
            )
        return dataclasses.replace(self, **changes)
