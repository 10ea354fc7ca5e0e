"""Chief faults with real processes: SIGTERM (preemption) and SIGKILL with a restart."""

from __future__ import annotations

import time

import pytest
import torch

from towerflow.checkpoint import CheckpointManager, read_checkpoint
from towerflow.testing import LocalCluster, leftover_processes, loopback_cluster, wait_until
from towerflow.testing.scenarios import STEP_LINE as STEP
from towerflow.testing.scenarios import TASK_COMMAND as TASK
from towerflow.testing.task import EXIT_ERROR


def _complete_checkpoints(logdir) -> list[str]:
    return [p.name for p in CheckpointManager(logdir, max_to_keep=None).checkpoints()] \
        if logdir.exists() else []


def _training(subprocess_env, logdir, save_secs: float) -> LocalCluster:
    """1 ps and 2 workers training for ever; worker 0 (the chief) saves in ``logdir``."""
    args = ["--steps", "1000000", "--step-time", "0.01", "--logdir", str(logdir),
            "--save-secs", str(save_secs)]
    return LocalCluster(loopback_cluster(1, 2), TASK + args, env=subprocess_env)


@pytest.mark.slow
def test_sigterm_makes_the_chief_checkpoint_and_exit_zero_within_a_bound(subprocess_env,
                                                                          tmp_path):
    logdir = tmp_path / "train"
    with _training(subprocess_env, logdir, save_secs=3600) as lc:
        lc.start("ps", 0)
        chief, other = lc.start("worker", 0), lc.start("worker", 1)
        chief.wait_for_line(STEP, timeout=90, count=2)
        assert _complete_checkpoints(logdir) == []  # nothing due yet
        seen = chief.last_number(STEP)
        chief.terminate()
        sent = time.monotonic()
        assert chief.wait(timeout=60) == 0, chief.tail()
        assert time.monotonic() - sent < 60
        saved = int(chief.wait_for_line(r"^preempted: checkpoint at step (\d+)$",
                                        timeout=5).group(1))
        assert saved >= seen
        latest = CheckpointManager(logdir).latest()
        assert latest is not None and read_checkpoint(latest).step == saved
        assert other.running  # the preempted chief does not take the others down
    assert leftover_processes() == []


@pytest.mark.slow
def test_killed_chief_restores_the_latest_complete_checkpoint_and_no_one_else_saves(
        subprocess_env, tmp_path):
    logdir = tmp_path / "train"
    with _training(subprocess_env, logdir, save_secs=0.3) as lc:
        lc.start("ps", 0)
        chief, other = lc.start("worker", 0), lc.start("worker", 1)
        wait_until(lambda: len(_complete_checkpoints(logdir)) >= 2, timeout=90,
                   what="two checkpoints by the chief")
        assert chief.kill() == -9
        listing = _complete_checkpoints(logdir)
        latest = CheckpointManager(logdir).latest()
        # the newest, or the one before when the kill fell between a save's directory and
        # its `latest` pointer: that save never committed and is not restored
        assert latest is not None and latest.name in listing[-2:], (latest, listing)
        # the other worker trains on alone, and never writes a checkpoint
        at_kill = other.last_number(STEP)
        wait_until(lambda: other.last_number(STEP) >= at_kill + 50, timeout=60,
                   what="worker 1 training while the chief is dead")
        assert _complete_checkpoints(logdir) == listing
        chief.restart()
        ready = chief.wait_for_line(r"^session ready at global step (\d+) \(restored from "
                                    r"(\d+)\)$", timeout=90)
        restored = int(ready.group(2))
        assert restored == read_checkpoint(latest).step
        assert int(ready.group(1)) >= restored
        wait_until(lambda: _complete_checkpoints(logdir)[-1:] != listing[-1:], timeout=60,
                   what="a new checkpoint by the restarted chief")
    assert leftover_processes() == []


@pytest.mark.slow
def test_a_chief_that_fails_before_initialising_ends_every_task_with_its_error(subprocess_env,
                                                                                 tmp_path):
    logdir = tmp_path / "train"
    # a checkpoint of another model (the ledger's one parameter): the linear chief cannot restore it
    CheckpointManager(logdir).save(7, {"model": {"p": torch.zeros(8)}})
    with _training(subprocess_env, logdir, save_secs=3600) as lc:
        ps, other = lc.start("ps", 0), lc.start("worker", 1)
        other.wait_for_line(r"^started worker:1", timeout=60)
        chief = lc.start("worker", 0)
        assert chief.wait(timeout=90) == EXIT_ERROR, chief.tail()
        failed = time.monotonic()
        said = chief.wait_for_line(r"^error (\w+): (.+)$", timeout=5)
        # the worker that waited for the initialisation and the ps task end with the chief's error
        assert other.wait(timeout=30) == EXIT_ERROR, other.tail()
        assert ps.wait(timeout=30) == EXIT_ERROR, ps.tail()
        assert time.monotonic() - failed < 10
        first_line = f"{said.group(1)}: {said.group(2)}"[:200]
        for task in (other, ps):
            line = task.wait_for_line(r"^error AbortedError: (.+)$", timeout=5).group(1)
            assert "the chief failed before it initialised the job" in line.lower(), line
            assert first_line in line, (first_line, line)
    assert leftover_processes() == []
