"""Start, kill, suspend and restart the tasks of a cluster as real processes on loopback.

A :class:`LocalCluster` owns one :class:`TaskProcess` per started task. Each
task runs in its own process group with ``TF_CONFIG`` naming its role and the
cluster's secret in a mode-0600 file; its output goes to a log file per
incarnation, which :meth:`TaskProcess.wait_for_line` polls with a deadline.
Leaving the ``with`` block stops every process group (SIGTERM, then SIGKILL),
so no task outlives a test, suspended ones included::

    spec = loopback_cluster(num_ps=1, num_workers=2)
    with LocalCluster(spec, ["python", "-m", "towerflow.testing.task", "--steps", "200"]) as lc:
        ps = lc.start("ps", 0)
        workers = [lc.start("worker", i) for i in range(2)]
        workers[1].wait_for_line(r"step \\d+", timeout=60)
        workers[1].kill()                       # SIGKILL, mid-training
        workers[1].restart()
        assert workers[0].wait(timeout=60) == 0
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from towerflow._children import signal_group, spawn_group, stop_groups
from towerflow.cluster.launcher import free_ports
from towerflow.cluster.spec import ClusterSpec, TaskInfo
from towerflow.cluster.transport import Credentials, new_secret, write_secret_file
from towerflow.errors import DeadlineExceededError, FailedPreconditionError

__all__ = ["TaskProcess", "LocalCluster", "loopback_cluster", "wait_until", "leftover_processes"]

_T = TypeVar("_T")
_POLL = 0.05


def wait_until(predicate: Callable[[], _T], *, timeout: float, what: str,
               interval: float = _POLL) -> _T:
    """Poll ``predicate`` until it returns something truthy; return that.

    Raises:
        DeadlineExceededError: still falsy after ``timeout`` seconds (names ``what``).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceededError(f"{what} did not happen within {timeout:g} s.")
        time.sleep(min(interval, remaining))


def loopback_cluster(num_ps: int = 1, num_workers: int = 2, *, chief: bool = False,
                     extra: Mapping[str, int] | None = None) -> ClusterSpec:
    """A cluster spec on free ``127.0.0.1`` ports (``extra``: more jobs, e.g. a watcher)."""
    sizes = {"ps": num_ps, "worker": num_workers, **({"chief": 1} if chief else {}),
             **dict(extra or {})}
    ports = iter(free_ports(sum(sizes.values())))
    return ClusterSpec({job: [f"127.0.0.1:{next(ports)}" for _ in range(n)]
                        for job, n in sizes.items() if n})


def leftover_processes() -> list[str]:
    """Descriptions of this process's live descendants (zombies excluded)."""
    import psutil

    alive = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"pid {child.pid}: {' '.join(child.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            continue
    return alive


class TaskProcess:
    """One task of a :class:`LocalCluster` as a real process in its own process group.

    Args:
        task: the task it runs.
        argv: the command line.
        env: its full environment (``TF_CONFIG`` included).
        log_dir: where ``<job>-<index>.<incarnation>.log`` files go.
    """

    def __init__(self, task: TaskInfo, argv: Sequence[str], env: Mapping[str, str],
                 log_dir: Path) -> None:
        self.task = task
        self.argv = list(argv)
        self.env = dict(env)
        self.log_dir = log_dir
        self.incarnation = 0
        self.process: subprocess.Popen | None = None
        self.started_at = 0.0

    def __repr__(self) -> str:
        return f"TaskProcess({self.name}, pid={self.pid}, incarnation={self.incarnation})"

    @property
    def name(self) -> str:
        """``job:index``."""
        return f"{self.task.job_name}:{self.task.task_index}"

    @property
    def pid(self) -> int | None:
        """The current incarnation's process id."""
        return None if self.process is None else self.process.pid

    @property
    def log_path(self) -> Path:
        """The current incarnation's log file."""
        return self.log_dir / f"{self.task.job_name}-{self.task.task_index}.{self.incarnation}.log"

    @property
    def running(self) -> bool:
        """Whether the current incarnation has not exited (a suspended one is running)."""
        return self.process is not None and self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        """The exit status (``-signal`` when killed), None while running."""
        return None if self.process is None else self.process.poll()

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, argv: Sequence[str] | None = None) -> TaskProcess:
        """Start a new incarnation (with another command line when given).

        Raises:
            FailedPreconditionError: the current incarnation is still running.
        """
        if self.running:
            raise FailedPreconditionError(
                f"{self.name} is still running (pid {self.pid}); kill or stop it first."
            )
        if argv is not None:
            self.argv = list(argv)
        self.incarnation += 1
        with open(self.log_path, "wb") as log:
            self.process = spawn_group(self.argv, self.env, log)
        self.started_at = time.monotonic()
        return self

    def restart(self, argv: Sequence[str] | None = None) -> TaskProcess:
        """Kill the current incarnation if it runs, then start a new one."""
        if self.running:
            self.kill()
        return self.start(argv)

    def _signal_group(self, sig: int) -> bool:
        return self.process is not None and signal_group(self.process, sig)

    def kill(self, timeout: float = 10.0) -> int:
        """``SIGKILL`` the task's process group and reap it; return its status."""
        self._signal_group(signal.SIGKILL)
        return self.wait(timeout)

    def suspend(self) -> None:
        """``SIGSTOP`` the task's process group (it stays connected but answers nothing)."""
        self._signal_group(signal.SIGSTOP)

    def resume(self) -> None:
        """``SIGCONT`` a suspended task."""
        self._signal_group(signal.SIGCONT)

    def terminate(self) -> None:
        """Send ``SIGTERM`` to the task's main process only (a preemption notice)."""
        if self.running and self.process is not None:
            self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        """Wait for the task to exit; return its status.

        Raises:
            DeadlineExceededError: still running after ``timeout`` seconds (the
                message ends with the tail of its log).
        """
        if self.process is None:
            raise FailedPreconditionError(f"{self.name} was never started.")
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise DeadlineExceededError(
                f"{self.name} (pid {self.pid}) did not exit within {timeout:g} s; its log ends "
                f"with:\n{self.tail()}"
            ) from None

    def stop(self, grace: float = 5.0) -> int | None:
        """SIGTERM the process group (resuming it if suspended), SIGKILL after ``grace`` s."""
        if self.process is None:
            return None
        stop_groups([self.process], grace)
        return self.process.returncode

    # -- output ----------------------------------------------------------------------------
    def output(self, incarnation: int | None = None) -> str:
        """The log of an incarnation (default: the current one)."""
        number = self.incarnation if incarnation is None else incarnation
        path = self.log_dir / f"{self.task.job_name}-{self.task.task_index}.{number}.log"
        try:
            return path.read_bytes().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, lines: int = 15) -> str:
        """The last ``lines`` lines of the current log."""
        return "\n".join(self.output().splitlines()[-lines:])

    def find(self, pattern: str) -> list[re.Match[str]]:
        """Every match of ``pattern`` (multiline regex) in the current log."""
        return list(re.finditer(pattern, self.output(), re.MULTILINE))

    def last_number(self, pattern: str, default: int = 0) -> int:
        """The integer in group 1 of the last match of ``pattern`` (``default`` if none)."""
        matches = self.find(pattern)
        return int(matches[-1].group(1)) if matches else default

    def wait_for_line(self, pattern: str, timeout: float, *, count: int = 1) -> re.Match[str]:
        """Wait until the current log has ``count`` matches of ``pattern``; return the last.

        Raises:
            DeadlineExceededError: not seen within ``timeout`` seconds, or the
                process exited without printing it (the message shows its log).
        """
        deadline = time.monotonic() + timeout
        while True:
            matches = self.find(pattern)
            if len(matches) >= count:
                return matches[count - 1]
            exited = not self.running
            if exited or time.monotonic() >= deadline:
                why = (f"exited with status {self.returncode}" if exited
                       else f"did not print it within {timeout:g} s")
                raise DeadlineExceededError(
                    f"{self.name} {why} while waiting for /{pattern}/ (x{count}); its log ends "
                    f"with:\n{self.tail()}"
                )
            time.sleep(_POLL)


class LocalCluster:
    """Real processes for the tasks of ``cluster``, cleaned up on exit.

    Args:
        cluster: the cluster (every address on loopback).
        command: the command every task runs (it reads its role from ``TF_CONFIG``).
        env: base environment (default: this process's); ``PYTHONUNBUFFERED`` and
            ``OMP_NUM_THREADS=1`` are set.
        secret: give the tasks a fresh cluster secret (``TOWERFLOW_SECRET_FILE``).
        log_dir: where logs and the secret go (default: a temporary directory,
            removed on exit).
        report_on_error: when the ``with`` block raises, print every task's log
            tail to stderr before stopping the tasks.
    """

    def __init__(self, cluster: ClusterSpec, command: Sequence[str], *,
                 env: Mapping[str, str] | None = None, secret: bool = True,
                 log_dir: str | Path | None = None, report_on_error: bool = True) -> None:
        self.cluster = cluster
        self.report_on_error = report_on_error
        self.command = list(command)
        self._tmp = None if log_dir is not None else tempfile.TemporaryDirectory(
            prefix="towerflow-faults-")
        self.log_dir = Path(log_dir if log_dir is not None else self._tmp.name)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        base = dict(os.environ if env is None else env)
        for key in ("TF_CONFIG", "TOWERFLOW_SECRET", "TOWERFLOW_SECRET_FILE"):
            base.pop(key, None)
        base.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.credentials = Credentials()
        if secret:
            value = new_secret()
            path = write_secret_file(self.log_dir / "cluster.secret", value)
            base["TOWERFLOW_SECRET_FILE"] = str(path)
            self.credentials = Credentials(secret=value)
        self.env = base
        self.tasks: dict[TaskInfo, TaskProcess] = {}

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None and self.report_on_error:
            print(self.logs(), file=sys.stderr, flush=True)
        self.close()

    def task_env(self, job_name: str, task_index: int) -> dict[str, str]:
        """The environment of one task (``TF_CONFIG`` naming it)."""
        return {**self.env, "TF_CONFIG": self.cluster.tf_config(TaskInfo(job_name, task_index))}

    def start(self, job_name: str, task_index: int, argv: Sequence[str] | None = None,
              *, extra_args: Sequence[str] = ()) -> TaskProcess:
        """Start (or start again) one task; ``extra_args`` are appended to the command."""
        task = TaskInfo(job_name, task_index)
        self.cluster.validate_task(job_name, task_index)
        command = list(argv if argv is not None else self.command) + list(extra_args)
        proc = self.tasks.get(task)
        if proc is None:
            proc = TaskProcess(task, command, self.task_env(job_name, task_index), self.log_dir)
            self.tasks[task] = proc
            return proc.start()
        return proc.start(command)

    def task(self, job_name: str, task_index: int) -> TaskProcess:
        """The process of a started task."""
        return self.tasks[TaskInfo(job_name, task_index)]

    def stop_all(self, grace: float = 5.0) -> None:
        """Stop every task (SIGTERM, SIGKILL after ``grace`` s) and reap it."""
        stop_groups([p.process for p in self.tasks.values() if p.process is not None], grace)

    def close(self) -> None:
        """Stop every task and remove the temporary directory."""
        try:
            self.stop_all()
        finally:
            if self._tmp is not None:
                self._tmp.cleanup()

    def logs(self) -> str:
        """Every task's current log, for a failure report."""
        return "\n".join(f"----- {proc.name} (incarnation {proc.incarnation}, status "
                         f"{proc.returncode}) -----\n{proc.tail(40)}"
                         for proc in self.tasks.values())
