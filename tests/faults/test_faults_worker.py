"""Worker faults with real processes: SIGKILL in async and sync mode, SIGSTOP, rejoin."""

from __future__ import annotations

import itertools
import re
import threading
import time

import numpy as np
import pytest

from towerflow.checkpoint import read_checkpoint
from towerflow.ps import PSClient, plan_placement
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


class _StepWatch:
    """Polls the global step of ps task 0 from this process; records when it changes."""

    def __init__(self, lc: LocalCluster, client: PSClient) -> None:
        self.client = client
        self.changes: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                step = self.client.global_step()
            except Exception:  # noqa: BLE001 - the ps not initialised yet, or stopped
                step = None
            now = time.monotonic()
            if step is not None and (not self.changes or step != self.changes[-1][1]):
                self.changes.append((now, step))
            self._stop.wait(0.005)

    def longest_gap(self, start: float, stop: float) -> float:
        """The longest time between step changes within ``[start, stop]``."""
        times = [t for t, _ in self.changes if start <= t <= stop]
        return max((b - a for a, b in itertools.pairwise(times)), default=float("inf"))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.client.close(done=False)


@pytest.mark.slow
def test_sync_with_a_backup_worker_keeps_stepping_when_a_worker_is_killed(subprocess_env):
    # 3 workers, 2 gradients per step: the kill of one costs no pause beyond about one step
    # (bound: twice the longest gap of the 3 s before the kill + one heartbeat interval)
    target, heartbeat, window = 1_000_000, 0.25, 3.0
    args = ["--mode", "sync", "--replicas-to-aggregate", "2", "--steps", str(target),
            "--step-time", "0.01", "--step-timeout", "60", "--heartbeat", str(heartbeat)]
    with _cluster(3, subprocess_env, args) as lc:
        lc.start("ps", 0)
        workers = [lc.start("worker", i) for i in range(3)]
        watch = _StepWatch(lc, PSClient(lc.cluster, plan_placement({"any": (1,)}, 1),
                                        worker_id=0, credentials=lc.credentials, timeout=5.0))
        try:
            workers[2].wait_for_line(STEP, timeout=90)
            start = time.monotonic()
            wait_until(lambda: time.monotonic() - start >= window and watch.changes
                       and watch.changes[-1][0] > start, timeout=60, what="steps before the kill")
            killed = time.monotonic()
            workers[2].kill()
            at_kill = watch.changes[-1][1]
            wait_until(lambda: watch.changes[-1][0] - killed >= window, timeout=60,
                       what="steps after the kill")
            before = watch.longest_gap(killed - window, killed)
            after = watch.longest_gap(killed - 0.5, killed + window)
            assert watch.changes[-1][1] > at_kill + 20
            print(f"longest gap between global steps: {before:.3f} s in the {window:g} s "
                  f"before the kill, {after:.3f} s in the {window:g} s after")
            assert after <= 2 * before + heartbeat, (before, after)
        finally:
            watch.close()
        for worker in workers[:2]:
            assert worker.running, lc.logs()
    assert leftover_processes() == []


@pytest.mark.slow
def test_sync_without_backup_waits_up_to_the_deadline_names_the_killed_worker_and_checkpoints(
        subprocess_env, tmp_path):
    """The chief waits the step timeout, names the missing task and saves the last step."""
    slots, deadline = 50_000, 4.0
    logdir = tmp_path / "train"
    args = ["--mode", "sync", "--steps", "1000000", "--step-timeout", str(deadline),
            "--heartbeat", "0.25", "--step-time", "0.01", "--logdir", str(logdir),
            "--model", "ledger", "--slots", str(slots), "--journal", str(tmp_path)]
    with _cluster(2, subprocess_env, args) as lc:
        ps = lc.start("ps", 0)
        workers = [lc.start("worker", i) for i in range(2)]
        ps.wait_for_line(ALIVE_1, timeout=90)  # the ps has seen worker 1
        workers[0].wait_for_line(STEP, timeout=90, count=3)
        workers[1].kill()
        killed = time.monotonic()
        assert workers[0].wait(timeout=60) == 3, lc.logs()
        waited = time.monotonic() - killed
        error = workers[0].wait_for_line(r"^error DeadlineExceededError: .*", timeout=5).group(0)
        assert re.search(r"waited 4 s for 2 gradients but received 1 \(from worker 0\); "
                         r"missing: task /job:worker/replica:0/task:1 at 127\.0\.0\.1:\d+ missed \d+ "
                         r"heartbeats \(.*\); it (is dead or suspended|may be slow)\.", error), error
        assert deadline - 0.5 <= waited < deadline + 30
        assert re.search(r" Not answering now: /job:worker/replica:0/task:1 at "
                         r"127\.0\.0\.1:\d+ \(no connection: it is not running\)\.", error), error
        saved = re.search(r" The chief saved (\S+) \(global step (\d+)\) before stopping\. "
                          r"Restart the missing task with the same command: a restarted worker "
                          r"rejoins the running job", error)
        assert saved, error
        ps.wait_for_line(r"^heartbeat: task /job:worker/replica:0/task:1 at 127\.0\.0\.1:\d+ "
                         r"missed 3 heartbeats .*; it is dead or suspended$", timeout=30)
        ckpt = read_checkpoint(saved.group(1))
        assert ckpt.step == int(saved.group(2)) >= workers[0].last_number(STEP)
        # the state of the last completed step: what the ps still holds (nothing moved since)
        client = PSClient(lc.cluster, plan_placement({"p": (2 * slots,)}, 1), worker_id=0,
                          credentials=lc.credentials, timeout=10.0)
        try:
            params = np.empty(2 * slots, np.float32)
            assert client.pull([params]) == ckpt.step
        finally:
            client.close(done=False)
        assert np.array_equal(ckpt.groups["model"]["p"].numpy(), params)
        # every completed step averaged one push of each worker
        assert float(params.sum()) == -ckpt.step
    assert leftover_processes() == []


@pytest.mark.slow
def test_sync_restarted_worker_rejoins_the_running_job_within_the_step_timeout(subprocess_env,
                                                                              tmp_path):
    target = 150
    args = ["--mode", "sync", "--steps", str(target), "--step-time", "0.01",
            "--step-timeout", "90", "--heartbeat", "0.25", "--print-every", "5",
            "--model", "ledger", "--slots", "4096", "--journal", str(tmp_path)]
    with _cluster(2, subprocess_env, args) as lc:
        lc.start("ps", 0)
        workers = [lc.start("worker", i) for i in range(2)]
        workers[1].wait_for_line(STEP, timeout=90, count=2)
        workers[1].kill()
        at_kill = workers[0].last_number(STEP)
        assert at_kill < target
        workers[1].restart()
        ready = workers[1].wait_for_line(r"^session ready at global step (\d+)", timeout=90)
        assert int(ready.group(1)) >= at_kill
        for worker in workers:
            assert worker.wait(timeout=120) == 0, lc.logs()
            assert _finished_step(worker) >= target
        # the chief never gave up: it waited for the new incarnation
        assert workers[0].find(r"^error ") == []
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
