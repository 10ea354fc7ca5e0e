"""Whole fault scenarios on a local cluster, shared by the tests and the benchmark.

- :func:`chaos_run` — async training of the ledger model while random
  workers are killed (``SIGKILL``) and restarted; returns the audit of the
  final parameters against the workers' journals and the ps's own ledger of
  applied pushes (replayed on the initial parameters).
- :func:`detection_times` — how long heartbeats take to declare a killed
  and a suspended task dead.
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from towerflow.cluster.heartbeat import HeartbeatMonitor, HeartbeatOptions
from towerflow.cluster.server import Server
from towerflow.errors import DataLossError
from towerflow.testing.faults import LocalCluster, loopback_cluster
from towerflow.testing.ledger import LedgerAudit, audit_ledger, read_journals

__all__ = ["ChaosReport", "chaos_run", "detection_times", "TASK_COMMAND", "STEP_LINE"]

#: the fault-injection training program
TASK_COMMAND = [sys.executable, "-m", "towerflow.testing.task"]
#: a progress line of the program; group 1 is the global step
STEP_LINE = r"^step (\d+) local (\d+)"


@dataclass(frozen=True, slots=True)
class ChaosReport:
    """What a chaos run did and found.

    Attributes:
        kills: workers killed (faults injected).
        survived: kills after which the restarted worker finished its run.
        global_step: the ps's step at the end.
        ps_applied: pushes the ps counted as applied.
        audit: the ledger audit.
        exit_codes: each worker's final exit status.
    """

    kills: int
    survived: int
    global_step: int
    ps_applied: int
    audit: LedgerAudit
    exit_codes: tuple[int, ...]


def _kill_and_restart(lc: LocalCluster, victim: int, rng: random.Random) -> None:
    """Kill ``victim`` after a random number (1-4) of its step lines, then restart it."""
    proc = lc.task("worker", victim)
    proc.wait_for_line(STEP_LINE, timeout=120, count=rng.randint(1, 4))
    proc.kill()
    proc.restart()


def chaos_run(workdir: str | Path, *, kills: int = 4, workers: int = 3, steps: int = 1500,
              step_time: float = 0.02, seed: int = 0, env: dict[str, str] | None = None
              ) -> ChaosReport:
    """Train the ledger model in async mode, killing and restarting random workers.

    Worker 0 (the chief, which initialises the ps) is never killed. A kill
    lands after a random number (1-4) of the victim's progress lines, i.e. at
    a random point of a push. The run ends when every worker has reached
    ``steps`` and every kill has been made (the workers keep training until
    the driver creates their ``--until-file``); the parameters are then
    pulled and audited.
    """
    from towerflow.ps import PSClient, plan_placement

    workdir = Path(workdir)
    rng = random.Random(seed)
    slots = steps + kills + 64
    args = ["--model", "ledger", "--slots", str(slots), "--journal", str(workdir),
            "--steps", str(steps), "--step-time", str(step_time), "--print-every", "3",
            "--timeout", "10", "--init-timeout", "120", "--until-file", str(workdir / "stop"),
            "--serve-forever"]  # the ps outlives the workers: its parameters are audited
    spec = loopback_cluster(num_ps=1, num_workers=workers)
    with LocalCluster(spec, TASK_COMMAND + args, env=env, log_dir=workdir / "logs") as lc:
        lc.start("ps", 0)
        for index in range(workers):
            lc.start("worker", index)
        for _ in range(kills):
            _kill_and_restart(lc, rng.randrange(1, workers), rng)
        (workdir / "stop").touch()
        codes = tuple(lc.task("worker", i).wait(timeout=300) for i in range(workers))
        client = PSClient(spec, plan_placement({"p": (workers * slots,)}, 1), worker_id=0,
                          credentials=lc.credentials, timeout=30.0)
        try:
            params = np.empty(workers * slots, np.float32)
            step = client.pull([params])
            applied = int(client.stats()[0]["applied"])
            reply = client.ledger()[0]
        finally:
            client.close(done=False)
    if reply.first:
        raise DataLossError(
            f"the ps ledger forgot its first {reply.first} entries; run fewer steps than its "
            "capacity."
        )
    entries = [(e.worker_id, e.incarnation, e.seq, e.step, e.partial, e.applied_start,
                e.applied_stop) for e in reply.entries]
    journals = read_journals(workdir, {i: f"worker-{i}" for i in range(workers)})
    audit = audit_ledger(params, journals, slots=slots, ps_ledger=entries)
    survived = kills if all(c == 0 for c in codes) else 0
    return ChaosReport(kills=kills, survived=survived, global_step=step, ps_applied=applied,
                       audit=audit, exit_codes=codes)


def detection_times(options: HeartbeatOptions, *, env: dict[str, str] | None = None
                    ) -> tuple[float, float]:
    """Seconds until heartbeats declare a ``SIGKILL``-ed and a ``SIGSTOP``-ped task dead."""
    spec = loopback_cluster(num_ps=0, num_workers=3)
    with LocalCluster(spec, [sys.executable, "-m", "towerflow", "server"], env=env) as lc:
        victims = [lc.start("worker", i) for i in (1, 2)]
        for proc in victims:
            proc.wait_for_line(r"^serving ", timeout=120)
        with Server(spec, "worker", 0, credentials=lc.credentials) as server, \
                HeartbeatMonitor(server, options=options) as beats:
            for index in (1, 2):
                beats.wait_for("worker", index, alive=True, timeout=60)
            times = []
            for index, fault in ((1, victims[0].kill), (2, victims[1].suspend)):
                start = time.monotonic()
                fault()
                beats.wait_for("worker", index, alive=False, timeout=60)
                times.append(time.monotonic() - start)
    return times[0], times[1]
