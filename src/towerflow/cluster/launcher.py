"""The one launcher of local process groups: ``towerflow launch``, replicas and ps topologies.

Two front ends share one machinery (:func:`_run`): every child is started
guarded (it dies with the launcher, :mod:`towerflow._children`) in a session
of its own, its output lines prefixed with its name, and stopped by process
group (SIGTERM, then SIGKILL after a grace period, so no grandchild
survives); the exit status is the worst of the children that end the run.

:func:`launch_cluster` runs a whole cluster on one machine, one child per
task. Each child runs the same command; it learns its task from
``TF_CONFIG`` (as under a Kubeflow TFJob) and the cluster secret from
``TOWERFLOW_SECRET_FILE``, which names an anonymous in-memory file the
children inherit (``/proc/self/fd/N``, a Linux ``memfd``): no copy of the
secret is ever on disk, and it is gone with the last process holding it,
whatever kills the launcher. Output lines read ``[worker:1] step 10 ...``.
The launch ends when the workers (and the chief) have exited — the ps and
evaluator tasks are then stopped — or as soon as the chief fails (the others
would wait for it: for the parameters it initialises, for its checkpoints). On SIGINT / SIGTERM the workers and the
chief are stopped first (the chief writes its final checkpoint while the ps
tasks still serve), then the ps and evaluator tasks; a second signal is
passed on at once (the chief abandons its final checkpoint). The exit status
is the workers' worst, also when the launch was stopped by a signal (0 when
every worker and the chief stopped cleanly).

:func:`spawn_replicas` runs N replicas of one command with torchrun's
environment (``towerflow train --replicas N``): replica 0 writes straight to
this terminal, the others' lines are prefixed ``[replica i]``; when one fails
the others are stopped (a replica waiting in an all-reduce for a dead peer
would otherwise hang).

Example:
    >>> launch_cluster(["python", "train.py"], num_ps=1, num_workers=2)  # doctest: +SKIP
    0
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from towerflow._children import signal_group, spawn_group, stop_groups
from towerflow.cluster.address_book import published
from towerflow.cluster.spec import ClusterSpec, TaskInfo
from towerflow.cluster.threads import OMP_ENV, available_cores, share_line, thread_share
from towerflow.cluster.transport import new_secret
from towerflow.errors import InvalidArgumentError, NotFoundError

__all__ = ["launch_cluster", "spawn_replicas", "replica_env", "free_ports", "exit_status",
           "TRACEBACK_FILE_ENV"]

logger = logging.getLogger("towerflow.cluster")

#: names the file a replica writes the traceback of the error that ends it to
TRACEBACK_FILE_ENV = "TOWERFLOW_TRACEBACK_FILE"

#: Roles whose exit ends the launch; the others (ps, evaluator) are then stopped.
_FINISHING_JOBS = ("chief", "worker")
_POLL_SECONDS = 0.05


@dataclass(slots=True)
class _Child:
    """One child to start: its name, environment, output prefix (None: this terminal)."""

    name: str
    env: dict[str, str]
    prefix: str | None
    finishing: bool = True
    critical: bool = False  # its failure ends the launch (the chief: nothing goes on without it)
    restartable: bool = False  # a ps task: started again alone when it fails (max_restarts)
    process: subprocess.Popen | None = None
    reader: threading.Thread | None = field(default=None, repr=False)


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


def exit_status(returncode: int) -> int:
    """A child's exit status as a shell reports it (killed by signal N -> 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def _check_command(command: Sequence[str]) -> None:
    if not command:
        raise InvalidArgumentError("launch needs a command to run, e.g. -- python train.py.")
    program = command[0]
    found = (os.access(program, os.X_OK) and os.path.isfile(program)) if os.sep in program \
        else shutil.which(program) is not None
    if not found:
        raise NotFoundError(
            f"command {program!r} was not found (not on PATH, or not an executable file); "
            "check its spelling or give its path, e.g. -- python train.py."
        )


class _Signals:
    """Turns SIGINT / SIGTERM into a flag while installed (main thread only); a second
    signal goes on at once to every child still running."""

    def __init__(self, children: Sequence[_Child]) -> None:
        self.received: int | None = None
        self.event = threading.Event()
        self._children = children
        self._previous: dict[int, object] = {}

    def handle(self, signum: int, frame: object) -> None:
        if self.received is not None:
            logger.info("signal %d again: passed on to every task still running", signum)
            for child in self._children:
                if child.process is not None and child.process.poll() is None:
                    signal_group(child.process, signum)
            return
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


def _pump(stream: IO[bytes], prefix: str, out: IO[str], lock: threading.Lock) -> None:
    for raw in stream:
        line = raw.decode(errors="replace").rstrip("\n")
        with lock:
            out.write(prefix + line + "\n")
            out.flush()
    stream.close()


def _start(children: list[_Child], command: Sequence[str], output: IO[str] | None,
           pass_fds: Sequence[int]) -> None:
    lock = threading.Lock()
    for child in children:
        piped = child.prefix is not None
        child.process = spawn_group(command, child.env, subprocess.PIPE if piped else None,
                                    pass_fds=pass_fds)
        if piped:
            child.reader = threading.Thread(
                target=_pump, args=(child.process.stdout, child.prefix, output or sys.stdout, lock),
                name=f"towerflow-output-{child.name}", daemon=True)
            child.reader.start()


def _restart_failed_ps(children: Sequence[_Child], command: Sequence[str],
                       output: IO[str] | None, pass_fds: Sequence[int], left: int) -> int:
    """Start again each ps task that failed, ``left`` at most; how many were."""
    started = 0
    for child in children:
        code = child.process.poll() if child.restartable and child.process else None
        if code in (None, 0) or started >= left:
            continue
        started += 1
        logger.info("%s failed (status %d); starting it again: with --ps-replicas 1 it "
                    "rejoins as the copy of its shards while training goes on", child.name,
                    exit_status(code))
        _start([child], command, output, pass_fds)
    return started


def _stop(children: Sequence[_Child], grace: float) -> None:
    """Stop the finishing children first (the chief saves while the ps serve), then the rest."""
    for group in ([c for c in children if c.finishing], [c for c in children if not c.finishing]):
        live = [c.process for c in group if c.process is not None and c.process.poll() is None]
        if live:
            stop_groups(live, grace)


def _run(command: Sequence[str], children: list[_Child], *, grace: float, fail_fast: bool,
         output: IO[str] | None = None, pass_fds: Sequence[int] = (),
         max_restarts: int = 0) -> int:
    """Start ``children``, wait for the finishing ones, stop every child; the exit status.

    With ``max_restarts``, a finishing child that fails has every finishing child (the
    workers and the chief) stopped and started again, that many times at most (as
    torchrun restarts its group): the ps tasks go on serving, and the command started
    again resumes from its last checkpoint. A ps task that fails is started again alone
    (within the same ``max_restarts``): with ``--ps-replicas 1`` it rejoins as the copy of
    its shards while training goes on; without, the workers it stops resume as above."""
    failed: set[str] = set()
    finishing = [c for c in children if c.finishing]
    restarts = 0
    try:
        with _Signals(children) as signals:
            _start(children, command, output, pass_fds)
            while not signals.event.wait(_POLL_SECONDS):
                restarts += _restart_failed_ps(children, command, output, pass_fds,
                                               max_restarts - restarts)
                codes = [c.process.poll() for c in finishing]
                if all(code is not None for code in codes) and \
                        (restarts >= max_restarts or not any(codes)):
                    break
                down = [c for c, code in zip(finishing, codes, strict=True) if code not in (None, 0)]
                if down and restarts < max_restarts:
                    restarts += 1
                    logger.info("%s failed (status %d); restarting the workers and the chief "
                                "(restart %d of %d): they resume from the last checkpoint",
                                down[0].name, exit_status(down[0].process.returncode), restarts,
                                max_restarts)
                    _stop(finishing, grace)
                    _start(finishing, command, output, pass_fds)
                    continue
                broken = [c for c in down if fail_fast or c.critical or max_restarts]
                if broken:
                    failed = {c.name for c in broken}
                    if not fail_fast:
                        logger.info("%s failed (status %d); stopping the others", broken[0].name,
                                    exit_status(broken[0].process.returncode))
                    break
            _stop(children, grace)
            if signals.received is not None:
                logger.info("interrupted by signal %d; stopped the workers, then the others",
                            signals.received)
    finally:
        _stop(children, grace)
        for child in children:
            if child.reader is not None:
                child.reader.join(5.0)
    ended = [c for c in finishing if not failed or c.name in failed]
    return max((exit_status(c.process.returncode) for c in ended), default=1)


# --------------------------------------------------------------------------- clusters
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


def _secret_fd(env: dict[str, str], secret: bytes) -> list[int]:
    """Put ``secret`` where the children find it and nothing else does; the fds to pass."""
    if not hasattr(os, "memfd_create"):  # no anonymous files here: the environment only
        env["TOWERFLOW_SECRET"] = secret.decode()
        return []
    fd = os.memfd_create("towerflow-secret", os.MFD_CLOEXEC)
    os.fchmod(fd, 0o600)
    os.write(fd, secret)
    env["TOWERFLOW_SECRET_FILE"] = f"/proc/self/fd/{fd}"
    return [fd]


def _share_threads(env: dict[str, str], processes: int, who: str) -> None:
    """Give each of ``processes`` children its share of the cores (``OMP_NUM_THREADS`` in
    ``env``, kept when set) and log the line that says so."""
    cores = available_cores()
    threads, source = thread_share(cores, processes, env)
    env[OMP_ENV] = str(threads)
    logger.info("%s", share_line(who, processes, cores, threads, source))


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
    grace: float = 45.0,
    host: str = "localhost",
    output: IO[str] | None = None,
    who: str = "towerflow launch",
    train_dir: str | Path | None = None,
    max_restarts: int = 0,
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
        grace: seconds between SIGTERM and SIGKILL when stopping children (longer
            than a chief's final checkpoint may take, 30 s by default).
        host: loopback host name used in the cluster addresses.
        output: where prefixed lines go (default ``sys.stdout``).
        who: the command named in the line that reports each child's share of the cores
            (``OMP_NUM_THREADS``: ``cores // tasks``, or the value already set).
        train_dir: where to keep the cluster's address book and, while it runs, its
            secret (:mod:`towerflow.cluster.address_book`), for ``towerflow status
            --train-dir``; None: nowhere.
        max_restarts: times the workers and the chief are stopped and started again
            when one of them fails (the ps tasks go on serving); 0: none.

    Raises:
        InvalidArgumentError: no command, no worker, no room for the ports, or an
            ``OMP_NUM_THREADS`` that is not a positive integer.
        NotFoundError: the command's program does not exist.
    """
    _check_command(command)
    if max_restarts < 0:
        raise InvalidArgumentError(f"max_restarts={max_restarts} must be 0 (no restart) or more "
                                   "(--max-restarts N).")
    cluster, tasks = _cluster_tasks(num_ps, num_workers, chief, evaluator, base_port, host)
    base_env = dict(os.environ if env is None else env)
    for name in ("TOWERFLOW_SECRET", "TOWERFLOW_SECRET_FILE"):
        base_env.pop(name, None)
    base_env["PYTHONUNBUFFERED"] = "1"
    _share_threads(base_env, len(tasks), who)
    secret = new_secret()
    fds = _secret_fd(base_env, secret)
    children = [
        _Child(str(task), {**base_env, "TF_CONFIG": cluster.tf_config(task)},
               f"[{task}] " if prefix_output else None, task.job_name in _FINISHING_JOBS,
               critical=cluster.is_chief(task), restartable=task.job_name == "ps")
        for task in tasks
    ]
    logger.info("launching %s with cluster %s", [c.name for c in children], cluster.as_dict())
    book = (contextlib.nullcontext() if train_dir is None
            else published(train_dir, cluster, secret))
    try:
        with book:
            status = _run(command, children, grace=grace, fail_fast=False, output=output,
                          pass_fds=fds, max_restarts=max_restarts)
    finally:
        for fd in fds:
            os.close(fd)
    for child in children:
        if child.finishing and child.process is not None:
            logger.info("%s exited with status %d", child.name,
                        exit_status(child.process.returncode))
    return status


# --------------------------------------------------------------------------- replicas
def replica_env(rank: int, world_size: int, master_port: int,
                base: Mapping[str, str] | None = None) -> dict[str, str]:
    """torchrun's environment for local replica ``rank`` of ``world_size``.

    ``OMP_NUM_THREADS`` is kept when ``base`` sets it, else each replica's share
    of the cores (:func:`~towerflow.cluster.threads.thread_share`).

    Example:
        >>> env = replica_env(1, 2, 29500, base={})
        >>> env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]
        ('1', '1', '2', '29500')
    """
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
               LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", ROLE_RANK=str(rank),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port), PYTHONUNBUFFERED="1")
    env.pop("TF_CONFIG", None)
    env[OMP_ENV] = str(thread_share(available_cores(), world_size, env)[0])
    return env


def spawn_replicas(argv: Sequence[str], num_replicas: int, *,
                   env: Mapping[str, str] | None = None, master_port: int | None = None,
                   grace_s: float = 45.0, output: IO[str] | None = None,
                   log_dir: str | Path | None = None) -> int:
    """Run ``argv`` as ``num_replicas`` replica processes; return the worst exit status.

    Args:
        argv: the command of every replica (e.g. ``[sys.executable, "-m", "towerflow", ...]``).
        num_replicas: how many processes (ranks ``0 .. num_replicas - 1``).
        env: the base environment (default: this process's).
        master_port: the rendezvous port on 127.0.0.1 (default: a free one).
        grace_s: how long a stopped replica gets between SIGTERM and SIGKILL.
        output: where the other replicas' prefixed lines go (default ``sys.stdout``).
        log_dir: where replicas 1.. write the traceback of an error that ends them
            (``replica-<rank>.log``, named in ``TRACEBACK_FILE_ENV``), printing one
            line instead, so that replica 0's error is the one the terminal shows in
            full; None: they print it.

    Example:
        >>> spawn_replicas([sys.executable, "-c", "import os; assert os.environ['WORLD_SIZE'] == '2'"], 2)
        0
    """
    if num_replicas < 1:
        raise InvalidArgumentError(f"Need at least one replica, got {num_replicas}.")
    _check_command(argv)
    port = master_port or free_ports(1)[0]
    base = dict(os.environ if env is None else env)
    _share_threads(base, num_replicas, "towerflow train")
    children = [_Child(f"replica {rank}", replica_env(rank, num_replicas, port, base),
                       None if rank == 0 else f"[replica {rank}] ")
                for rank in range(num_replicas)]
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        for rank, child in enumerate(children[1:], start=1):
            child.env[TRACEBACK_FILE_ENV] = str(Path(log_dir).absolute() / f"replica-{rank}.log")
    return _run(argv, children, grace=grace_s, fail_fast=True, output=output)
