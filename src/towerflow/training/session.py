"""The checkpoint machinery shared by the :class:`Trainer` and the :class:`Supervisor`.

Both resume the same way, save the same way and write the same checkpoint
metadata, so a train dir written by one is read by the other:

- :func:`restore_latest` — the latest good checkpoint of a directory into a
  strategy (parameters, optimizer state, global step);
- :func:`checkpoint_metadata` — the one metadata format: ``step`` (the step of
  the tensors), ``world_size``, the strategy's own facts under ``strategy``,
  then what the caller adds (``task``, ``schedule``, ``data``...);
- :func:`refuse_non_finite` — no checkpoint of a diverged model is ever written;
- :class:`SaveSchedule` — a save every N steps and/or every S seconds;
- :func:`save_before_stopping` — when a step fails because a peer is missing
  (``DeadlineExceededError`` / ``UnavailableError``), the chief checkpoints
  the last consistent state and the error names the missing tasks and the way
  out.

Example:
    >>> schedule = SaveSchedule(every_steps=10)
    >>> schedule.due(9), schedule.due(10)
    (False, True)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from towerflow.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    TowerflowError,
    UnavailableError,
)
from towerflow.strategies.base import Strategy
from towerflow.training.hooks import StepPeriod, non_finite_tensor, refuse_to_save

__all__ = ["SaveSchedule", "restore_latest", "checkpoint_metadata", "refuse_non_finite",
           "save_before_stopping", "PEER_FAILURES"]

#: step failures that mean a peer (a worker, a ps task) is missing
PEER_FAILURES = (DeadlineExceededError, UnavailableError)

log = logging.getLogger("towerflow.training")


class SaveSchedule:
    """When the next periodic checkpoint is due: every ``every_steps`` steps and/or ``every_secs`` s.

    By steps, the first step at or past each multiple is due (a worker's steps
    skip numbers in asynchronous training; see :class:`StepPeriod`).

    Args:
        every_steps: steps between saves (0 or None: not by steps).
        every_secs: seconds between saves (0 or None: not by time).
    """

    __slots__ = ("every_steps", "every_secs", "_last_time", "_period")

    def __init__(self, every_steps: int | None = None, every_secs: float | None = None) -> None:
        for name, value in (("every_steps", every_steps), ("every_secs", every_secs)):
            if value is not None and value < 0:
                raise InvalidArgumentError(f"{name} must be >= 0 (0 disables), got {value}.")
        self.every_steps = int(every_steps or 0)
        self.every_secs = float(every_secs or 0.0)
        self._last_time = time.monotonic()
        self._period = StepPeriod(self.every_steps, start=None)

    def due(self, step: int) -> bool:
        """Whether a checkpoint is due after ``step``."""
        by_time = self.every_secs > 0 and time.monotonic() - self._last_time >= self.every_secs
        return self._period.due(step) or by_time

    def saved(self, step: int) -> None:
        """Record that a checkpoint of ``step`` was just written."""
        self._last_time = time.monotonic()
        self._period.fired(step)


def restore_latest(manager: Any, strategy: Strategy,
                   device: str | torch.device | None = "cpu") -> Any:
    """Load the latest good checkpoint of ``manager`` into ``strategy``; None when there is none.

    The strategy decides who reads (:meth:`Strategy.restore_checkpoint`): mirrored
    replicas take replica 0's checkpoint through their process group and never
    read their own ``manager``'s directory. ``manager`` None reads nothing here.
    """
    ckpt = strategy.restore_checkpoint(
        lambda: manager.restore(device=device) if manager is not None else None)
    if ckpt is None:
        return None
    # chunked groups (a ps's sparse tables) are readers of their parts, loaded by the strategy
    strategy.load_state({**ckpt.groups, **ckpt.chunked}, ckpt.metadata.get("strategy"))
    log.info("restored %s at step %d", ckpt.path, ckpt.step)
    return ckpt


def checkpoint_metadata(strategy: Strategy,
                        extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The metadata of a checkpoint of ``strategy`` (call after ``strategy.state_dict()``).

    ``step`` is the step of the saved tensors: on a parameter server, that of
    the snapshot the ps tasks returned, which other workers may have advanced
    past this worker's last step.
    """
    facts = strategy.state_metadata()
    metadata: dict[str, Any] = dict(extra or {})
    metadata.update(step=int(facts.get("global_step", strategy.global_step)),
                    world_size=strategy.world_size, strategy=facts)
    return metadata


def refuse_non_finite(named: Mapping[str, torch.Tensor], step: int, manager: Any) -> None:
    """Raise :class:`NanLossDuringTrainingError` instead of saving a non-finite model.

    The same refusal as the trainer's checkpoint hook (:func:`refuse_to_save`).
    """
    refuse_to_save(non_finite_tensor(named), step, manager)


def save_before_stopping(strategy: Strategy, error: TowerflowError,
                         save: Callable[[], tuple[Path, int] | None]) -> TowerflowError:
    """Checkpoint what the chief has after a step failed for a missing peer; return the error.

    ``save()`` writes the checkpoint and returns its path and step (None: this
    task saves nothing). On a parameter server it holds the ps tasks' state as
    of the last global step completed on every shard. The returned error is of
    ``error``'s class; its message is ``error``'s, then the training tasks that
    do not answer, what was saved (or why nothing was) and the way out. Raise
    it ``from error``.
    """
    missing_peers = getattr(strategy, "missing_peers", None)
    missing = missing_peers() if missing_peers is not None else []
    not_answering = f" Not answering now: {'; '.join(missing)}." if missing else ""
    try:
        saved = save()
    except TowerflowError as exc:
        told = f" No checkpoint was written before stopping: {exc}"
    else:
        told = "" if saved is None else \
            f" The chief saved {saved[0]} (global step {saved[1]}) before stopping."
        if saved is not None:
            log.info("saved checkpoint %s before stopping", saved[0])
    way_out = getattr(strategy, "failure_way_out", None) or (
        " Restart the missing task with the same command: a restarted worker rejoins "
        "the running job (a sync step waits up to step_timeout for it), and a "
        "restarted chief resumes from the latest checkpoint.")
    return type(error)(f"{error}{not_answering}{told}{way_out}")
