"""A small training task for fault injection: ``python -m towerflow.testing.task [options]``.

Every task of the cluster runs the same command and reads its role from
``TF_CONFIG`` (as under ``towerflow launch``) and the secret from
``TOWERFLOW_SECRET_FILE``:

- a ``ps`` task serves its parameter shard (with ``--heartbeat S`` it also
  watches the workers and prints ``heartbeat: <sentence>`` when one first
  answers, dies or is suspended, and comes back);
- the ``chief`` / ``worker`` tasks train with a :class:`~towerflow.Supervisor`
  and the ``ParameterServer`` strategy until the global step reaches
  ``--steps``; the chief initialises or restores the parameters and saves
  checkpoints in ``--logdir`` every ``--save-secs``.

Models: ``linear`` (article 003's regression) or ``ledger``: one float32
parameter per possible push of every worker, the push ``n`` of replica ``r``
being the one-hot gradient of element ``r * slots + n`` applied with SGD at
rate 1. After training the parameters say, element by element, whether each
push was applied (``-1``), lost (``0``) or applied twice (``-2``); each worker
journals ``incarnation <id>`` when its session starts, then ``push n`` before
and ``applied n`` after each push, so a restarted worker never reuses a slot
(see :mod:`towerflow.testing.ledger`).

Lines printed (matched by the tests): ``started <job>:<i> pid <pid>``,
``session ready at global step G (restored from R)``, with ``--ps-replicas``
``shards served by ps tasks T0,T1,...`` (where the worker found each dense shard: its
copy's task once it took over), ``step G local L loss X``,
``finished at global step G after L local steps``, ``preempted: checkpoint at step G``,
``threads left: <names>``, ``error <ErrorClass>: <message>`` (exit status 3).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "parse_args", "EXIT_ERROR"]

#: exit status of a task that stopped on a towerflow error
EXIT_ERROR = 3


def _seconds_or_none(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options of the task program."""
    p = argparse.ArgumentParser(prog="python -m towerflow.testing.task",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("linear", "ledger"), default="linear")
    p.add_argument("--mode", choices=("async", "sync", "ssp"), default="async")
    p.add_argument("--replicas-to-aggregate", type=int, default=None)
    p.add_argument("--steps", type=int, default=200, help="stop at this global step")
    p.add_argument("--until-file", default=None,
                   help="also keep training until this file exists (the driver ends the run)")
    p.add_argument("--step-time", type=float, default=0.0, help="simulated compute per step (s)")
    p.add_argument("--lr", type=float, default=None, help="default 0.05 (linear) or 1 (ledger)")
    p.add_argument("--logdir", default=None, help="chief's checkpoint directory")
    p.add_argument("--save-secs", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=5.0, help="deadline of a ps call (s)")
    p.add_argument("--step-timeout", type=_seconds_or_none, default=30.0,
                   help="how long a sync / ssp push waits for the other workers (s; 'none': "
                        "for ever)")
    p.add_argument("--init-timeout", type=float, default=60.0)
    p.add_argument("--slots", type=int, default=4096, help="ledger: pushes per worker")
    p.add_argument("--journal", default=None, help="ledger: directory of the workers' journals")
    p.add_argument("--print-every", type=int, default=10)
    p.add_argument("--heartbeat", type=float, default=0.0,
                   help="ps: heartbeat interval for watching the workers (0: off)")
    p.add_argument("--max-missed", type=int, default=3)
    p.add_argument("--serve-forever", action="store_true",
                   help="ps: serve until stopped, not only until every worker finished")
    p.add_argument("--ps-replicas", type=int, default=0,
                   help="live copies of each ps shard on the next ps task (async; 0: none)")
    p.add_argument("--partition-bytes", type=int, default=None,
                   help="split a variable over this many bytes across the ps tasks")
    return p.parse_args(argv)


def _say(message: str) -> None:
    print(message, flush=True)


def _serve_ps(cluster: Any, task: Any, args: argparse.Namespace) -> int:
    from towerflow.cluster.heartbeat import HeartbeatOptions
    from towerflow.ps.server.host import run_ps_task

    options = None
    if args.heartbeat > 0:
        options = HeartbeatOptions(interval=args.heartbeat, max_missed=args.max_missed)
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("heartbeat: %(message)s"))
        beats = logging.getLogger("towerflow.cluster.heartbeat")
        beats.addHandler(handler)
        beats.setLevel(logging.INFO)
        beats.propagate = False
    _say(f"serving {task.device_name}")
    return run_ps_task(cluster, task, heartbeat=options, serve_forever=args.serve_forever)


def _ledger_loss(model: Any, onehot: Any) -> Any:
    return (model.p * onehot).sum()


def _model_and_batches(args: argparse.Namespace, world: int) -> tuple[Any, Any, Any]:
    """(model, loss_fn, batch_fn(n) -> batch) of the chosen model."""
    import torch

    if args.model == "ledger":
        size = world * args.slots
        model = torch.nn.Module()
        model.p = torch.nn.Parameter(torch.zeros(size))

        def ledger_batch(rank: int, n: int) -> Any:
            onehot = torch.zeros(size)
            onehot[rank * args.slots + n] = 1.0
            return onehot

        return model, _ledger_loss, ledger_batch
    from towerflow.models.linear import LinearRegression, mse_loss, regression_data

    data = regression_data(100, noise=0.1)
    return LinearRegression(torch.Generator().manual_seed(0)), mse_loss, lambda r, n: data


def _serving(client: Any) -> str:
    """``task,task,...``: the ps task serving each dense shard, as ``client`` routes it."""
    return ",".join(str(s.route.task if s.route is not None else s.layout.index)
                    for s in client.shards)


def _held(args: argparse.Namespace) -> bool:
    return args.until_file is not None and not os.path.exists(args.until_file)


def _say_preempted(args: argparse.Namespace) -> None:
    from towerflow.checkpoint import CheckpointManager

    latest = CheckpointManager(args.logdir).latest() if args.logdir else None
    step = int(latest.name.rsplit("-", 1)[1]) if latest is not None else None
    _say(f"preempted: checkpoint at step {step}")


def _train(cluster: Any, task: Any, args: argparse.Namespace) -> int:
    from towerflow.cluster import Server
    from towerflow.strategies import OptimizerConfig
    from towerflow.training.supervisor import Supervisor

    rank, world = cluster.replica_index(task), cluster.num_replicas
    model, loss_fn, batch_of = _model_and_batches(args, world)
    lr = args.lr if args.lr is not None else (1.0 if args.model == "ledger" else 0.05)
    server = Server(cluster, task.job_name, task.task_index)
    placement: dict[str, Any] = {}  # given only when asked: the strategy's defaults otherwise
    if args.ps_replicas:
        placement["replicas"] = args.ps_replicas
    if args.partition_bytes is not None:
        placement["partition_threshold_bytes"] = args.partition_bytes
    sv = Supervisor(is_chief=cluster.is_chief(task), logdir=args.logdir,
                    save_model_secs=args.save_secs, max_to_keep=3, mode=args.mode,
                    replicas_to_aggregate=args.replicas_to_aggregate, timeout=args.timeout,
                    step_timeout=args.step_timeout, init_timeout=args.init_timeout,
                    **placement)
    journal = None
    if args.model == "ledger":
        from towerflow.testing.ledger import Journal

        journal = Journal(Path(args.journal) / f"{task.job_name}-{task.task_index}.journal")
    local = 0
    try:
        with sv.managed_session(server, model=model, optimizer=OptimizerConfig("sgd", lr=lr)) \
                as sess:
            step = sess.global_step
            _say(f"session ready at global step {step} (restored from {sv.restored_from})")
            if args.ps_replicas:  # where this worker found each shard (its copy after a switch)
                _say(f"shards served by ps tasks {_serving(sess.strategy.client)}")
            if journal is not None:  # pushes of this incarnation carry seq 1, 2, ...
                journal.write(f"incarnation {sess.strategy.client.incarnation}")
            while not sv.should_stop() and (step < args.steps or _held(args)):
                n = journal.next + local if journal is not None else local
                if args.step_time:
                    time.sleep(args.step_time)
                if journal is not None:
                    if n >= args.slots:
                        break
                    journal.write(f"push {n}")
                result = sess.run_step(loss_fn, batch_of(rank, n))
                local += 1
                step = result.global_step
                if journal is not None:
                    journal.write(f"{'applied' if result.applied else 'unapplied'} {n}")
                if local % args.print_every == 0:
                    _say(f"step {step} local {local} loss {float(result.loss):.5f}")
        if sv.preempted:
            _say_preempted(args)
        _say(f"finished at global step {step} after {local} local steps")
    except SystemExit:
        _say_preempted(args)
        raise
    finally:
        sv.stop()
        server.stop()
        if journal is not None:
            journal.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run this process's task of the cluster in ``TF_CONFIG``; return the exit status."""
    from towerflow.cluster import resolve_cluster
    from towerflow.errors import TowerflowError

    args = parse_args(argv)
    cluster, task = resolve_cluster()
    if cluster is None or task is None:
        _say("error InvalidArgumentError: no TF_CONFIG; start the task through LocalCluster "
             "or towerflow launch.")
        return 2
    _say(f"started {task.job_name}:{task.task_index} pid {os.getpid()}")
    try:
        if task.job_name == "ps":
            status = _serve_ps(cluster, task, args)
        else:
            status = _train(cluster, task, args)
    except TowerflowError as exc:
        _say(f"error {type(exc).__name__}: {exc}")
        status = EXIT_ERROR
    others = sorted(t.name for t in threading.enumerate()
                    if t is not threading.main_thread() and not t.daemon)
    _say(f"threads left: {', '.join(others) or 'none'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
