"""Sync steps that wait for ever (``step_timeout=None``) or fail at a finite step timeout."""

from __future__ import annotations

import re
import time

import pytest

from towerflow.testing import LocalCluster, leftover_processes, loopback_cluster
from towerflow.testing.scenarios import STEP_LINE as STEP
from towerflow.testing.scenarios import TASK_COMMAND as TASK

DEADLINE = 1.5  # the deadline of one ps call, and of one attempt of a push
STILL_WAITING = (r"^push 1 of worker 0 \(incarnation \d+, computed on step 0\) is still waiting "
                 r"for ps task 0 at 127\.0\.0\.1:\d+ after (\d+) s: its step needs the other "
                 r"workers' gradients\. Sent again \(retry (\d+), each attempt 1\.5 s; the ps "
                 r"applies it once\); waiting for ever \(step_timeout=None\)\.$")


def _cluster(subprocess_env, args: list[str]) -> LocalCluster:
    return LocalCluster(loopback_cluster(num_ps=1, num_workers=2), TASK + args,
                        env=subprocess_env)


@pytest.mark.slow
def test_step_timeout_none_waits_past_the_push_deadline_for_a_worker_that_starts_late(
        subprocess_env):
    target = 20
    args = ["--mode", "sync", "--steps", str(target), "--timeout", str(DEADLINE),
            "--step-timeout", "none", "--print-every", "5"]
    with _cluster(subprocess_env, args) as lc:
        lc.start("ps", 0)
        chief = lc.start("worker", 0)
        # the first push waits for worker 1; its 6th attempt is logged (6 push deadlines)
        line = chief.wait_for_line(STILL_WAITING, timeout=120, count=2)
        assert int(line.group(2)) == 6 and float(line.group(1)) >= 3 * DEADLINE
        assert chief.find(STEP) == []  # no step was completed without worker 1
        late = lc.start("worker", 1)
        for worker in (chief, late):
            assert worker.wait(timeout=120) == 0, lc.logs()
            finished = worker.wait_for_line(r"^finished at global step (\d+) after (\d+) local",
                                            timeout=5)
            assert int(finished.group(1)) >= target
            # every push of each worker counted in a step of two gradients: one per step
            assert int(finished.group(2)) == int(finished.group(1))
    assert leftover_processes() == []


@pytest.mark.slow
def test_a_finite_step_timeout_still_fails_with_the_missing_worker_named(subprocess_env):
    step_timeout = 2 * DEADLINE  # longer than one call deadline: no retry may hide it
    args = ["--mode", "sync", "--steps", "20", "--timeout", str(DEADLINE),
            "--step-timeout", str(step_timeout)]
    with _cluster(subprocess_env, args) as lc:
        lc.start("ps", 0)
        chief = lc.start("worker", 0)
        chief.wait_for_line(r"^session ready at global step 0", timeout=90)
        ready = time.monotonic()
        assert chief.wait(timeout=60) == 3, lc.logs()
        waited = time.monotonic() - ready
        error = chief.wait_for_line(r"^error DeadlineExceededError: .*", timeout=5).group(0)
        assert re.search(r"waited 3 s for 2 gradients but received 1 \(from worker 0\); "
                         r"missing: .*task:1\b", error), error
        assert step_timeout <= waited < step_timeout + 3 * DEADLINE + 10
        assert chief.find(r"is still waiting for ps task") == []
    assert leftover_processes() == []
