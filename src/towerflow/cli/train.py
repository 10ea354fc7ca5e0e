"""``towerflow train cifar10|digits``: article 001's cifar10_multi_gpu_train.py as one command.

One process::

    towerflow train cifar10 --train-dir runs/c10 --max-steps 100000 --batch-size 128

N replicas on one machine (synchronous, all-reduce; each replica a process)::

    towerflow train cifar10 --num-gpus 2 --train-dir runs/c10     # one per GPU, NCCL
    towerflow train digits --replicas 2 --train-dir runs/digits   # CPU processes, Gloo

N machines: the same command under torchrun's environment (``torchrun
--nnodes 2 --nproc-per-node 4 -m towerflow train cifar10 ...``) or a
``TF_CONFIG`` without a ps job. With ``--ps K`` (or a ``TF_CONFIG`` naming a
``ps`` job) the parameter-server strategy trains instead.

Running the same command again resumes from the latest checkpoint in
``--train-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from towerflow.training.invocation import (
    build_config,
    build_data_options,
    replica_argv,
    require_gpus,
)

__all__ = ["add_parser", "add_train_arguments", "build_config", "build_data_options",
           "replica_argv", "require_gpus", "run"]

_MODELS = ("cifar10", "digits")


def add_train_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every option of ``towerflow train`` (shared with the parameter-server trainer)."""
    parser.add_argument("model", choices=_MODELS, help="which built-in model to train")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--num-gpus", type=int, default=None, metavar="N",
                       help="replicas on this machine, one per GPU (NCCL)")
    where.add_argument("--replicas", type=int, default=None, metavar="N",
                       help="replicas on this machine as CPU processes (Gloo)")
    parser.add_argument("--device", default=None,
                        help="device of a single-process run, e.g. /cpu:0 or /gpu:1")
    parser.add_argument("--train-dir", default=None,
                        help="checkpoints and summaries (default /tmp/<model>_train)")
    parser.add_argument("--max-steps", type=int, default=1000000)
    parser.add_argument("--batch-size", type=int, default=128, help="examples per replica")
    parser.add_argument("--data-dir", default="/tmp/cifar10_data",
                        help="CIFAR-10 binary files (downloaded when absent)")
    parser.add_argument("--data", choices=("real", "synthetic"), default="real",
                        help="'synthetic': random CIFAR-10-shaped images, for speed runs")
    parser.add_argument("--synthetic-examples", type=int, default=10000)
    parser.add_argument("--no-download", action="store_true",
                        help="fail instead of downloading missing CIFAR-10 files")
    parser.add_argument("--log-device-placement", action="store_true",
                        help="log the device of every operation of the first step")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--summary-every", type=int, default=100)
    parser.add_argument("--checkpoint-every", type=int, default=1000)
    parser.add_argument("--max-to-keep", type=int, default=5)
    parser.add_argument("--lr", type=float, default=None, help="initial learning rate (0.1)")
    parser.add_argument("--lr-decay-factor", type=float, default=0.1)
    parser.add_argument("--epochs-per-decay", type=float, default=None, help="(350)")
    parser.add_argument("--ema-decay", type=float, default=0.9999)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="never show a progress bar")
    parser.add_argument("--ps", type=int, default=0, metavar="K",
                        help="train with K local parameter-server tasks instead of all-reduce")
    parser.add_argument("--mode", choices=("async", "sync", "ssp"), default="async",
                        help="parameter-server update mode (with --ps)")
    return parser


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``towerflow train``."""
    parser = subparsers.add_parser(
        "train", help="train a built-in model (cifar10, digits)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    return add_train_arguments(parser)


def _tf_config_has_ps() -> bool:
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return False
    try:
        cluster = json.loads(raw).get("cluster", {})
    except (ValueError, AttributeError):
        return False  # the cluster resolver reports a malformed TF_CONFIG
    return isinstance(cluster, dict) and bool(cluster.get("ps"))


def _run_parameter_server(args: argparse.Namespace) -> int:
    from towerflow.training.ps_train import run_ps_training

    return int(run_ps_training(args) or 0)


def _check_counts(args: argparse.Namespace) -> int:
    from towerflow.errors import InvalidArgumentError

    count = args.num_gpus or args.replicas or 1
    for name in ("num_gpus", "replicas"):
        value = getattr(args, name)
        if value is not None and value < 1:
            flag = "--" + name.replace("_", "-")
            raise InvalidArgumentError(f"{flag} must be at least 1, got {value}.")
    if args.num_gpus:
        require_gpus(args.num_gpus)
    return count


def _strategy(args: argparse.Namespace) -> Any:
    """The strategy of this process: a replica of a world, or a single device."""
    from towerflow.strategies.mirrored import Mirrored
    from towerflow.strategies.single import SingleDevice

    if "RANK" in os.environ or "WORLD_SIZE" in os.environ or os.environ.get("TF_CONFIG"):
        return Mirrored(device="cpu" if args.replicas else args.device)
    if args.num_gpus:
        return SingleDevice("/gpu:0")
    return SingleDevice("/cpu:0" if args.replicas else args.device)


def run(args: argparse.Namespace) -> int:
    """Train; spawn the replicas first when asked for more than one on this machine."""
    if args.ps > 0 or _tf_config_has_ps():
        return _run_parameter_server(args)
    count = _check_counts(args)
    is_replica = "RANK" in os.environ or "WORLD_SIZE" in os.environ
    if count > 1 and not is_replica:
        from towerflow.training.spawn import spawn_replicas

        return spawn_replicas(replica_argv(args), count)
    from towerflow.training.run import run_training

    strategy = _strategy(args)
    try:
        run_training(args.model, build_config(args), data=build_data_options(args), lr=args.lr,
                     lr_decay_factor=args.lr_decay_factor,
                     epochs_per_decay=args.epochs_per_decay, strategy=strategy)
    finally:
        strategy.shutdown()
    return 0
