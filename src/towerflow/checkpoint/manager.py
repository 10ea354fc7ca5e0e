"""A directory of numbered checkpoints with a ``latest`` pointer.

Layout of a train dir::

    runs/c10/
        ckpt-00001000/      complete checkpoints (see towerflow.checkpoint.format)
        ckpt-00002000/
        latest              one line: "ckpt-00002000"
        .tmp-...            a save in progress, or left by a killed writer

A save writes the new checkpoint under a temporary name, renames it into place,
then replaces ``latest`` atomically, then deletes the oldest checkpoints beyond
``max_to_keep``. Killed at any moment, the directory still has a ``latest``
that names a complete checkpoint (or none yet); temporary entries are ignored
by readers and removed by the next manager.

Reading picks the checkpoint ``latest`` names, verifying every checksum; if it
is corrupt or truncated, a warning names the bad file and the newest earlier
checkpoint that verifies is used instead.

Example:
    >>> import tempfile, torch
    >>> mgr = CheckpointManager(tempfile.mkdtemp(), max_to_keep=2)
    >>> mgr.save(10, {"model": {"w": torch.ones(2)}}).name
    'ckpt-00000010'
    >>> mgr.restore().groups["model"]["w"]
    tensor([1., 1.])
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from towerflow.checkpoint.atomic import remove_stale_temps, remove_tree, write_file_atomic
from towerflow.checkpoint.format import (
    Checkpoint,
    check_step,
    read_checkpoint,
    verify_checkpoint,
    write_checkpoint_dir,
)
from towerflow.errors import DataLossError, InvalidArgumentError, NotFoundError

__all__ = ["LATEST_NAME", "CheckpointManager", "checkpoint_name", "latest_checkpoint"]

logger = logging.getLogger("towerflow.checkpoint")

LATEST_NAME = "latest"
_CKPT_RE = re.compile(r"^ckpt-(\d{8,})$")
_T = TypeVar("_T")


def checkpoint_name(step: int) -> str:
    """Return the directory name of the checkpoint at ``step``.

    Example:
        >>> checkpoint_name(1000)
        'ckpt-00001000'
    """
    return f"ckpt-{step:08d}"


def _list(directory: Path) -> list[tuple[int, Path]]:
    """Complete checkpoint directories as (step, path), oldest first."""
    try:
        names = [p for p in directory.iterdir() if p.is_dir()]
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for p in names:
        match = _CKPT_RE.match(p.name)
        if match:
            found.append((int(match.group(1)), p))
    return sorted(found)


def _pointer(directory: Path) -> Path | None:
    """The checkpoint ``latest`` names, if the pointer is well formed and it exists."""
    try:
        name = (directory / LATEST_NAME).read_text(encoding="utf-8").strip()
    except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError):
        return None
    if not _CKPT_RE.match(name):
        return None
    path = directory / name
    return path if path.is_dir() else None


def _candidates(directory: Path) -> Iterator[Path]:
    """Checkpoints to try, best first: the pointer's, then the rest newest first.

    Checkpoints newer than the pointer's are skipped: their save never
    committed (the writer died before replacing ``latest``).
    """
    pointed = _pointer(directory)
    listed = _list(directory)
    if pointed is not None:
        yield pointed
        limit = next((s for s, p in listed if p == pointed), None)
        listed = [(s, p) for s, p in listed if limit is None or s < limit]
    for _, path in reversed(listed):
        if path != pointed:
            yield path


def _first_good(directory: Path, attempt: Callable[[Path], _T]) -> _T | None:
    """Return ``attempt(path)`` for the first candidate that is not corrupt."""
    bad: list[str] = []
    for path in _candidates(directory):
        try:
            result = attempt(path)
        except NotFoundError:  # removed meanwhile by another process's max_to_keep
            logger.debug("Checkpoint %s vanished while being read; trying the previous one.", path)
            continue
        except DataLossError as exc:
            bad.append(path.name)
            logger.warning("Skipping corrupt checkpoint: %s Falling back to the previous one.", exc)
            continue
        if bad:
            logger.warning(
                "Restored checkpoint %s instead of the corrupt %s.", path, ", ".join(bad)
            )
        return result
    if bad:
        logger.warning(
            "Every checkpoint in %s is corrupt (%s); starting without one.", directory, ", ".join(bad)
        )
    return None


def latest_checkpoint(directory: str | Path) -> Path | None:
    """Return the newest complete checkpoint in ``directory`` that verifies, or None.

    A corrupt or truncated checkpoint is skipped with a logged warning that
    names the bad file.
    """
    directory = Path(directory)

    def check(path: Path) -> Path:
        verify_checkpoint(path)
        return path

    return _first_good(directory, check)


class CheckpointManager:
    """Numbered, atomically written checkpoints in one directory.

    Args:
        directory: The train dir; created if missing.
        max_to_keep: How many checkpoints to keep (the oldest are deleted
            after each save); None keeps all.
    """

    def __init__(self, directory: str | Path, max_to_keep: int | None = 5) -> None:
        if max_to_keep is not None and (
            isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1
        ):
            raise InvalidArgumentError(
                f"max_to_keep={max_to_keep!r} must be a positive integer, or None to keep every checkpoint."
            )
        self.directory = Path(directory)
        self.max_to_keep = max_to_keep
        self.directory.mkdir(parents=True, exist_ok=True)
        self._cleanup()

    def __repr__(self) -> str:
        return f"CheckpointManager({str(self.directory)!r}, max_to_keep={self.max_to_keep})"

    def _cleanup(self) -> None:
        removed = remove_stale_temps(self.directory)
        if removed:
            logger.info("Removed leftovers of interrupted saves in %s: %s", self.directory, removed)

    def save(
        self,
        step: int,
        groups: Mapping[str, Mapping[str, torch.Tensor]],
        metadata: Mapping[str, Any] | None = None,
    ) -> Path:
        """Write the checkpoint of ``step`` and point ``latest`` at it.

        Args:
            step: The global step (names the directory ``ckpt-<step:08d>``).
            groups: Group name -> tensor name -> tensor, on any device.
            metadata: JSON-able values (schedule, data position, ...).

        Returns:
            The new checkpoint directory.
        """
        self._cleanup()
        check_step(step)
        name = checkpoint_name(step)
        path = write_checkpoint_dir(self.directory / name, step, groups, metadata)
        write_file_atomic(self.directory / LATEST_NAME, name + "\n")
        self._prune(keep=path)
        return path

    def _prune(self, keep: Path) -> None:
        if self.max_to_keep is None:
            return
        others = [p for _, p in _list(self.directory) if p != keep]
        excess = len(others) + 1 - self.max_to_keep
        for path in others[: max(excess, 0)]:
            remove_tree(path)

    def checkpoints(self) -> list[Path]:
        """Complete checkpoint directories, oldest first (not verified)."""
        return [p for _, p in _list(self.directory)]

    def latest(self) -> Path | None:
        """The newest checkpoint that verifies (see :func:`latest_checkpoint`)."""
        return latest_checkpoint(self.directory)

    def restore(self, device: str | torch.device | None = "cpu") -> Checkpoint | None:
        """Read the newest checkpoint that verifies onto ``device``; None if there is none.

        A corrupt or truncated checkpoint is skipped with a warning naming the
        bad file, and the previous complete one is read instead.
        """
        return _first_good(self.directory, lambda p: read_checkpoint(p, device=device))

    def restore_or_raise(self, device: str | torch.device | None = "cpu") -> Checkpoint:
        """Like :meth:`restore`, but a missing checkpoint is a NotFoundError."""
        ckpt = self.restore(device)
        if ckpt is None:
            raise NotFoundError(
                f"No checkpoint in {str(self.directory)!r}; train first, or point to the train dir "
                "that holds the checkpoints."
            )
        return ckpt
