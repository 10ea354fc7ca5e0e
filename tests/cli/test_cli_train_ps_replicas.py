"""``towerflow train click --ps-replicas 1`` under ``towerflow launch --max-restarts``: a ps
task killed mid-run is started again by launch and rejoins as the copy of its shards while
training goes on; then the other ps task can be killed too, and training still goes on,
with no restart of the workers or the chief."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from launched import task_process

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
    launcher = subprocess.Popen(command, env=subprocess_env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: queue.Queue[str] = queue.Queue()
    seen: list[str] = []
    reader = threading.Thread(target=lambda: [lines.put(x) for x in launcher.stdout], daemon=True)
    reader.start()

    def wait_for(*patterns: str) -> None:
        """Until a line matched each of ``patterns`` (in any order), 90 s at most."""
        left, deadline = list(patterns), time.monotonic() + 90
        while left:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line matched {left} in 90 s:\n" +
                                     "".join(seen[-80:])) from None
            seen.append(line)
            left = [p for p in left if not re.search(p, line)]

    try:
        wait_for(r"\[worker:0\] saved checkpoint")
        task_process(launcher, "ps", 0).kill()
        wait_for(r"ps:0 failed \(status 137\); starting it again")
        wait_for(*(rf"\[ps:1\] .*shard {shard} has a live copy on ps task 0 again"
                   for shard in (0, 1)))  # its copy promoted / its copy's task gone
        wait_for(r"\[worker:0\] saved checkpoint")  # training goes on
        task_process(launcher, "ps", 1).kill()  # both shards on the replacement now
        wait_for(r"\[worker:\d\] .*shard 1 failed over from ps task 1 to its replica on ps "
                 r"task 0 \(term 2\)")
        wait_for(r"\[worker:0\] saved checkpoint")
        wait_for(r"\[worker:0\] saved checkpoint")
        launcher.send_signal(signal.SIGTERM)  # stop the run: its checkpoint, exit 0
        assert launcher.wait(timeout=90) == 0, "".join(seen[-60:])
    finally:
        if launcher.poll() is None:  # its tasks first: each runs in its own process group
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(launcher.pid).children(recursive=True):
                    child.kill()
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        reader.join(timeout=10)
    said = "".join(seen)
    assert "restarting the workers and the chief" not in said, said[-4000:]
