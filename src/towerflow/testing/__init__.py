"""Fault injection for towerflow clusters: real task processes on loopback.

- :mod:`~towerflow.testing.faults` — start, kill (``SIGKILL``), suspend
  (``SIGSTOP``), resume, terminate and restart the tasks of a local cluster,
  wait for their log lines with deadlines, and clean up every process.
- :mod:`~towerflow.testing.task` — the small training program those tasks
  run (``python -m towerflow.testing.task``), including the update-ledger model
  that shows which pushes the ps applied and how many times.
- :mod:`~towerflow.testing.inprocess` — ps tasks served from the test's own process
  (``ps_tasks``), for tests and benchmarks that need a cluster and no child processes.

Used by towerflow's own fault tests and by ``benchmarks/reliability.py``.
"""

from __future__ import annotations

from towerflow.testing.faults import (
    LocalCluster,
    TaskProcess,
    leftover_processes,
    loopback_cluster,
    wait_until,
)

__all__ = ["LocalCluster", "TaskProcess", "leftover_processes", "loopback_cluster", "wait_until"]
