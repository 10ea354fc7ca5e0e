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

from towerflow._lazy import lazy_dir, lazy_getattr

# public name -> module that defines it, imported on first use (PEP 562): a module of the
# package that needs no torch (files, atomic) is imported without torch
_LAZY: dict[str, str] = {
    "Checkpoint": "towerflow.checkpoint.format",
    "CheckpointManager": "towerflow.checkpoint.manager",
    "ChunkedGroup": "towerflow.checkpoint.chunked",
    "ChunkedReader": "towerflow.checkpoint.chunked",
    "flatten_state": "towerflow.checkpoint.state",
    "latest_checkpoint": "towerflow.checkpoint.manager",
    "load": "towerflow.checkpoint.api",
    "load_into_module": "towerflow.checkpoint.state",
    "read_checkpoint": "towerflow.checkpoint.manager",
    "save": "towerflow.checkpoint.api",
    "unflatten_state": "towerflow.checkpoint.state",
    "verify_checkpoint": "towerflow.checkpoint.format",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY, globals())

__dir__ = lazy_dir(globals(), __all__)
