"""``towerflow launch``: start a whole cluster on this machine.

    towerflow launch --ps 1 --workers 2 -- python examples/distributed_linear_regression.py

Every task runs the command with its own ``TF_CONFIG`` and a shared, fresh
cluster secret (held in memory only); output lines are prefixed with
``[job:index]``; Ctrl-C stops the workers and the chief first (the chief
writes its final checkpoint), then the ps tasks; the exit status is the
workers' worst.

Each child runs ``max(1, cores // tasks)`` PyTorch threads (``OMP_NUM_THREADS``),
unless ``OMP_NUM_THREADS`` is set (then every child keeps it); one line says
which (:mod:`towerflow.cluster.threads`).
"""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``towerflow launch``."""
    parser = subparsers.add_parser(
        "launch",
        help="run a command as every task of a local cluster (ps, workers, chief)",
        description="Start one process per task on this machine, each with TF_CONFIG and "
        "TOWERFLOW_SECRET_FILE set; when the workers finish, or on Ctrl-C, stop the workers "
        "and the chief first, then the ps tasks. Each child gets its share of the cores "
        "(OMP_NUM_THREADS = cores // tasks) unless OMP_NUM_THREADS is set.",
    )
    parser.add_argument("--ps", type=int, default=1, help="number of ps tasks (default 1)")
    parser.add_argument("--workers", type=int, default=2, help="number of workers (default 2)")
    parser.add_argument("--chief", action="store_true", help="add a chief task")
    parser.add_argument("--evaluator", action="store_true", help="add an evaluator task")
    parser.add_argument("--base-port", type=int, default=None, help="first of consecutive ports")
    parser.add_argument("--grace", type=float, default=45.0,
                        help="seconds between SIGTERM and SIGKILL: longer than the chief's "
                        "final checkpoint may take (30 s by default; default 45)")
    parser.add_argument("--train-dir", metavar="DIR",
                        help="keep the cluster's address book (cluster.json) in DIR, and its "
                        "secret (cluster.secret, 0600) while it runs: `towerflow status "
                        "--train-dir DIR` watches it")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="when a worker or the chief fails, stop the workers and the chief "
                        "and start them again, N times at most (the ps tasks go on serving; "
                        "the command resumes from its last checkpoint); a ps task that fails "
                        "is started again alone (with --ps-replicas 1 it rejoins as the copy "
                        "of its shards while training goes on); default 0")
    parser.add_argument(
        "--no-prefix", action="store_true", help="do not prefix output lines with the task"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    return parser


def run(args: argparse.Namespace) -> int:
    """Launch the cluster and return the workers' worst exit status."""
    from towerflow.cluster.launcher import launch_cluster

    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    return launch_cluster(
        command,
        num_ps=args.ps,
        num_workers=args.workers,
        chief=args.chief,
        evaluator=args.evaluator,
        base_port=args.base_port,
        prefix_output=not args.no_prefix,
        grace=args.grace,
        train_dir=args.train_dir,
        max_restarts=args.max_restarts,
    )
