"""Whole fault scenarios on a local cluster, shared by the tests and the benchmark.

- :func:`chaos_run` — async training of the ledger model while random
  workers are killed (``SIGKILL``) and restarted (and, on ps tasks whose shards
  have live copies, a ps task killed for good); returns the audit of the
  final parameters against the workers' journals and the ps's own ledger of
  applied pushes (replayed on the initial parameters).
- :func:`detection_times` — how long heartbeats take to declare a killed
  and a suspended task dead.
"""

from __future__ import annotations

import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from towerflow.cluster.heartbeat import HeartbeatMonitor, HeartbeatOptions
from towerflow.cluster.server import Server
from towerflow.errors import DataLossError, InvalidArgumentError
from towerflow.testing.faults import LocalCluster, loopback_cluster
from towerflow.testing.ledger import LedgerAudit, audit_ledger, read_journals

__all__ = ["ChaosReport", "chaos_run", "detection_times", "TASK_COMMAND", "STEP_LINE",
           "SERVING_LINE"]

#: the fault-injection training program
TASK_COMMAND = [sys.executable, "-m", "towerflow.testing.task"]
#: a progress line of the program; group 1 is the global step
STEP_LINE = r"^step (\d+) local (\d+)"
#: where a starting worker found each dense shard (group 1: ``task,task,...``)
SERVING_LINE = r"^shards served by ps tasks ([\d,]+)"


@dataclass(frozen=True, slots=True)
class ChaosReport:
    """What a chaos run did and found.

    Attributes:
        kills: workers killed (faults injected).
        survived: kills after which the restarted worker finished its run.
        global_step: the ps's step at the end (the smallest of its shards').
        ps_applied: pushes the ps counted as applied (shard 0's counter; a copy that
            took a shard over counts only what it applied itself).
        audit: the ledger audit.
        exit_codes: each worker's final exit status.
        ps_killed: the ps tasks killed (``SIGKILL``, not restarted), in order.
        served_by: the ps task serving each dense shard at the end, by shard.
        terms: each shard's term at the end (1 until its copy took it over).
        found_switched: worker incarnations that started after a ps kill and found the
            killed task's shard on its copy at once (``ShardRoute.discover``).
    """

    kills: int
    survived: int
    global_step: int
    ps_applied: int
    audit: LedgerAudit
    exit_codes: tuple[int, ...]
    ps_killed: tuple[int, ...] = ()
    served_by: tuple[int, ...] = (0,)
    terms: tuple[int, ...] = (1,)
    found_switched: int = 0


def _kill_and_restart(lc: LocalCluster, victim: int, rng: random.Random) -> None:
    """Kill ``victim`` after a random number (1-4) of its step lines, then restart it."""
    proc = lc.task("worker", victim)
    proc.wait_for_line(STEP_LINE, timeout=120, count=rng.randint(1, 4))
    proc.kill()
    proc.restart()


def _kill_ps(lc: LocalCluster, victim: int, rng: random.Random) -> None:
    """Kill ps task ``victim`` for good after a random number (1-4) of the chief's next step
    lines (the chief is never killed: its log only grows)."""
    chief = lc.task("worker", 0)
    seen = len(chief.find(STEP_LINE))
    chief.wait_for_line(STEP_LINE, timeout=120, count=seen + rng.randint(1, 4))
    lc.task("ps", victim).kill()


def _check_ps_options(ps_tasks: int, ps_replicas: int, ps_kills: int) -> None:
    if ps_tasks < 1 or ps_replicas not in (0, 1) or (ps_replicas and ps_tasks < 2):
        raise InvalidArgumentError(
            f"chaos_run got ps_tasks={ps_tasks}, ps_replicas={ps_replicas}; use ps_replicas 0, "
            "or 1 with ps_tasks >= 2 (shard i's copy on ps task (i + 1) % ps_tasks).")
    if ps_kills and (not ps_replicas or ps_kills > 1):
        raise InvalidArgumentError(
            f"chaos_run got ps_kills={ps_kills} with ps_replicas={ps_replicas}; a ps task can "
            "be killed only with ps_replicas=1, and only one: a shard on its copy has no "
            "copy of its own.")


def chaos_run(workdir: str | Path, *, kills: int = 4, workers: int = 3, steps: int = 1500,
              step_time: float = 0.02, seed: int = 0, env: dict[str, str] | None = None,
              ps_tasks: int = 1, ps_replicas: int = 0, ps_kills: int = 0) -> ChaosReport:
    """Train the ledger model in async mode, killing and restarting random workers.

    Worker 0 (the chief, which initialises the ps) is never killed. A kill
    lands after a random number (1-4) of the victim's progress lines, i.e. at
    a random point of a push. The run ends when every worker has reached
    ``steps`` and every kill has been made (the workers keep training until
    the driver creates their ``--until-file``); the parameters are then
    pulled and audited.

    With ``ps_tasks`` > 1 the model's parameter is split across the ps tasks (one
    shard each); with ``ps_replicas=1`` each shard has a live copy on the next ps
    task, and ``ps_kills=1`` kills a random ps task for good at a random point
    among the worker kills (after 1-4 of the chief's progress lines): the
    workers switch its shard to the copy and go on, and the final read follows
    the switch. The killed task's ledger of applied pushes is lost with it: its
    shard's elements are audited by the parameters alone
    (:attr:`LedgerAudit.ledger_uncovered`).
    """
    _check_ps_options(ps_tasks, ps_replicas, ps_kills)
    workdir = Path(workdir)
    rng = random.Random(seed)
    slots = steps + kills + 64
    args = ["--model", "ledger", "--slots", str(slots), "--journal", str(workdir),
            "--steps", str(steps), "--step-time", str(step_time), "--print-every", "3",
            "--timeout", "10", "--init-timeout", "120", "--until-file", str(workdir / "stop"),
            "--serve-forever"]  # the ps outlives the workers: its parameters are audited
    if ps_tasks > 1:  # one part of the parameter on each ps task
        args += ["--partition-bytes", "1"]
    if ps_replicas:
        args += ["--ps-replicas", str(ps_replicas)]
    spec = loopback_cluster(num_ps=ps_tasks, num_workers=workers)
    # a ps kill comes before a worker kill, so that a worker restarts after it (no draw
    # without one: a seed kills the same workers at the same points as before ps kills)
    ps_at = {rng.randrange(max(1, kills)): rng.randrange(ps_tasks) for _ in range(ps_kills)}
    killed: list[int] = []
    with LocalCluster(spec, TASK_COMMAND + args, env=env, log_dir=workdir / "logs") as lc:
        for index in range(ps_tasks):
            lc.start("ps", index)
        for index in range(workers):
            lc.start("worker", index)
        for position in range(kills + 1):
            if position in ps_at:
                _kill_ps(lc, ps_at[position], rng)
                killed.append(ps_at[position])
            if position < kills:
                _kill_and_restart(lc, rng.randrange(1, workers), rng)
        (workdir / "stop").touch()
        codes = tuple(lc.task("worker", i).wait(timeout=300) for i in range(workers))
        final = _final_read(spec, lc.credentials, workers * slots, ps_replicas)
        found = _found_switched(lc, workers, killed)
    entries = [(start, stop, [(e.worker_id, e.incarnation, e.seq, e.step, e.partial,
                               e.applied_start, e.applied_stop) for e in reply.entries])
               for start, stop, reply in final.ledgers]
    journals = read_journals(workdir, {i: f"worker-{i}" for i in range(workers)})
    audit = audit_ledger(final.params, journals, slots=slots, shard_ledgers=entries)
    survived = kills if all(c == 0 for c in codes) else 0
    return ChaosReport(kills=kills, survived=survived, global_step=final.step,
                       ps_applied=final.applied, audit=audit, exit_codes=codes,
                       ps_killed=tuple(killed), served_by=final.served_by, terms=final.terms,
                       found_switched=found)


def _found_switched(lc: LocalCluster, workers: int, killed: list[int]) -> int:
    """Worker incarnations whose first routes put a killed ps task's shard on its copy."""
    found = 0
    for index in range(1, workers):
        proc = lc.task("worker", index)
        for incarnation in range(2, proc.incarnation + 1):
            line = re.search(SERVING_LINE, proc.output(incarnation), re.MULTILINE)
            tasks = [int(t) for t in line.group(1).split(",")] if line else []
            found += any(tasks[k] != k for k in killed if k < len(tasks))
    return found


@dataclass(frozen=True, slots=True)
class _FinalRead:
    params: np.ndarray
    step: int
    applied: int
    ledgers: list[tuple[int, int, Any]]  # (start, stop, LedgerReply) of each shard read
    served_by: tuple[int, ...]
    terms: tuple[int, ...]


def _final_read(spec: Any, credentials: Any, size: int, replicas: int) -> _FinalRead:
    """Read the parameters, steps and ledgers of every shard from the ps task serving it now
    (a shard whose primary was killed: from its copy, as a worker started after the switch
    finds it). A shard's ledger is read from its own primary only: the copy's covers only
    what it applied itself since it took over.

    Raises:
        DataLossError: a ledger forgot its oldest entries (more pushes than it keeps).
    """
    from towerflow.ps import PSClient, plan_placement

    num_ps = spec.num_tasks("ps")
    plan = plan_placement({"p": (size,)}, num_ps,
                          partition_threshold_bytes=1 if num_ps > 1 else None)
    client = PSClient(spec, plan, worker_id=0, credentials=credentials, timeout=30.0,
                      replicas=replicas)
    try:
        if replicas:
            client.wait_until_initialized(timeout=60)  # finds the shards that switched
        parts = [np.empty(s.numel, np.float32) for s in plan.shards]
        step = client.pull(parts)
        statuses = [shard.status() for shard in client.shards]
        ledgers, start = [], 0
        for shard, part in zip(client.shards, parts, strict=True):
            if shard.route is None or shard.route.task == shard.layout.index:
                ledgers.append((start, start + part.size, shard.ledger()))
            start += part.size
        routes = [s.route.where() if s.route else (s.layout.index, 1) for s in client.shards]
    finally:
        client.close(done=False)
    for _, _, reply in ledgers:
        if reply.first:
            raise DataLossError(
                f"the ps ledger forgot its first {reply.first} entries; run fewer steps than "
                "its capacity.")
    return _FinalRead(params=np.concatenate(parts), step=min(int(s.step) for s in statuses)
                      if statuses else step, applied=int(statuses[0].stats["applied"]),
                      ledgers=ledgers, served_by=tuple(t for t, _ in routes),
                      terms=tuple(int(s.term) if replicas else 1 for s in statuses))


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
