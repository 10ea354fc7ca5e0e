"""A ``ParameterServer`` worker among its peers: its own task's server, and the chief of an
async job waiting for its workers to finish."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["wait_for_workers", "task_server"]

log = logging.getLogger("towerflow.ps")


def wait_for_workers(status: Callable[[], Any], rank: int, world: int, timeout: float) -> bool:
    """Wait (at most ``timeout`` s) until every worker but ``rank`` of the ``world`` said
    ``Done`` or the ps's heartbeats find it dead, by ps task 0's ``status()``; True when
    it waited for one."""
    deadline, said = time.monotonic() + timeout, False
    while True:
        left = world - 1 - sum(  # one the ps's heartbeats find dead says no Done
            w.done or w.heartbeat == "dead" for w in status().workers if w.worker_id != rank)
        if left <= 0:
            return said
        if time.monotonic() >= deadline:
            log.warning("%d worker(s) did not finish within %g s; the final checkpoint "
                        "holds the pushes applied so far", left, timeout)
            return True
        if not said:
            log.info("waiting up to %g s for %d other worker(s) to finish before the "
                     "final checkpoint", timeout, left)
            said = True
        threading.Event().wait(0.1)


def task_server(cluster: Any, task: Any, credentials: Any, bind_host: str | None) -> Any:
    """This worker's ``Server`` (so the ps tasks' heartbeats reach it), or None with a
    warning when it cannot listen (the port taken, a non-loopback address without the
    cluster secret) and no ``bind_host`` was asked for (then it raises)."""
    from towerflow.cluster import Server, ServerOptions
    from towerflow.errors import InvalidArgumentError, UnavailableError

    try:
        return Server(cluster, task.job_name, task.task_index, credentials=credentials,
                      options=ServerOptions(bind_host=bind_host))
    except (InvalidArgumentError, UnavailableError) as exc:
        if bind_host is not None:
            raise
        log.warning("%s trains without a server, so the ps tasks' heartbeats will miss it: "
                    "%s", task.device_name, exc)
        return None
