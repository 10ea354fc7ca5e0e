"""Worker faults with real processes: SIGKILL in async and sync mode, SIGSTOP, rejoin."""

from __future__ import annotations

import re
import time

import pytest

from towerflow.testing import LocalCluster, leftover_processes, loopback_cluster, wait_until
from towerflow.testing.scenarios import STEP_LINE as STEP
from towerflow.testing.scenarios import TASK_COMMAND as TASK

ALIVE_1 = r"^heartbeat: task /job:worker/replica:0/task:1 .* is alive \(pid \d+\)$"


def _finished_step(proc) -> int:
    return int(proc.wait_for_line(r"^finished at global step (\d+)", timeout=5).group(1))


def _cluster(workers: int, subprocess_env, args: list[str]) -> LocalCluster:
    return LocalCluster(loopback_cluster(num_ps=1, num_workers=workers), TASK + args,
                        env=subprocess_env)


@pytest.mark.slow
def test_async_killed_worker_leaves_the_others_training_and_rejoins_after_restart(subprocess_env):
    target = 400
    args = ["--mode", "async", "--steps", str(target), "--step-time", "0.02", "--print-every", "5"]
    with _cluster(3, subprocess_env, args) as lc:
        lc.start("ps", 0)
        workers = [lc.start("worker", i) for i in range(3)]
        workers[2].wait_for_line(STEP, timeout=90)
        assert workers[2].kill() == -9
        at_kill = max(w.last_number(STEP) for w in workers)
        # the others keep training while it is dead
        wait_until(lambda: workers[0].last_number(STEP) >= at_kill + 20, timeout=60,
                   what="worker 0 training on while worker 2 is dead")
        # hold them while it restarts, so that the target is not reached without it
        for worker in workers[:2]:
            worker.suspend()
        workers[2].restart()
        ready = workers[2].wait_for_line(r"^session ready at global step (\d+)", timeout=90)
        assert target > int(ready.group(1)) >= at_kill + 20
        for worker in workers[:2]:
            worker.resume()
        workers[2].wait_for_line(STEP, timeout=60)  # it trains again
        for worker in workers:
            assert worker.wait(timeout=120) == 0, lc.logs()
            assert _finished_step(worker) >= target
            worker.wait_for_line(r"^threads left: none$", timeout=5)
    assert leftover_processes() == []


@pytest.mark.slow
def test_sync_with_a_backup_worker_keeps_stepping_when_a_worker_is_killed(subprocess_env):
    target = 120
    args = ["--mode", "sync", "--replicas-to-aggregate", "2", "--steps", str(target),
            "--step-time", "0.01", "--step-timeout", "60"]
    with _cluster(3, subprocess_env, args) as lc:
        lc.start("ps", 0)
        workers = [lc.start("worker", i) for i in range(3)]
        workers[2].wait_for_line(STEP, timeout=90)
        workers[2].kill()
        at_kill = max(w.last_number(STEP) for w in workers)
        for worker in workers[:2]:
            assert worker.wait(timeout=120) == 0, lc.logs()
            assert _finished_step(worker) >= target > at_kill
    assert leftover_processes() == []


@pytest.mark.slow
def test_sync_without_backup_waits_up_to_the_deadline_then_names_the_missing_task(subprocess_env):
    deadline = 4.0
    args = ["--mode", "sync", "--steps", "100000", "--step-timeout", str(deadline),
            "--heartbeat", "0.25"]
    with _cluster(2, subprocess_env, args) as lc:
        ps = lc.start("ps", 0)
        workers = [lc.start("worker", i) for i in range(2)]
        ps.wait_for_line(ALIVE_1, timeout=90)  # the ps has seen worker 1
        workers[0].wait_for_line(STEP, timeout=90)
        workers[1].kill()
        killed = time.monotonic()
        assert workers[0].wait(timeout=60) == 3
        waited = time.monotonic() - killed
        error = workers[0].wait_for_line(r"^error DeadlineExceededError: .*", timeout=5)
        assert re.search(r"waited 4 s for 2 gradients but received 1 \(from worker 0\); "
                         r"missing: task /job:worker/replica:0/task:1 at 127\.0\.0\.1:\d+ missed \d+ "
                         r"heartbeats \(.*\); it (is dead or suspended|may be slow)\.", error.group(0)), \
            error.group(0)
        assert deadline - 0.5 <= waited < deadline + 30
        ps.wait_for_line(r"^heartbeat: task /job:worker/replica:0/task:1 at 127\.0\.0\.1:\d+ "
                         r"missed 3 heartbeats .*; it is dead or suspended$", timeout=30)
    assert leftover_processes() == []


@pytest.mark.slow
def test_suspended_worker_is_reported_by_name_and_sync_training_resumes_after_sigcont(
        subprocess_env):
    args = ["--mode", "sync", "--steps", "1000000", "--step-timeout", "120", "--step-time",
            "0.01", "--heartbeat", "0.25"]
    with _cluster(2, subprocess_env, args) as lc:
        ps = lc.start("ps", 0)
        workers = [lc.start("worker", i) for i in range(2)]
        ps.wait_for_line(ALIVE_1, timeout=90)
        workers[1].wait_for_line(STEP, timeout=90)
        workers[1].suspend()
        ps.wait_for_line(r"^heartbeat: task /job:worker/replica:0/task:1 at 127\.0\.0\.1:\d+ "
                         r"missed 3 heartbeats \(last seen \d+\.\d s ago; last beat: no reply "
                         r"before the deadline: the process is suspended or hung\); it is dead "
                         r"or suspended$", timeout=30)
        stalled = workers[0].last_number(STEP)
        workers[1].resume()
        ps.wait_for_line(ALIVE_1, timeout=30, count=2)
        wait_until(lambda: workers[0].last_number(STEP) >= stalled + 20, timeout=60,
                   what="sync training resuming after SIGCONT")
        assert all(w.running for w in workers)
    assert leftover_processes() == []
