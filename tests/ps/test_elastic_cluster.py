"""``towerflow train --join``: an elastic worker joins a running async job of real processes.

1 ps + 1 worker (the chief) train digits asynchronously; a third process,
with the cluster (``TF_CONFIG`` without a task) and the secret, joins with
``--join``: its pushes are applied under the id ps task 0 gave it (the ps
ledger holds it), ``towerflow status`` shows it; on SIGTERM it leaves with
``Done``, and a later push under its id is refused.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from towerflow.cluster import TaskInfo
from towerflow.ps import PSClient, plan_placement
from towerflow.ps.wire.calls import ELASTIC_BASE, REFUSED
from towerflow.ps.worker.observe import ClusterObserver
from towerflow.testing.faults import (
    LocalCluster,
    TaskProcess,
    leftover_processes,
    loopback_cluster,
    wait_until,
)

TRAIN = [sys.executable, "-m", "towerflow", "train", "digits", "--no-progress",
         "--max-steps", "100000000", "--checkpoint-every", "100000000", "--log-every", "100",
         "--ps-timeout", "10"]


def _elastic(observer: ClusterObserver) -> dict | None:
    """The elastic worker's entry of a snapshot, or None."""
    views = [w for w in observer.snapshot()["workers"] if w.get("elastic")]
    return views[0] if views else None


@pytest.mark.slow
def test_a_worker_joins_a_running_async_job_trains_shows_up_and_leaves(tmp_path) -> None:
    spec = loopback_cluster(num_ps=1, num_workers=1)
    cluster_file = tmp_path / "cluster.json"
    cluster_file.write_text(json.dumps(spec.as_dict()))
    with LocalCluster(spec, TRAIN + ["--train-dir", str(tmp_path / "job")]) as lc:
        lc.start("ps", 0)
        lc.start("worker", 0)
        joining = TaskProcess(TaskInfo("elastic", 0), TRAIN + [
            "--train-dir", str(tmp_path / "elastic"), "--join"],
            {**lc.env, "TF_CONFIG": json.dumps({"cluster": spec.as_dict()})}, lc.log_dir)
        lc.tasks[joining.task] = joining  # stopped and reported with the others
        joining.start()
        with ClusterObserver(spec, lc.credentials, probe_tasks=False) as observer:
            view = wait_until(lambda: (v := _elastic(observer)) and v["steps"] > 0 and v,
                              timeout=120, what="the elastic worker's pushes")
            worker_id = view["replica"]
            assert worker_id == ELASTIC_BASE and view["state"] == "joined"
            joining.wait_for_line(rf"elastic worker {worker_id}", timeout=30)

            out = subprocess.run([sys.executable, "-m", "towerflow", "status", "--cluster",
                                  str(cluster_file), "--once", "--json", "--interval", "0.5"],
                                 env=lc.env, capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            snap = json.loads(out.stdout)
            assert [w["job"] for w in snap["workers"]] == ["worker", "elastic"]
            shown = snap["workers"][1]
            assert shown["replica"] == worker_id and shown["state"] == "joined"
            assert shown["steps"] > 0 and shown["steps_per_sec"] > 0 and shown["name"]
            assert snap["workers"][0]["steps"] > 0  # the chief trains on

            # its pushes are applied: in the ps's ledger under its id
            client = PSClient(spec, plan_placement({"w": (1,)}, 1), worker_id=worker_id,
                              credentials=lc.credentials, on_bad_gradient="skip")
            try:
                (ledger,) = client.ledger()
                assert worker_id in {e.worker_id for e in ledger.entries}

                joining.terminate()  # SIGTERM: it ends its step, leaves with Done and exits 0
                assert joining.wait(60) == 0
                wait_until(lambda: (v := _elastic(observer)) and v["left"], timeout=30,
                           what="the elastic worker shown as left")
                late = client.push([np.ones(1, np.float32)], lr=0.1)
                assert late.statuses == (REFUSED,)
                assert f"from worker {worker_id} was refused" in late.messages[0]
            finally:
                client.close(done=False)
        assert lc.tasks[TaskInfo("worker", 0)].running  # the job goes on without it
    assert leftover_processes() == []
