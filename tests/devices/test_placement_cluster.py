"""Placement in hand-started cluster tasks: the process's own task in the log, the
setter as a scope, compute on another task refused, the strategy keeping the
scope's assignment. Real processes on 127.0.0.1 (tests/support/programs/placement_program.py)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from towerflow.testing import LocalCluster, leftover_processes, loopback_cluster

PROGRAM = [sys.executable, str(Path(__file__).parents[1] / "support" / "programs" / "placement_program.py")]
PS = r"/job:ps/replica:0/task:{}/device:CPU:0"


@pytest.mark.slow
def test_cluster_tasks_log_their_own_task_and_keep_the_setters_assignment(
    subprocess_env: dict[str, str],
) -> None:
    cluster = loopback_cluster(num_ps=2, num_workers=2)
    with LocalCluster(cluster, PROGRAM, env=subprocess_env) as lc:
        for index in (0, 1):
            lc.start("ps", index)
        workers = [lc.start("worker", index) for index in (0, 1)]
        for worker in workers:
            worker.wait_for_line(r"^done$", timeout=120)
        outputs = [worker.output() for worker in workers]
    assert not leftover_processes()
    for index, out in enumerate(outputs):
        me = f"/job:worker/replica:0/task:{index}/device:CPU:0"
        other = f"/job:worker/replica:0/task:{1 - index}"
        # parameters on the ps tasks in turn, compute on this worker
        scope = json.loads(re.search(r"^scope: (.*)$", out, re.M).group(1))
        assert scope == {"0.weight": PS.format(0), "0.bias": PS.format(1),
                         "2.weight": PS.format(0), "2.bias": PS.format(1)}
        assert f"0/weight: (aten::empty): {PS.format(0)}" in out
        assert f"0/bias/uniform_: (aten::uniform_): {PS.format(1)}" in out
        assert f"0/linear: (aten::addmm): {me}" in out
        assert "/job:localhost/" not in out
        # compute on the other worker's task: refused, naming it and the way out
        refused = re.search(r"^refused: (.*)$", out, re.M)
        assert refused is not None, out
        assert re.search(
            rf"Cannot assign a device for operation 'ones(_\d+)?': explicit device "
            rf"specification '/job:worker/task:{1 - index}' names {other}, another task, and "
            rf"this process is /job:worker/replica:0/task:{index}; .* Run this work in a "
            rf"process of {other} \(start it there with towerflow.Server\(cluster, 'worker', "
            rf"{1 - index}\)\), or keep the parameters on the ps tasks with "
            rf"towerflow.device\(towerflow.replica_device_setter\(", refused.group(1))
        assert "not refused" not in out
    chief = outputs[0]
    placed = json.loads(re.search(r"^strategy: (.*)$", chief, re.M).group(1))
    assert placed == json.loads(re.search(r"^scope: (.*)$", chief, re.M).group(1))
    assert int(re.search(r"^global step: (\d+)$", chief, re.M).group(1)) == 3
