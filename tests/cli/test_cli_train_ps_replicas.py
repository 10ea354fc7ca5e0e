"""``towerflow train click --ps-replicas 1`` under ``towerflow launch --max-restarts``: a ps
task killed mid-run is started again by launch and rejoins as the copy of its shards while
training goes on; then the other ps task can be killed too, and training still goes on,
with no restart of the workers or the chief."""

from __future__ import annotations

import signal
import sys

import pytest
from launched import Launched

SMALL = ["--table-rows", "2000", "--ids-per-example", "8", "--embedding-dim", "8",
         "--summary-every", "0", "--no-progress", "--log-every", "50"]
TRAIN = [sys.executable, "-m", "towerflow", "train", "click", *SMALL]


@pytest.mark.slow
def test_under_launch_a_killed_ps_task_rejoins_as_the_copy_and_training_goes_on(
        tmp_path, subprocess_env) -> None:
    run = tmp_path / "run"
    command = [sys.executable, "-m", "towerflow", "launch", "--ps", "2", "--workers", "2",
               "--max-restarts", "1", "--grace", "20", "--", *TRAIN, "--train-dir", str(run),
               "--ps-replicas", "1", "--checkpoint-every", "50", "--max-steps", "100000000"]
    with Launched(command, subprocess_env) as launch:
        launch.wait_for(r"\[worker:0\] saved checkpoint")
        launch.task("ps", 0).kill()
        launch.wait_for(r"ps:0 failed \(status 137\); starting it again")
        launch.wait_for(*(rf"\[ps:1\] .*shard {shard} has a live copy on ps task 0 again"
                          for shard in (0, 1)))  # its copy promoted / its copy's task gone
        launch.wait_for(r"\[worker:0\] saved checkpoint")  # training goes on
        launch.task("ps", 1).kill()  # both shards on the replacement now
        launch.wait_for(r"\[worker:\d\] .*shard 1 failed over from ps task 1 to its replica on "
                        r"ps task 0 \(term 2\)")
        launch.wait_for(r"\[worker:0\] saved checkpoint")
        launch.wait_for(r"\[worker:0\] saved checkpoint")
        launch.process.send_signal(signal.SIGTERM)  # stop the run: its checkpoint, exit 0
        assert launch.process.wait(timeout=90) == 0, "".join(launch.seen[-60:])
    said = launch.said()
    assert "restarting the workers and the chief" not in said, said[-4000:]
