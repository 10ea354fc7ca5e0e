"""Child processes that die with their parent, started without ``preexec_fn``.

``subprocess.Popen(preexec_fn=...)`` runs Python in the forked child before
``exec``; in a process where gRPC (or any native library) already runs threads
that is unsafe, and gRPC's fork handlers can abort the child
(``epoll_wait error: Bad file descriptor``). Instead, the child runs a few lines
of Python that ask Linux to SIGTERM it when its parent goes
(``PR_SET_PDEATHSIG``), check that the parent is still the one that started
it, and ``exec`` the real command in the same process (same pid, same process
group).

:func:`spawn_group` starts such a child in a process group of its own and
:func:`stop_groups` stops groups of them (SIGTERM, then SIGKILL after a grace
period), so no grandchild survives.

Example:
    >>> guarded_argv(["echo", "hi"])[-2:]
    ['echo', 'hi']
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import IO

__all__ = ["guarded_argv", "spawn_group", "signal_group", "stop_groups"]

_GUARD = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(143)\n"
    "try:\n"
    "    os.execvp(sys.argv[2], sys.argv[2:])\n"
    "except OSError as exc:\n"
    "    print(f'cannot run {sys.argv[2]!r}: {exc.strerror}', file=sys.stderr)\n"
    "    sys.exit(127)\n"
)


def guarded_argv(argv: Sequence[str]) -> list[str]:
    """Return ``argv`` wrapped so that the child gets SIGTERM when this process dies.

    On systems other than Linux the command is returned unchanged.
    """
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-S", "-c", _GUARD, str(os.getpid()), *argv]


def spawn_group(
    argv: Sequence[str], env: Mapping[str, str], stdout: int | IO[bytes] | None,
    pass_fds: Sequence[int] = (),
) -> subprocess.Popen:
    """Start ``argv`` guarded, in a new session (its own process group), stdin closed.

    Args:
        argv: the command line.
        env: the child's full environment.
        stdout: where its output goes (stderr joins it); ``None`` inherits both.
        pass_fds: file descriptors the child inherits (all others are closed).
    """
    return subprocess.Popen(
        guarded_argv(argv),
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=None if stdout is None else subprocess.STDOUT,
        start_new_session=True,
        pass_fds=tuple(pass_fds),
    )


def signal_group(process: subprocess.Popen, sig: int) -> bool:
    """Send ``sig`` to the process group led by ``process``; False if it is gone."""
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def stop_groups(processes: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM (and SIGCONT, for suspended ones) every group, SIGKILL after ``grace`` s; reap."""
    for process in processes:
        signal_group(process, signal.SIGTERM)
        signal_group(process, signal.SIGCONT)
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for process in processes:  # stragglers, grandchildren included
        signal_group(process, signal.SIGKILL)
        process.wait()
