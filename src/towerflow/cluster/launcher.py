"""``towerflow launch``: a whole cluster on one machine, one child process per task.

Each child runs the same command; it learns its task from ``TF_CONFIG`` (as
under a Kubeflow TFJob) and the cluster secret from ``TOWERFLOW_SECRET_FILE``,
a fresh random secret in a mode-0600 file deleted when the launch ends. Every
output line is prefixed with the task's name (``[worker:1] step 10 ...``).

The launch ends when the workers (and the chief) have exited — the ps and
evaluator tasks are then stopped — or on SIGINT / SIGTERM, which stops every
child. Stopping is SIGTERM to the child's process group, then SIGKILL after a
grace period, so no grandchild survives. The exit status is the workers' worst
(or ``128 + signal`` when the launch was interrupted).

Example:
    >>> launch_cluster(["python", "train.py"], num_ps=1, num_workers=2)  # doctest: +SKIP
    0
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import IO

from towerflow._children import spawn_group, stop_groups
from towerflow.cluster.spec import ClusterSpec, TaskInfo
from towerflow.cluster.transport import new_secret, write_secret_file
from towerflow.errors import InvalidArgumentError

__all__ = ["launch_cluster", "free_ports"]

logger = logging.getLogger("towerflow.cluster")

#: Roles whose exit ends the launch; the others (ps, evaluator) are then stopped.
_FINISHING_JOBS = ("chief", "worker")
_POLL_SECONDS = 0.1


@dataclass(slots=True)
class _Child:
    task: TaskInfo
    process: subprocess.Popen
    reader: threading.Thread | None = None

    @property
    def name(self) -> str:
        return f"{self.task.job_name}:{self.task.task_index}"


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports that are free on ``host`` right now."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _cluster_tasks(
    num_ps: int, num_workers: int, chief: bool, evaluator: bool, base_port: int | None, host: str
) -> tuple[ClusterSpec, list[TaskInfo]]:
    if num_ps < 0 or num_workers < 0 or (num_workers == 0 and not chief):
        raise InvalidArgumentError(
            f"cannot launch num_ps={num_ps}, num_workers={num_workers}, chief={chief}; give at "
            "least one worker (or a chief) and no negative counts."
        )
    sizes = {"chief": int(chief), "ps": num_ps, "worker": num_workers}
    total = sum(sizes.values())
    if base_port is not None and not 1 <= base_port <= 65536 - total:
        raise InvalidArgumentError(
            f"base_port={base_port} leaves no room for {total} ports; choose 1024..{65536 - total}."
        )
    ports = iter(range(base_port, base_port + total) if base_port else free_ports(total))
    jobs = {job: [f"{host}:{next(ports)}" for _ in range(n)] for job, n in sizes.items() if n}
    tasks = [TaskInfo(job, i) for job, n in sizes.items() for i in range(n)]
    if evaluator:
        tasks.append(TaskInfo("evaluator", 0))
    return ClusterSpec(jobs), tasks


def _pump(child: _Child, out: IO[str], lock: threading.Lock) -> None:
    stream = child.process.stdout
    if stream is None:
        return
    prefix = f"[{child.name}] "
    for raw in stream:
        line = raw.decode(errors="replace").rstrip("\n")
        with lock:
            out.write(prefix + line + "\n")
            out.flush()
    stream.close()


def _status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


class _Signals:
    """Turns SIGINT / SIGTERM into a flag while installed (main thread only)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.event = threading.Event()
        self._previous: dict[int, object] = {}

    def handle(self, signum: int, frame: object) -> None:
        self.received = signum
        self.event.set()

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self.handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


def launch_cluster(
    command: list[str],
    *,
    num_ps: int,
    num_workers: int,
    chief: bool = False,
    evaluator: bool = False,
    env: Mapping[str, str] | None = None,
    base_port: int | None = None,
    prefix_output: bool = True,
    grace: float = 10.0,
    host: str = "localhost",
    output: IO[str] | None = None,
) -> int:
    """Run ``command`` once per task of a local cluster and return the workers' worst status.

    Args:
        command: the program and its arguments, the same for every task.
        num_ps: number of ps tasks.
        num_workers: number of worker tasks.
        chief: add a ``chief`` task.
        evaluator: add an ``evaluator`` task (outside the cluster, as in TFJob).
        env: base environment of the children (default: this process's).
        base_port: first of consecutive ports (default: free ports picked at random).
        prefix_output: prefix each output line with ``[job:index]``.
        grace: seconds between SIGTERM and SIGKILL when stopping children.
        host: loopback host name used in the cluster addresses.
        output: where prefixed lines go (default ``sys.stdout``).
    """
    if not command:
        raise InvalidArgumentError("launch needs a command to run, e.g. -- python train.py.")
    cluster, tasks = _cluster_tasks(num_ps, num_workers, chief, evaluator, base_port, host)
    base_env = dict(os.environ if env is None else env)
    base_env.pop("TOWERFLOW_SECRET", None)
    base_env["PYTHONUNBUFFERED"] = "1"
    secret_dir = tempfile.mkdtemp(prefix="towerflow-launch-")
    secret_path = write_secret_file(os.path.join(secret_dir, "secret"), new_secret())
    base_env["TOWERFLOW_SECRET_FILE"] = str(secret_path)
    children: list[_Child] = []
    lock = threading.Lock()
    try:
        with _Signals() as signals:
            stdout = subprocess.PIPE if prefix_output else None
            for task in tasks:
                child_env = {**base_env, "TF_CONFIG": cluster.tf_config(task)}
                children.append(_Child(task, spawn_group(command, child_env, stdout)))
            for child in children if prefix_output else ():
                child.reader = threading.Thread(
                    target=_pump, args=(child, output or sys.stdout, lock), daemon=True
                )
                child.reader.start()
            logger.info("launched %s with cluster %s", [c.name for c in children], cluster.as_dict())
            finishing = [c for c in children if c.task.job_name in _FINISHING_JOBS]
            while not signals.event.wait(_POLL_SECONDS):
                if all(c.process.poll() is not None for c in finishing):
                    break
            stop_groups([c.process for c in children], grace)
            if signals.received is not None:
                logger.info("launch interrupted by signal %d; stopped every task", signals.received)
                return 128 + signals.received
            for child in finishing:
                logger.info("%s exited with status %d", child.name, _status(child.process.returncode))
            return max(_status(c.process.returncode) for c in finishing)
    finally:
        stop_groups([c.process for c in children if c.process.poll() is None], grace)
        for child in children:
            if child.reader is not None:
                child.reader.join(5.0)
        os.unlink(secret_path)
        os.rmdir(secret_dir)
