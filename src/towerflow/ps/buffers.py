"""Flat float32 buffers as both sides of the ps wire handle them (neither side's module).

- :func:`all_finite` / :func:`first_nonfinite`: the one-pass NaN / inf scan a
  worker runs before it marks a push finite, and a shard runs on every chunk;
- :func:`receive_into`: a payload of announced size checked chunk by chunk;
- :func:`tune_malloc`, :func:`release_free_memory`:
  glibc malloc tuning for the chunk-sized ``bytes`` gRPC Python sends and
  receives, used by the worker's client and by the ps task.

Example:
    >>> import numpy as np
    >>> all_finite(np.ones(3, np.float32)), first_nonfinite(np.array([1, np.nan], np.float32))
    (True, 1)
"""

from __future__ import annotations

import ctypes
import math
import platform
import sys
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from towerflow.errors import DataLossError, ResourceExhaustedError

__all__ = ["all_finite", "first_nonfinite", "scan_gradient", "receive_into", "PayloadCutOff", "tune_malloc",
           "release_free_memory", "check_free_memory", "CHECK_BLOCK", "ITEM"]

#: bytes of one element: every buffer on the ps wire is float32
ITEM = 4
#: elements scanned per block by :func:`first_nonfinite`
CHECK_BLOCK = 1 << 16

#: allocations below this come from malloc's reused heap (see :func:`tune_malloc`)
_MMAP_THRESHOLD = 32 << 20
#: free heap kept for reuse before malloc returns it to the system
_TRIM_THRESHOLD = 16 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_tuned: bool | None = None


class PayloadCutOff(DataLossError):
    """A push's payload ended before the size its header announced (the sender went away)."""


def raw_bytes(tensor: Any) -> memoryview:
    """A view of a torch tensor's raw little-endian bytes, row-major (copied only when it is
    not contiguous or not on the CPU): a buffer a framed message joins without a copy of
    its own first."""
    if not tensor.numel():
        return memoryview(b"")
    if sys.byteorder != "little":  # pragma: no cover
        tensor = tensor.byteswap()
    return memoryview(tensor.detach().contiguous().cpu().numpy()).cast("B")


def tensor_bytes(tensor: Any) -> bytes:
    """A torch tensor's raw little-endian bytes, row-major (a message field's)."""
    return bytes(raw_bytes(tensor))


def receive_into(target: np.ndarray | None, chunks: Iterable[bytes | memoryview], numel: int,
                 *, who: str,
                 on_chunk: Callable[[int, np.ndarray], None] | None = None) -> int:
    """Copy a payload of ``numel`` float32 elements from ``chunks`` into ``target``.

    ``on_chunk(offset, values)`` (when given) handles each chunk instead of the
    copy (``values`` is a read-only view of the chunk; ``target`` may then be
    None). Returns the number of bytes received.

    Raises:
        DataLossError: a chunk not a whole number of elements, or a payload
            shorter or longer than announced.
    """
    expected = numel * ITEM
    received = 0
    for chunk in chunks:
        size = len(chunk)
        if size % ITEM or received + size > expected:
            raise DataLossError(
                f"Payload from {who} does not match its header: a {size}-byte chunk at byte "
                f"{received} of {expected}; the push was refused."
            )
        values = np.frombuffer(chunk, dtype=np.float32)
        first = received // ITEM
        if on_chunk is None:
            target[first:first + values.size] = values  # type: ignore[index]
        else:
            on_chunk(first, values)
        received += size
    if received != expected:
        raise PayloadCutOff(
            f"Payload from {who} ended after {received} of {expected} bytes; the push was "
            "refused."
        )
    return received


def all_finite(values: np.ndarray) -> bool:
    """True when no element of the float32 array ``values`` is NaN or inf (one read pass)."""
    return first_nonfinite(values.reshape(-1)) is None


def first_nonfinite(values: np.ndarray, zeros: np.ndarray | None = None) -> int | None:
    """Index of the first NaN / inf of the flat ``values``, else None.

    Scans in blocks of ``zeros.size`` (zeros kept by the caller to scan many
    buffers; default :data:`CHECK_BLOCK` of them) with a dot product against
    ``zeros`` (``x * 0`` is 0 for every finite ``x`` and NaN otherwise): it
    reads the values once and writes nothing.
    """
    if zeros is None:
        zeros = np.zeros(min(values.size, CHECK_BLOCK) or 1, np.float32)
    with np.errstate(invalid="ignore"):
        for start in range(0, values.size, zeros.size):
            block = values[start:start + zeros.size]
            if not math.isfinite(float(np.dot(block, zeros[: block.size]))):
                return start + int(np.argmin(np.isfinite(block)))
    return None


def scan_gradient(values: np.ndarray, zeros: np.ndarray) -> tuple[int | None, float]:
    """``(index of the first NaN / inf of values or None, sum of their squares)`` in one pass.

    Each block's dot product with itself is finite when the block is, so it
    gives the squares' sum (``sqrt`` of it bounds every ``|value|``) at the
    cost of :func:`first_nonfinite`'s scan; a block whose squares overflow is
    scanned again to tell a NaN / inf from large finite values (the sum is
    then ``inf``: no bound).
    """
    total = 0.0
    for start in range(0, values.size, zeros.size):
        block = values[start:start + zeros.size]
        with np.errstate(invalid="ignore", over="ignore"):
            squares = float(np.dot(block, block))
        if not math.isfinite(squares):
            bad = first_nonfinite(block, zeros)
            if bad is not None:
                return start + bad, math.inf
            squares = math.inf
        total += squares
    return None, total


def tune_malloc(*, one_arena: bool = False) -> bool:
    """Make glibc's malloc reuse chunk-sized blocks instead of mapping fresh pages.

    Every streamed chunk is a new ``bytes`` object (gRPC Python sends and
    receives ``bytes``). glibc serves blocks above its mmap threshold with
    fresh zeroed pages and unmaps them on free, so each chunk costs page
    faults that take longer than copying it; the dynamic threshold only partly
    avoids that. Fixing the mmap threshold at 32 MiB and the trim threshold at
    16 MiB keeps chunk-sized blocks on the heap for reuse (at most 16 MiB of
    free heap at its top is kept); the large flat buffers are still mapped. With
    ``one_arena`` (a ps task) every thread allocates from one arena, so the
    free heap kept is bounded once, not once per gRPC handler thread.
    Process-wide and idempotent; does nothing (returns False) where malloc is
    not glibc's.
    """
    global _tuned
    if _tuned is None:
        _tuned = False
        if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
            try:
                mallopt = ctypes.CDLL(None).mallopt
            except (OSError, AttributeError):
                return False
            _tuned = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and \
                bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    if _tuned and one_arena:
        ctypes.CDLL(None).mallopt(_M_ARENA_MAX, 1)
    return _tuned


def release_free_memory() -> None:
    """Return malloc's free heap to the system (``malloc_trim``; after :func:`tune_malloc`)."""
    if _tuned:
        ctypes.CDLL(None).malloc_trim(0)


def check_free_memory(nbytes: int, what: str) -> None:
    """Raise before ``what`` allocates ``nbytes`` when the machine has not that much available.

    Raises:
        ResourceExhaustedError: naming both sizes and the way out.
    """
    import psutil

    available = psutil.virtual_memory().available
    if nbytes > available:
        raise ResourceExhaustedError(
            f"{what} needs {nbytes / 2**20:.0f} MiB but only {available / 2**20:.0f} MiB are "
            "available; add ps tasks or use a larger machine."
        )
