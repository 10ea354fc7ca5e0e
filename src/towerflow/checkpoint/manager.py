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

Reading picks the checkpoint ``latest`` names, verifying the manifest's
digest and every checksum; if it is damaged — a corrupt or truncated file, a
manifest that fails its digest, a symbolic link or anything but a real
directory in place of the checkpoint or of one of its files, a step that
disagrees with the directory's name — a warning says what is wrong and the
newest earlier checkpoint that verifies is used instead. A damaged or planted
``latest`` pointer is likewise warned about and passed over.

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
import os
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from towerflow.checkpoint.atomic import remove_stale_temps, remove_tree, write_file_atomic
from towerflow.checkpoint.files import check_directory, open_dir, read_regular
from towerflow.checkpoint.format import (
    MANIFEST_NAME,
    Checkpoint,
    read_checkpoint_dir,
    verify_checkpoint,
    write_checkpoint_dir,
)
from towerflow.checkpoint.manifest import check_step
from towerflow.errors import CheckpointError, DataLossError, InvalidArgumentError, NotFoundError

__all__ = [
    "LATEST_NAME",
    "CheckpointManager",
    "checkpoint_name",
    "latest_checkpoint",
    "read_checkpoint",
]

logger = logging.getLogger("towerflow.checkpoint")

LATEST_NAME = "latest"
_CKPT_RE = re.compile(r"ckpt-(\d{8,})")
_MAX_POINTER_BYTES = 4096
_T = TypeVar("_T")


def checkpoint_name(step: int) -> str:
    """Return the directory name of the checkpoint at ``step``.

    Example:
        >>> checkpoint_name(1000)
        'ckpt-00001000'
    """
    return f"ckpt-{step:08d}"


def _list(directory: Path) -> list[tuple[int, Path]]:
    """Checkpoint entries as (step, path), oldest first.

    Real directories, and symbolic links by a checkpoint's name (which a
    reader refuses, with a warning); other entries are not checkpoints.
    """
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for entry in entries:
        match = _CKPT_RE.fullmatch(entry.name)
        if match and (entry.is_symlink() or entry.is_dir(follow_symlinks=False)):
            found.append((int(match.group(1)), directory / entry.name))
    return sorted(found)


def _pointer(directory: Path) -> Path | None:
    """The checkpoint ``latest`` names; None (with a warning if damaged) otherwise."""
    try:
        with open_dir(directory) as dir_fd:
            raw = read_regular(dir_fd, directory, LATEST_NAME, max_bytes=_MAX_POINTER_BYTES,
                               what="latest pointer")
    except NotFoundError:
        return None
    except CheckpointError as exc:
        logger.warning("%s Using the newest checkpoint that verifies instead.", exc)
        return None
    if raw is None:
        return None
    name = raw.decode("utf-8", errors="replace").strip()
    path = directory / name
    if not _CKPT_RE.fullmatch(name) or not os.path.lexists(path):
        logger.warning(
            "The latest pointer %s names %r, which is not a checkpoint in that directory; using "
            "the newest checkpoint that verifies instead.", directory / LATEST_NAME, name[:80],
        )
        return None
    return path


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


def _check_name(path: Path, step: int) -> None:
    """Refuse a ``ckpt-<N>`` directory whose manifest holds another step than N."""
    match = _CKPT_RE.fullmatch(path.name)
    if match and int(match.group(1)) != step:
        raise CheckpointError(
            f"Checkpoint {str(path)!r} holds step {step} but its name says step "
            f"{int(match.group(1))}: it was copied, renamed or edited; restore an earlier "
            "checkpoint."
        )


def _read_member(path: Path, device: str | torch.device | None, verify: bool) -> Checkpoint:
    """Read a checkpoint of a train dir: a real directory whose name matches its step."""
    ckpt = read_checkpoint_dir(path, device, verify, follow_symlinks=False)
    _check_name(path, ckpt.step)
    return ckpt


def _verify_member(path: Path) -> Path:
    _check_name(path, verify_checkpoint(path, follow_symlinks=False)["step"])
    return path


def _first_good(directory: Path, attempt: Callable[[Path], _T]) -> tuple[_T | None, list[str]]:
    """``attempt(path)`` for the first candidate that is not damaged, and what was damaged."""
    bad: list[str] = []
    for path in _candidates(directory):
        try:
            result = attempt(path)
        except NotFoundError:  # removed meanwhile by another process's max_to_keep
            logger.debug("Checkpoint %s vanished while being read; trying the previous one.", path)
            continue
        except DataLossError as exc:
            bad.append(f"{path.name} ({exc})")
            logger.warning("Skipping damaged checkpoint: %s Falling back to the previous one.", exc)
            continue
        if bad:
            logger.warning("Restored checkpoint %s instead of the damaged %s.", path,
                           ", ".join(b.split(" ", 1)[0] for b in bad))
        return result, bad
    return None, bad


def _all_damaged(directory: Path, bad: list[str]) -> CheckpointError:
    return CheckpointError(
        f"Every checkpoint in {str(directory)!r} is damaged: " + "; ".join(bad)
        + ". Restore a backup of the train dir, or train again in a new one."
    )


def latest_checkpoint(directory: str | Path) -> Path | None:
    """Return the newest checkpoint in the train dir ``directory`` that verifies, or None.

    A damaged checkpoint is skipped with a logged warning that says what is
    wrong with it (a corrupt or truncated file, a manifest that fails its
    digest, a symbolic link, a step that disagrees with the name, ...).

    Raises:
        CheckpointError: ``directory`` holds checkpoints but every one is
            damaged (each is named with what is wrong).
    """
    directory = Path(directory)
    found, bad = _first_good(directory, _verify_member)
    if found is None and bad:
        raise _all_damaged(directory, bad)
    return found


def _holds_checkpoints(path: Path) -> bool:
    """Whether ``path`` is a train dir (a ``latest`` pointer or ``ckpt-*`` entries)."""
    return os.path.lexists(path / LATEST_NAME) or bool(_list(path))


def read_checkpoint(
    path: str | Path, device: str | torch.device | None = "cpu", verify: bool = True
) -> Checkpoint:
    """Read a checkpoint onto ``device``.

    Args:
        path: A checkpoint directory (``.../ckpt-00001000``, whose manifest
            must hold step 1000), or a train dir, whose newest checkpoint that
            verifies is read (a damaged one is skipped with a warning).
        device: Where the tensors go: a ``torch.device`` or a torch name
            (``"cpu"``, ``"cuda:0"``); None is the CPU.
        verify: Check every data file's SHA-256 (the manifest's digest,
            sizes, dtypes and shapes are always checked).

    Raises:
        NotFoundError: there is no checkpoint at ``path``.
        CheckpointError: the named checkpoint, or every checkpoint of the
            train dir, is damaged (the message says what is wrong).
    """
    path = Path(path)
    if os.path.lexists(path / MANIFEST_NAME) or not _holds_checkpoints(path):
        ckpt = read_checkpoint_dir(path, device, verify)
        _check_name(path, ckpt.step)
        return ckpt
    found, bad = _first_good(path, lambda p: _read_member(p, device, verify))
    if found is None:
        if bad:
            raise _all_damaged(path, bad)
        raise NotFoundError(
            f"No checkpoint found at {str(path)!r}: none of its checkpoints is complete; "
            "train again or restore a backup."
        )
    return found


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
        check_directory(self.directory, "the checkpoint directory")
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
        """Checkpoint entries, oldest first, not verified.

        A damaged one, or a symbolic link by a checkpoint's name, is refused
        only when it is read.
        """
        return [p for _, p in _list(self.directory)]

    def latest(self) -> Path | None:
        """The newest checkpoint that verifies (see :func:`latest_checkpoint`)."""
        return latest_checkpoint(self.directory)

    def restore(self, device: str | torch.device | None = "cpu") -> Checkpoint | None:
        """Read the newest checkpoint that verifies onto ``device``; None if there is none.

        A damaged checkpoint is skipped with a warning saying what is wrong
        with it, and the previous complete one is read instead. When every
        checkpoint is damaged nothing is read and nothing is assumed: starting
        from step 0 would later prune the damaged checkpoints away, so that is
        an error the operator resolves.

        Args:
            device: A ``torch.device`` or a torch name (``"cpu"``, ``"cuda:0"``).

        Raises:
            CheckpointError: every checkpoint in the directory is damaged.
        """
        found, bad = _first_good(self.directory, lambda p: _read_member(p, device, True))
        if found is None and bad:
            raise _all_damaged(self.directory, bad)
        return found

    def restore_or_raise(self, device: str | torch.device | None = "cpu") -> Checkpoint:
        """Like :meth:`restore`, but no checkpoint is an error.

        Raises:
            NotFoundError: the directory holds no checkpoint.
            CheckpointError: every checkpoint in it is damaged.
        """
        ckpt, bad = _first_good(self.directory, lambda p: _read_member(p, device, True))
        if ckpt is None and bad:
            raise _all_damaged(self.directory, bad)
        if ckpt is None:
            raise NotFoundError(
                f"No checkpoint in {str(self.directory)!r}; train first, or point to the train dir "
                "that holds the checkpoints."
            )
        return ckpt
