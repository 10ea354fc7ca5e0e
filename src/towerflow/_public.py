"""Public faces that join two foundations the leaf packages may not import.

``towerflow.load`` is the checkpoint reader with the device model's names:
the ``checkpoint`` package is a leaf and takes only devices torch itself
names, while a user of the articles writes ``"/gpu:0"`` or ``"/cpu:0"``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from towerflow.checkpoint import api as _checkpoint_api
from towerflow.devices import resolve_device

__all__ = ["load"]


def load(path: str | Path, device: str | torch.device | Any | None = "cpu", *,
         into: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """Load a saved model's tensors onto ``device``, checking every checksum.

    As :func:`towerflow.checkpoint.load`, but ``device`` is any name the device
    model takes (``"/gpu:0"``, ``"/device:CPU:0"``, ``"cuda:1"``, a
    ``DeviceSpec``); it must exist in this process.

    Raises:
        PlacementError: ``device`` names a device this process does not have.
        CheckpointError: the checkpoint is damaged.

    Example:
        >>> import tempfile, towerflow
        >>> d = tempfile.mkdtemp()
        >>> _ = towerflow.save({"w": torch.ones(2)}, d + "/m")
        >>> towerflow.load(d + "/m", device="/cpu:0")["w"].device
        device(type='cpu')
    """
    target = None if device is None else resolve_device(device)
    return _checkpoint_api.load(path, target, into=into)
