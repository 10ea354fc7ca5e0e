"""``towerflow train MODEL --ps K``: article 001's topology with a parameter server.

On one machine, ``towerflow train cifar10 --num-gpus 2 --ps 1 --mode async``
starts a local cluster (``towerflow launch``'s machinery): K ps tasks that
keep the variables on the CPU and apply the updates, and one worker per GPU
(or ``--replicas N`` CPU workers, or one worker) that computes the gradients.
Each task runs this same command again with its ``TF_CONFIG``; inside a task,
a ps serves its shard (:func:`towerflow.ps.run_ps_task`) and watches the
workers with heartbeats, and a worker or the chief runs the training loop
with the :class:`ParameterServer` strategy, which runs the task's ``Server``
so the heartbeats reach it: in sync mode, a step that misses the gradient of
a dead or suspended worker names it.

On many machines, run the command on each with a ``TF_CONFIG`` naming a ``ps``
job (a Kubeflow TFJob sets it), or use ``towerflow server`` for the ps tasks.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from towerflow.training.invocation import (
    build_config,
    build_data_options,
    replica_argv,
    require_gpus,
)

__all__ = ["run_ps_training", "worker_command"]

log = logging.getLogger("towerflow.training")


def worker_command(args: argparse.Namespace) -> list[str]:
    """The command every task of the local cluster runs: this one, rebuilt."""
    return [*replica_argv(args), "--ps", str(args.ps), "--mode", args.mode]


def _num_workers(args: argparse.Namespace) -> int:
    from towerflow.errors import InvalidArgumentError

    count = args.num_gpus or args.replicas or 1
    if count < 1 or args.ps < 1:
        raise InvalidArgumentError(
            f"--ps {args.ps} with {count} worker(s): both must be at least 1."
        )
    return count


def _launch_local(args: argparse.Namespace) -> int:
    """Start K ps tasks and the workers on this machine; return the workers' worst status."""
    from towerflow.cluster.launcher import launch_cluster

    workers = _num_workers(args)
    if args.num_gpus:
        require_gpus(args.num_gpus, role="workers")
    if args.model == "cifar10" and args.data == "real":
        _fetch_data(args)  # once, before the workers read it
    log.info("starting %d ps task(s) and %d worker(s), mode %s", args.ps, workers, args.mode)
    return launch_cluster(worker_command(args), num_ps=args.ps, num_workers=workers)


def _fetch_data(args: argparse.Namespace) -> None:
    from towerflow.training.tasks import get_task

    get_task(args.model).load("train", build_data_options(args))


def _worker_device(args: argparse.Namespace, task: Any) -> str | None:
    """Worker i computes on GPU i (mod the GPUs seen) with --num-gpus, on the CPU with --replicas."""
    if args.replicas:
        return "cpu"
    if args.num_gpus:
        import torch

        count = torch.cuda.device_count()
        return f"cuda:{task.task_index % count}" if count else "cpu"
    return args.device


def _train_task(args: argparse.Namespace, cluster: Any, task: Any) -> int:
    from towerflow.strategies.parameter_server import ParameterServer
    from towerflow.training.run import run_training

    strategy = ParameterServer(cluster, task, mode=args.mode, device=_worker_device(args, task))
    try:
        result = run_training(args.model, build_config(args), data=build_data_options(args),
                              lr=args.lr, lr_decay_factor=args.lr_decay_factor,
                              epochs_per_decay=args.epochs_per_decay, strategy=strategy)
    finally:
        strategy.shutdown()
    log.info("%s finished at global step %d", task.device_name, result.step)
    return 0


def run_ps_training(args: argparse.Namespace) -> int:
    """Run ``towerflow train`` with parameter servers; return the exit status.

    Without a ``TF_CONFIG`` (``--ps K``) this starts a local cluster; inside a
    task of a cluster it plays that task's role.
    """
    from towerflow.cluster import resolve_cluster
    from towerflow.errors import InvalidArgumentError

    if not os.environ.get("TF_CONFIG"):
        return _launch_local(args)
    cluster, task = resolve_cluster()
    if cluster is None or task is None or "ps" not in cluster.jobs:
        raise InvalidArgumentError(
            "TF_CONFIG names no 'ps' job; parameter-server training needs one "
            "(or run without TF_CONFIG and pass --ps K)."
        )
    if task.job_name == "ps":
        from towerflow.cluster.heartbeat import HeartbeatOptions
        from towerflow.cluster.transport import Credentials
        from towerflow.ps import run_ps_task

        return run_ps_task(cluster, task, Credentials.from_env(), heartbeat=HeartbeatOptions())
    if task.job_name not in ("chief", "worker"):
        print(f"towerflow train: task {task} has nothing to do in parameter-server training",
              file=sys.stderr)
        return 0
    return _train_task(args, cluster, task)
