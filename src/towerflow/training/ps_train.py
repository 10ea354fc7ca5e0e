"""The tasks of a parameter-server cluster that do not train: article 001's topology with a ps.

``towerflow train cifar10 --num-gpus 2 --ps 1 --mode async`` starts a local
cluster (:func:`towerflow.cluster.launcher.launch_cluster`): K ps tasks that
keep the variables on the CPU and apply the updates, and one worker per GPU
(or ``--replicas N`` CPU workers, or one worker) that computes the gradients.
Each task runs the same command again with its ``TF_CONFIG``. A worker or the
chief trains with the strategy :func:`~towerflow.strategies.choose.choose_strategy`
picks (the ``ParameterServer``, which runs the task's ``Server`` so the ps
tasks' heartbeats reach it: in sync mode, a step that misses the gradient of
a dead or suspended worker names it); the other tasks run :func:`serve_task`.

On many machines, run the command on each with a ``TF_CONFIG`` naming a ``ps``
job (a Kubeflow TFJob sets it), or use ``towerflow server`` for the ps tasks.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

__all__ = ["serve_task"]

log = logging.getLogger("towerflow.training")


def serve_task(cluster: Any, task: Any, bind_host: str | None = None, *,
               serve_forever: bool = False, idle_timeout: float | None = 3600.0) -> int:
    """Play a task that does not train: a ps serves its shard (watching the workers with
    heartbeats; on ``bind_host`` instead of the cluster's host when given) until its job
    ends (``serve_forever``: until stopped; ``idle_timeout``: how long it keeps the
    parameters while every unfinished replica is away, see
    :func:`towerflow.ps.server.host.run_ps_task`); any other (an evaluator) has nothing to
    do. Returns the exit status."""
    if task.job_name == "ps":
        from towerflow.cluster.heartbeat import HeartbeatOptions
        from towerflow.cluster.transport import Credentials
        from towerflow.ps.server.host import run_ps_task

        return run_ps_task(cluster, task, Credentials.from_env(), heartbeat=HeartbeatOptions(),
                           bind_host=bind_host, serve_forever=serve_forever,
                           idle_timeout=idle_timeout)
    print(f"towerflow train: task {task} does not train; start `towerflow eval` for an "
          "evaluator", file=sys.stderr)
    return 0
