"""Start N local replica processes, torchrun-style, and wait for all of them.

``towerflow train --replicas N`` (or ``--num-gpus N``) runs itself N times on
one machine: each child gets torchrun's environment (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1`` and a free
``MASTER_PORT``), so the :class:`~towerflow.strategies.Mirrored` strategy in
each finds its place exactly as under ``torchrun``.

Replica 0 writes straight to this terminal (its progress bar included); the
others' lines are prefixed with ``[replica i]``. When one replica fails, the
others are stopped (SIGTERM, then SIGKILL after a grace period) — a replica
waiting in an all-reduce for a dead peer would otherwise hang — and so are all
of them on Ctrl-C or SIGTERM. The exit status is the worst of the replicas
that ended on their own.

Example:
    >>> import sys
    >>> spawn_replicas([sys.executable, "-c", "import os; assert os.environ['WORLD_SIZE'] == '2'"], 2)
    0
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import IO

from towerflow._children import guarded_argv
from towerflow.errors import InvalidArgumentError

__all__ = ["spawn_replicas", "replica_env", "free_port", "exit_status"]

_POLL_S = 0.05


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def replica_env(rank: int, world_size: int, master_port: int,
                base: Mapping[str, str] | None = None) -> dict[str, str]:
    """torchrun's environment for local replica ``rank`` of ``world_size``.

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
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    return env


def exit_status(returncode: int) -> int:
    """A child's exit status as a shell reports it (killed by signal N -> 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def _pump(stream: IO[bytes], prefix: str) -> None:
    """Copy a replica's output to this process's stdout, each line prefixed."""
    for line in iter(stream.readline, b""):
        sys.stdout.write(prefix + line.decode(errors="replace"))
        sys.stdout.flush()
    stream.close()


def _start(argv: Sequence[str], rank: int, world: int, port: int,
           env: Mapping[str, str] | None) -> tuple[subprocess.Popen[bytes], threading.Thread | None]:
    piped = rank != 0
    proc = subprocess.Popen(
        guarded_argv(argv), env=replica_env(rank, world, port, env),
        stdout=subprocess.PIPE if piped else None, stderr=subprocess.STDOUT if piped else None,
    )
    if not piped:
        return proc, None
    assert proc.stdout is not None
    pump = threading.Thread(target=_pump, args=(proc.stdout, f"[replica {rank}] "),
                            daemon=True)
    pump.start()
    return proc, pump


def _stop(procs: Sequence[subprocess.Popen[bytes]], grace_s: float) -> set[int]:
    """SIGTERM every live child, SIGKILL those still alive after ``grace_s``; their indices."""
    stopped = {i for i, p in enumerate(procs) if p.poll() is None}
    for i in stopped:
        with contextlib.suppress(ProcessLookupError):
            procs[i].terminate()
    deadline = time.monotonic() + grace_s
    for i in stopped:
        try:
            procs[i].wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            procs[i].kill()
            procs[i].wait(timeout=grace_s)
    return stopped


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """While waiting, turn SIGTERM into KeyboardInterrupt so the children are stopped."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def spawn_replicas(argv: Sequence[str], num_replicas: int, *,
                   env: Mapping[str, str] | None = None, master_port: int | None = None,
                   grace_s: float = 10.0) -> int:
    """Run ``argv`` as ``num_replicas`` replica processes; return the worst exit status.

    Args:
        argv: the command of every replica (e.g. ``[sys.executable, "-m", "towerflow", ...]``).
        num_replicas: how many processes (ranks ``0 .. num_replicas - 1``).
        env: the base environment (default: this process's).
        master_port: the rendezvous port on 127.0.0.1 (default: a free one).
        grace_s: how long a stopped replica gets between SIGTERM and SIGKILL.
    """
    if num_replicas < 1:
        raise InvalidArgumentError(f"Need at least one replica, got {num_replicas}.")
    port = master_port or free_port()
    procs: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    killed: set[int] = set()
    try:
        with _sigterm_as_interrupt():
            for rank in range(num_replicas):
                proc, pump = _start(argv, rank, num_replicas, port, env)
                procs.append(proc)
                pumps.extend([pump] if pump else [])
            while any(p.poll() is None for p in procs):
                if any(p.poll() not in (None, 0) for p in procs):
                    killed = _stop(procs, grace_s)
                    break
                time.sleep(_POLL_S)
    except KeyboardInterrupt:
        _stop(procs, grace_s)
        return 130
    finally:
        _stop(procs, grace_s)
        for pump in pumps:
            pump.join(timeout=5.0)
    codes = [exit_status(p.returncode) for i, p in enumerate(procs) if i not in killed]
    return max(codes, default=1)
