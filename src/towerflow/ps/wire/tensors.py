"""Tensors as raw buffers on the ps wire: one encode, one decode, for both halves.

A table's ids (int64), rows and row gradients (the table's dtype) travel as raw
little-endian bytes, row-major, in a message's ``bytes`` fields or as the parts
of a framed batch (:func:`~towerflow.ps.wire.framing.pack_parts`); the
message next to them says the dtype and how many values (the shape). The
worker (:mod:`towerflow.ps.worker.tables`) and the ps task
(:mod:`towerflow.ps.server.tables`) both write them with :func:`encode` (or
:func:`raw_bytes`, a view to join into a frame) and read them with :func:`decode`: a read-only view of the
received bytes, no copy, after checking that their length is the one the
dtype and shape need.

Example:
    >>> import torch
    >>> decode(encode(torch.arange(6)), torch.int64, (2, 3)).tolist()
    [[0, 1, 2], [3, 4, 5]]
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch

from towerflow.errors import InvalidArgumentError

__all__ = ["encode", "raw_bytes", "decode"]


def raw_bytes(tensor: Any) -> memoryview:
    """A view of a torch tensor's raw little-endian bytes, row-major (copied only when it is
    not contiguous or not on the CPU): a buffer a framed message joins without a copy of
    its own first."""
    if not tensor.numel():
        return memoryview(b"")
    if sys.byteorder != "little":  # pragma: no cover
        tensor = tensor.byteswap()
    return memoryview(tensor.detach().contiguous().cpu().numpy()).cast("B")


def encode(tensor: Any) -> bytes:
    """A torch tensor's raw little-endian bytes, row-major (a message field's): the bytes
    of :func:`raw_bytes`."""
    return bytes(raw_bytes(tensor))


def decode(data: bytes | memoryview, dtype: torch.dtype, shape: int | tuple[int, ...],
           what: str | None = None) -> torch.Tensor:
    """The values of ``dtype`` in raw little-endian ``data``, of ``shape``, without a copy.

    ``shape`` is a tuple (the tensor's shape) or a count (a flat tensor of that
    many values). The tensor is a read-only view of ``data`` (it keeps ``data``
    alive): a reader copies what it keeps and never writes into a received
    buffer.

    Args:
        what: names the buffer in the error (a ps task's: the table and field
            a worker sent); None: a ps's answer, as a worker reads it.

    Raises:
        InvalidArgumentError: a negative size, or ``data`` holds another
            number of bytes than the shape needs.
    """
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    count = 1
    for n in dims:
        count *= n
    size = dtype.itemsize
    if any(n < 0 for n in dims) or len(data) != count * size:
        need = 0 if any(n < 0 for n in dims) else count * size
        if what is None:
            problem = f"A ps answered {len(data)} bytes where {shape} {dtype} values need {need}"
        else:
            problem = f"{what} holds {len(data)} bytes but {shape} values of {dtype} need {need}"
        raise InvalidArgumentError(
            f"{problem}; client and ps must run the same towerflow version."
        )
    if not data:
        return torch.empty(dims, dtype=dtype)
    out = torch.frombuffer(data, dtype=dtype).view(dims)
    return out if sys.byteorder == "little" else out.byteswap()  # pragma: no cover


def _quiet_readonly_warning() -> None:
    """Spend torch's one-time warning about tensors over read-only buffers.

    ``torch.frombuffer`` of ``bytes`` warns once per process that the tensor
    could write into an immutable buffer; :func:`decode`'s tensors are only
    read, so the warning is raised here, once, and dropped.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.frombuffer(bytes(8), dtype=torch.int64)


_quiet_readonly_warning()
