"""Child processes that die with their parent, started without ``preexec_fn``.

``subprocess.Popen(preexec_fn=...)`` runs Python in the forked child before
``exec``; in a process where gRPC (or any native library) already runs threads
that is unsafe, and gRPC's fork handlers can abort the child
(``epoll_wait error: Bad file descriptor``). Instead, the child runs a few lines
of Python that ask Linux to SIGTERM it when its parent goes
(``PR_SET_PDEATHSIG``), check that the parent is still the one that started
it, and ``exec`` the real command in the same process (same pid, same process
group).

Example:
    >>> guarded_argv(["echo", "hi"])[-2:]
    ['echo', 'hi']
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

__all__ = ["guarded_argv"]

_GUARD = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(143)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def guarded_argv(argv: Sequence[str]) -> list[str]:
    """Return ``argv`` wrapped so that the child gets SIGTERM when this process dies.

    On systems other than Linux the command is returned unchanged.
    """
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-S", "-c", _GUARD, str(os.getpid()), *argv]
