"""glibc malloc tuning and free-memory checks for the processes of the ps wing.

Both halves use them: the worker's dense client (:func:`tune_malloc`), the ps
task's dense service (all three), its table rows (:func:`check_free_memory`)
and the worker's table checkpoints (:func:`release_free_memory`).

- :func:`tune_malloc`, :func:`release_free_memory`: glibc malloc tuning for the
  chunk-sized ``bytes`` gRPC Python sends and receives;
- :func:`check_free_memory`: refuse an allocation the machine has no room for,
  before it is made.

Example:
    >>> release_free_memory()  # a no-op until tune_malloc() tuned malloc
"""

from __future__ import annotations

import ctypes
import platform

from towerflow.errors import ResourceExhaustedError

__all__ = ["tune_malloc", "release_free_memory", "check_free_memory"]

#: allocations below this come from malloc's reused heap (see :func:`tune_malloc`)
_MMAP_THRESHOLD = 32 << 20
#: free heap kept for reuse before malloc returns it to the system
_TRIM_THRESHOLD = 16 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_tuned: bool | None = None


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
