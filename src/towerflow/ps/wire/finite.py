"""NaN / inf scans of the flat float32 buffers a push carries, as both halves run them.

- :func:`all_finite`: the one-pass scan a worker runs before it marks a push
  finite (``PushRequest.finite``);
- :func:`first_nonfinite`: where the first NaN / inf of a received chunk is;
- :func:`scan_gradient`: that scan and the sum of the squares in one pass (a
  shard's check of each gradient chunk, and its bound on every value).

Each reads the values once and writes nothing.

Example:
    >>> import numpy as np
    >>> all_finite(np.ones(3, np.float32)), first_nonfinite(np.array([1, np.nan], np.float32))
    (True, 1)
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["CHECK_BLOCK", "all_finite", "first_nonfinite", "scan_gradient"]

#: elements scanned per block by :func:`first_nonfinite`
CHECK_BLOCK = 1 << 16


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
