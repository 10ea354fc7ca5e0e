"""Each process's share of the host's cores: ``OMP_NUM_THREADS`` and torch's intra-op threads.

PyTorch starts as many intra-op threads as the machine has cores, in every
process; a host that runs ps tasks and workers side by side then runs many
times more busy threads than cores. Every start path of towerflow (``towerflow
launch``, ``towerflow train --ps/--replicas``, a task started by hand or by a
scheduler with ``towerflow train`` / ``towerflow server``) sizes its processes
with one rule, :func:`thread_share`: ``max(1, cores // processes on this
host)`` threads each, unless ``OMP_NUM_THREADS`` is set (then that number is
kept and passed on to the children).

Example:
    >>> thread_share(8, 4, {})
    (2, 'share')
    >>> thread_share(2, 4, {})
    (1, 'share')
    >>> thread_share(8, 4, {"OMP_NUM_THREADS": "3"})
    (3, 'OMP_NUM_THREADS')
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping, MutableMapping

from towerflow.cluster.spec import ClusterSpec, TaskInfo, is_loopback_host, parse_address
from towerflow.errors import InvalidArgumentError

__all__ = ["OMP_ENV", "available_cores", "thread_share", "share_line", "processes_on_host",
           "apply_thread_share"]

logger = logging.getLogger("towerflow.cluster")

#: the variable that sets OpenMP's (and so PyTorch's intra-op) thread count
OMP_ENV = "OMP_NUM_THREADS"


def available_cores() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def thread_share(cores: int, processes: int, env: Mapping[str, str]) -> tuple[int, str]:
    """The threads each of ``processes`` processes on ``cores`` cores runs, and why.

    Args:
        cores: the CPUs the processes share.
        processes: how many towerflow processes run on them.
        env: the environment; a set ``OMP_NUM_THREADS`` wins.

    Returns:
        ``(threads, source)``: source ``"OMP_NUM_THREADS"`` when the environment
        chose, ``"share"`` when it is ``max(1, cores // processes)``.

    Raises:
        InvalidArgumentError: ``OMP_NUM_THREADS`` is not a positive integer, or
            ``cores`` / ``processes`` is below 1.
    """
    given = env.get(OMP_ENV, "").strip()
    if given:
        if not given.isdigit() or int(given) < 1:
            raise InvalidArgumentError(
                f"{OMP_ENV}={env[OMP_ENV]!r} is not a positive integer; set it to the threads "
                f"each process should run (e.g. {OMP_ENV}=1), or unset it to give each "
                "process its share of the cores."
            )
        return int(given), OMP_ENV
    if cores < 1 or processes < 1:
        raise InvalidArgumentError(
            f"cannot share {cores} core(s) among {processes} process(es); both must be at least 1."
        )
    return max(1, cores // processes), "share"


def share_line(who: str, processes: int, cores: int, threads: int, source: str) -> str:
    """The line that says what :func:`thread_share` chose.

    Example:
        >>> share_line("towerflow launch", 4, 2, 1, "share")
        'towerflow launch: 4 processes on 2 cores: 1 thread each (OMP_NUM_THREADS=1); set OMP_NUM_THREADS to choose'
    """
    plural = "s" if threads != 1 else ""
    where = f"{processes} process{'es' if processes != 1 else ''} on {cores} core{'s' * (cores != 1)}"
    if source == OMP_ENV:
        return f"{who}: {where}: {threads} thread{plural} each ({OMP_ENV}={threads} as set)"
    return (f"{who}: {where}: {threads} thread{plural} each ({OMP_ENV}={threads}); "
            f"set {OMP_ENV} to choose")


def _local_names(own_host: str | None) -> set[str]:
    names = {socket.gethostname().lower()}
    names.add(next(iter(names)).split(".")[0])
    if own_host:
        names.add(own_host.lower())
    return names


def processes_on_host(cluster: ClusterSpec | None, task: TaskInfo | None = None) -> int:
    """How many tasks of ``cluster`` run on this host (1 when unknown).

    A task runs here when its address's host is a loopback name, this
    machine's host name, or the host of ``task``'s own address.

    Example:
        >>> spec = ClusterSpec({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "10.9.9.9:3"]})
        >>> processes_on_host(spec), processes_on_host(None)
        (2, 1)
    """
    if cluster is None:
        return 1
    own = None
    if task is not None and task.job_name in cluster:
        own = parse_address(cluster.task_address(task.job_name, task.task_index))[0]
    names = _local_names(own)
    hosts = [parse_address(address)[0] for _, address in cluster.tasks()]
    here = sum(1 for host in hosts if is_loopback_host(host) or host.lower() in names)
    return max(1, here)


def apply_thread_share(who: str, cluster: ClusterSpec | None, task: TaskInfo | None = None,
                       env: MutableMapping[str, str] | None = None) -> int:
    """Size this task's process: ``OMP_NUM_THREADS`` (kept when set) and ``torch.set_num_threads``.

    The share is this host's cores over the tasks of ``cluster`` on this host
    (:func:`processes_on_host`). The choice is logged at INFO when this process
    made it, at DEBUG when the environment did (a launcher's children, or the
    user's own setting).

    Args:
        who: the command, for the log line (``towerflow train``).
        cluster: the cluster this task belongs to (None: this process alone).
        task: this process's task, whose host counts as this host.
        env: the environment to read and complete (default ``os.environ``).

    Returns:
        The number of intra-op threads this process now runs.
    """
    env = os.environ if env is None else env
    processes = processes_on_host(cluster, task)
    cores = available_cores()
    threads, source = thread_share(cores, processes, env)
    env[OMP_ENV] = str(threads)
    import torch

    torch.set_num_threads(threads)
    level = logging.DEBUG if source == OMP_ENV else logging.INFO
    logger.log(level, "%s", share_line(who, processes, cores, threads, source))
    return threads
