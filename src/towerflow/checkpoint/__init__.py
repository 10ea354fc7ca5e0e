"""Checkpoints: safetensors + a JSON manifest, written atomically, read on any device.

The one on-disk format of towerflow (see :mod:`towerflow.checkpoint.format`),
a manager of numbered checkpoints with ``max_to_keep`` and a ``latest``
pointer that falls back past corrupt ones (:mod:`~towerflow.checkpoint.manager`),
groups too large for memory written and read part by part
(:mod:`~towerflow.checkpoint.chunked`), nested optimizer state as flat
tensors plus JSON (:mod:`~towerflow.checkpoint.state`) and the public ``towerflow.save`` / ``towerflow.load`` (:mod:`~towerflow.checkpoint.api`).
No pickle anywhere; loading never executes code and never reads outside a
checkpoint's directory. The package imports no other towerflow package but
:mod:`towerflow.errors`: tensors go to a ``torch.device`` the caller gives.
"""

from __future__ import annotations

from towerflow.checkpoint.api import load, save
from towerflow.checkpoint.chunked import ChunkedGroup, ChunkedReader
from towerflow.checkpoint.format import Checkpoint, verify_checkpoint
from towerflow.checkpoint.manager import CheckpointManager, latest_checkpoint, read_checkpoint
from towerflow.checkpoint.state import flatten_state, load_into_module, unflatten_state

__all__ = [
    "Checkpoint",
    "CheckpointManager",
    "ChunkedGroup",
    "ChunkedReader",
    "flatten_state",
    "latest_checkpoint",
    "load",
    "load_into_module",
    "read_checkpoint",
    "save",
    "unflatten_state",
    "verify_checkpoint",
]
