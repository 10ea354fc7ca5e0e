"""``sv.saver``: TensorFlow's ``Saver.save(sess, save_path, global_step=None)`` for a Supervisor.

The articles save with ``sv.saver.save(sess, path, global_step=step)``;
:class:`SupervisorSaver` writes that checkpoint through its
:class:`~towerflow.training.supervisor.Supervisor` and passes every other
attribute through to the Supervisor's checkpoint manager.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from towerflow.errors import FailedPreconditionError, InvalidArgumentError

__all__ = ["SupervisorSaver"]


class SupervisorSaver:
    """``sv.saver``: TensorFlow's ``Saver.save(sess, save_path, global_step=None)`` over the
    Supervisor's checkpoint manager (whose other attributes it passes through).

    ``save_path`` names the checkpoint directory: ``log/linear/`` as it is,
    ``log/linear/model.ckpt`` its directory ``log/linear`` (a checkpoint is a
    directory named by its step, ``ckpt-<step>``, not a file prefix).
    ``global_step`` (an int or a 0-d tensor) is the step the checkpoint is
    saved as; by default the session's global step.
    """

    __slots__ = ("_supervisor", "_manager")

    def __init__(self, supervisor: Any, manager: Any) -> None:
        self._supervisor = supervisor
        self._manager = manager

    def save(self, sess: Any, save_path: str | Path | None = None,
             global_step: int | torch.Tensor | None = None, **tf_options: Any) -> str | None:
        """Write a checkpoint now (chief only) and return its path, as TensorFlow's does."""
        if tf_options:
            raise InvalidArgumentError(
                f"sv.saver.save() got {', '.join(sorted(tf_options))}, which towerflow has no "
                "use for (no meta graph, no state file); pass sess, save_path and global_step.")
        sv = self._supervisor
        if not sv.is_chief:
            sv.save(sess)  # says once that only the chief saves
            return None
        session = sess or sv._session
        if session is None:
            raise FailedPreconditionError("sv.saver.save() needs an open managed_session.")
        step = None if global_step is None else int(global_step)
        if save_path is None or _same_dir(save_path, self._manager.directory):
            path = sv._save_to(self._manager, session, schedule=True, step=step)
        else:
            from towerflow.checkpoint import CheckpointManager

            target = Path(save_path)
            directory = target if str(save_path).endswith(("/", "\\")) or target.is_dir() \
                else target.parent
            path = sv._save_to(CheckpointManager(directory, max_to_keep=sv.max_to_keep),
                               session, schedule=False, step=step)
        return str(path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)


def _same_dir(path: str | Path, directory: Path) -> bool:
    return Path(path).absolute() == Path(directory).absolute()
