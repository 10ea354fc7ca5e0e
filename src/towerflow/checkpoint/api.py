"""``towerflow.save`` / ``towerflow.load``: a model's tensors, on any device.

A saved model is a directory holding ``model.safetensors`` and
``manifest.json`` (the checkpoint format, with one group). It is written
atomically and read back onto whatever device is asked for, so a model saved
on a GPU loads on a CPU-only machine, and the reverse, with no code change.
Nothing is pickled and loading runs no code.

Example:
    >>> import tempfile, torch
    >>> from torch import nn
    >>> path = save(nn.Linear(2, 1), tempfile.mkdtemp() + "/linear")
    >>> sorted(load(path, device="cpu"))
    ['bias', 'weight']
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from towerflow.checkpoint.format import MANIFEST_NAME, write_checkpoint_dir
from towerflow.checkpoint.manager import read_checkpoint
from towerflow.checkpoint.state import load_into_module
from towerflow.errors import InvalidArgumentError, NotFoundError

__all__ = ["MODEL_GROUP", "load", "save"]

MODEL_GROUP = "model"


def save(
    obj: nn.Module | Mapping[str, torch.Tensor],
    path: str | Path,
    *,
    metadata: Mapping[str, Any] | None = None,
    step: int = 0,
) -> Path:
    """Save a module's state dict (or a name -> tensor mapping) to the directory ``path``.

    Args:
        obj: A module, or a mapping of tensor names to tensors.
        path: The directory to write; an existing saved model there is
            replaced atomically.
        metadata: JSON-able values stored in the manifest.
        step: Recorded in the manifest.

    Returns:
        ``path`` as a Path.

    Raises:
        InvalidArgumentError: ``obj`` holds a non-tensor, or ``path`` is a
            file or a non-empty directory that is not a saved model.
    """
    if isinstance(obj, nn.Module):
        tensors: Mapping[str, torch.Tensor] = obj.state_dict()
    elif isinstance(obj, Mapping):
        tensors = obj
    else:
        raise InvalidArgumentError(
            f"towerflow.save expects an nn.Module or a mapping of tensors, got {type(obj).__name__}."
        )
    path = Path(path)
    if path.exists() and not (path / MANIFEST_NAME).exists():
        if not path.is_dir() or any(path.iterdir()):
            raise InvalidArgumentError(
                f"Refusing to overwrite {str(path)!r}: it exists and is not a saved towerflow model; "
                "choose a new path."
            )
    return write_checkpoint_dir(path, step, {MODEL_GROUP: tensors}, metadata)


def load(
    path: str | Path,
    device: str | torch.device | None = "cpu",
    *,
    into: nn.Module | None = None,
) -> dict[str, torch.Tensor]:
    """Load a saved model's tensors onto ``device``, checking every checksum.

    Args:
        path: A directory written by :func:`save`, a checkpoint directory, or
            a train dir (its newest checkpoint that verifies is read).
        device: Where the tensors go: a ``torch.device`` or a torch name
            (``"cpu"``, ``"cuda:0"``); None is the CPU. A TensorFlow-style
            name goes through ``towerflow.resolve_device("/gpu:0")`` first.
        into: A module to load the tensors into (its tensors keep their own
            device); it must match the saved names, shapes and dtypes.

    Returns:
        Tensor name -> tensor on ``device``.

    Raises:
        NotFoundError: nothing saved at ``path``, or no model in it.
        CheckpointError: the checkpoint is damaged (the message names the
            file and what is wrong with it).
        InvalidArgumentError: ``into`` does not match (every difference listed).
    """
    ckpt = read_checkpoint(path, device=device)
    tensors = ckpt.groups.get(MODEL_GROUP)
    if tensors is None:
        raise NotFoundError(
            f"Checkpoint {str(ckpt.path)!r} has no {MODEL_GROUP!r} group (it has "
            f"{sorted(ckpt.groups)}); use read_checkpoint to read other groups."
        )
    if into is not None:
        load_into_module(into, tensors)
    return tensors
