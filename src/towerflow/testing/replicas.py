"""Run a program as N all-reduce replicas on loopback, as torchrun would start them.

Example (one line of output per replica)::

    outputs = run_replicas(["python", "-c", CODE], world_size=2, port=free_ports(1)[0])
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence

__all__ = ["run_replicas"]


def run_replicas(command: Sequence[str], *, world_size: int, port: int,
                 env: Mapping[str, str] | None = None,
                 timeout: float = 120.0) -> list[tuple[int, str]]:
    """Start ``command`` once per rank with torchrun's variables; wait for all of them.

    Every replica runs on the CPU (``CUDA_VISIBLE_DEVICES`` is empty) and meets
    the others at ``127.0.0.1:port``. A replica still running after
    ``timeout`` seconds, or when anything fails, is killed.

    Returns:
        ``(exit status, stdout and stderr)`` of each rank, in rank order.
    """
    base = dict(os.environ if env is None else env)
    procs: list[subprocess.Popen[str]] = []
    try:
        for rank in range(world_size):
            child = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                         MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
            procs.append(subprocess.Popen(list(command), env=child, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return [(p.returncode, out) for p, out in zip(procs, outputs, strict=True)]
