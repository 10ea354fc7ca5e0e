"""This process's task in a cluster: the job, replica and task its devices belong to.

A process that serves a cluster task (``towerflow.Server(cluster, "worker", 1)``)
registers that task here when its server starts, and the device model names
its devices with it (``/job:worker/replica:0/task:1/device:CPU:0``). A process
that is in no cluster is ``/job:localhost/replica:0/task:0``, as in
TensorFlow.

This module imports nothing from towerflow, so both the cluster runtime and
the device model (which never import each other) can use it.

Example:
    >>> prefix()
    '/job:localhost/replica:0/task:0'
    >>> token = register("worker", 1)
    >>> prefix()
    '/job:worker/replica:0/task:1'
    >>> unregister(token)
"""

from __future__ import annotations

import threading

__all__ = ["LOCAL", "register", "unregister", "current", "prefix", "in_cluster", "generation"]

#: ``(job, replica, task)`` of a process that is in no cluster
LOCAL = ("localhost", 0, 0)

_lock = threading.Lock()
_registered: list[tuple[object, tuple[str, int, int]]] = []
_current = LOCAL
_prefix = "/job:localhost/replica:0/task:0"
_generation = 0


def _update() -> None:
    global _current, _prefix, _generation
    _current = _registered[0][1] if _registered else LOCAL
    job, replica, task = _current
    _prefix = f"/job:{job}/replica:{replica}/task:{task}"
    _generation += 1


def register(job: str, task: int, replica: int = 0) -> object:
    """Record that this process serves ``/job:<job>/replica:<replica>/task:<task>``.

    The first registration still in force is the process's task (a test that
    serves several tasks in one process keeps the first). Returns a token for
    :func:`unregister`.
    """
    token = object()
    with _lock:
        _registered.append((token, (str(job), int(replica), int(task))))
        _update()
    return token


def unregister(token: object) -> None:
    """Withdraw a registration made by :func:`register` (no-op when unknown)."""
    with _lock:
        kept = [entry for entry in _registered if entry[0] is not token]
        if len(kept) != len(_registered):
            _registered[:] = kept
            _update()


def current() -> tuple[str, int, int]:
    """``(job, replica, task)`` of this process (``LOCAL`` when in no cluster)."""
    return _current


def prefix() -> str:
    """``/job:<job>/replica:<replica>/task:<task>`` of this process."""
    return _prefix


def in_cluster() -> bool:
    """Whether a cluster task is registered for this process."""
    return bool(_registered)


def generation() -> int:
    """A counter that changes whenever the process's task changes (for caches)."""
    return _generation
