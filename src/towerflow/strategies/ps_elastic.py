"""An elastic worker of :class:`~towerflow.strategies.parameter_server.ParameterServer`.

An elastic worker (``join=True``; ``towerflow train --join``) is a process
with the cluster and its credentials but no task of its own in it. It finds
the cluster it joins (:func:`joining_cluster`: ``cluster=`` or ``TF_CONFIG``
with no ``task``) and joins the running ``async`` job through its client
(:func:`join_running_job`: ps task 0 gives its worker id), leaving with
``Done`` on SIGTERM too.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
from pathlib import Path
from typing import Any

from towerflow.cluster import ClusterSpec
from towerflow.errors import InvalidArgumentError
from towerflow.ps.worker.dense.variables import join_job

__all__ = ["joining_cluster", "join_running_job"]

log = logging.getLogger("towerflow.ps")


def join_running_job(client: Any) -> Any:
    """Join the job as an elastic worker through ``client`` (a ``PSClient``).

    In the main thread, with SIGTERM's default action, SIGTERM then ends the
    process with ``SystemExit`` so that the strategy's shutdown says ``Done``.

    Returns:
        The SIGTERM handler replaced, to put back at shutdown; None: none was.
    """
    worker_id, step = join_job(client, f"{socket.gethostname()}:{os.getpid()}")
    log.info("joined the job as elastic worker %d at global step %d", worker_id, step)
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        def leave(signum: int, frame: Any) -> None:
            raise SystemExit(128 + signum)  # shutdown() then says Done

        return signal.signal(signal.SIGTERM, leave)
    return None


def joining_cluster(cluster: Any, task: Any, mode: str, is_chief: bool | None) -> ClusterSpec:
    """The cluster an elastic worker joins: ``cluster`` (a spec, its dict or a JSON file),
    else ``TF_CONFIG``'s, which must name no task (an elastic worker has none)."""
    if mode != "async" or task is not None or is_chief:
        given = (f"mode={mode!r}" if mode != "async" else
                 f"task={task}" if task is not None else "is_chief=True")
        raise InvalidArgumentError(
            f"join=True with {given}: an elastic worker joins a running asynchronous job "
            "(mode='async') as a process with no task of its own, and is never the chief; "
            "add the worker to the cluster as a task for the rest.")
    if cluster is not None:
        return (ClusterSpec.from_json_file(cluster) if isinstance(cluster, str | Path)
                else ClusterSpec(cluster))
    text = os.environ.get("TF_CONFIG", "").strip()
    try:
        config = json.loads(text) if text else {}
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(f"TF_CONFIG is not valid JSON ({exc}); fix its value.") from None
    if not isinstance(config, dict) or not config.get("cluster"):
        raise InvalidArgumentError(
            "join=True needs the cluster to join: pass cluster=, or set TF_CONFIG to "
            '{"cluster": {"ps": [...], "worker": [...]}} (with no "task").')
    if config.get("task"):
        raise InvalidArgumentError(
            f"join=True is for a process with no task of its own, but TF_CONFIG names task "
            f"{config['task']}; remove its \"task\", or run that task without join.")
    return ClusterSpec(config["cluster"])
