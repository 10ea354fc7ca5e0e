"""The ``ParameterServer`` strategy's checkpoint state: dense variables and push tables.

The ps shards hold each variable as segments of flat buffers (a partitioned
variable spans several shards); a checkpoint holds whole tensors.
:func:`assemble` builds a variable from the shards' snapshots and
:func:`split_flat` cuts whole tensors into the shards' flat arrays, so a
checkpoint restores onto any placement of the same variables. The shards'
push tables travel as int64 rows (:func:`push_table_tensor` / :func:`push_table_rows`)
in the :data:`PUSH_TABLE_GROUP` group, so a restored ps applies no push twice.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from towerflow.errors import InvalidArgumentError

__all__ = ["PUSH_TABLE_GROUP", "assemble", "push_table_rows", "push_table_tensor", "split_flat"]

#: checkpoint group of the ps shards' push tables (``shard_<i>``: int64 rows
#: ``worker, incarnation, seq, status code``), so a restored ps applies no push twice
PUSH_TABLE_GROUP = "ps_pushes"
_STATUS_CODES = ("applied", "stale", "voided")


def push_table_tensor(rows: Any) -> torch.Tensor:
    """A shard's push-table rows as an int64 ``[n, 4]`` tensor."""
    data = [(w, i, q, _STATUS_CODES.index(st) if st in _STATUS_CODES else 0)
            for w, i, q, st in rows]
    return torch.tensor(data, dtype=torch.int64).reshape(-1, 4)


def push_table_rows(tensor: torch.Tensor | None) -> list[tuple[int, int, int, str]]:
    """The rows of a :func:`push_table_tensor` (none when the checkpoint has no table)."""
    if tensor is None:
        return []
    if tensor.dtype != torch.int64 or tensor.dim() != 2 or tensor.shape[1] != 4:
        raise InvalidArgumentError(
            f"The checkpoint's push table is {tensor.dtype} of shape {list(tensor.shape)}, not "
            "int64 rows of 4; restore a checkpoint written by towerflow."
        )
    return [(int(w), int(i), int(q), _STATUS_CODES[int(c)] if 0 <= c < 3 else "applied")
            for w, i, q, c in tensor.tolist()]


def assemble(placement: Any, snaps: list[Any], name: str, buffer: str) -> torch.Tensor:
    parts = placement.segments_of(name)
    var_shape = parts[0][1].var_shape
    out = np.empty(int(np.prod(var_shape, dtype=np.int64)), np.float32)
    for task, seg in parts:
        source = snaps[task].params if buffer == "params" else snaps[task].slots[buffer]
        out[seg.start:seg.start + seg.numel] = source[seg.offset:seg.offset + seg.numel]
    return torch.from_numpy(out).reshape(var_shape)


def split_flat(placement: Any, tensor_of: Any) -> list[np.ndarray]:
    """Per-shard flat arrays from whole tensors (``tensor_of(name)``)."""
    shards = [np.empty(s.numel, np.float32) for s in placement.shards]
    for shard in placement.shards:
        for seg in shard.segments:
            flat = tensor_of(seg.name).detach().to("cpu", torch.float32).reshape(-1).numpy()
            shards[shard.index][seg.offset:seg.offset + seg.numel] = flat[seg.start:seg.start + seg.numel]
    return shards
