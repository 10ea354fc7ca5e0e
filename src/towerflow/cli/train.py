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
    """Every option of ``towerflow train`` (shared with the parameter-server trainer).

    Article 001's flags also work as its program spells them (``--train_dir``,
    ``--max_steps``, ``--num_gpus``, ``--log_device_placement``,
    ``--batch_size``, ``--data_dir``).
    """
    parser.add_argument("model", choices=_MODELS, help="which built-in model to train")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--num-gpus", "--num_gpus", type=int, default=None, metavar="N",
                       help="replicas on this machine, one per GPU (NCCL); default: one process")
    where.add_argument("--replicas", type=int, default=None, metavar="N",
                       help="replicas on this machine as CPU processes (Gloo); "
                       "default: one process")
    parser.add_argument("--device", default=None,
                        help="device of a single-process run, e.g. /cpu:0 or /gpu:1; "
                        "default: the first GPU, else the CPU")
    parser.add_argument("--train-dir", "--train_dir", default=None, metavar="DIR",
                        help="checkpoints and summaries; default: /tmp/<model>_train")
    parser.add_argument("--max-steps", "--max_steps", type=int, default=1000000, metavar="N",
                        help="global step at which training stops")
    parser.add_argument("--batch-size", "--batch_size", type=int, default=128, metavar="N",
                        help="examples per replica per step")
    parser.add_argument("--data-dir", "--data_dir", default="/tmp/cifar10_data", metavar="DIR",
                        help="CIFAR-10 binary files (downloaded there when absent)")
    parser.add_argument("--data", choices=("real", "synthetic"), default="real",
                        help="'synthetic': random CIFAR-10-shaped images, for speed runs "
                        "or with no network")
    parser.add_argument("--synthetic-examples", type=int, default=10000, metavar="N",
                        help="examples in the synthetic data set (with --data synthetic)")
    parser.add_argument("--no-download", action="store_true",
                        help="fail instead of downloading missing CIFAR-10 files")
    parser.add_argument("--log-device-placement", "--log_device_placement",
                        action="store_true",
                        help="log the device of every operation of the first step")
    parser.add_argument("--log-every", type=int, default=10, metavar="N",
                        help="print the step line (loss, examples/sec) every N steps")
    parser.add_argument("--summary-every", type=int, default=100, metavar="N",
                        help="write TensorBoard summaries every N steps (0: never)")
    parser.add_argument("--checkpoint-every", type=int, default=1000, metavar="N",
                        help="save a checkpoint every N steps, and at the last step "
                        "(0: only at the last)")
    parser.add_argument("--max-to-keep", type=int, default=5, metavar="N",
                        help="how many recent checkpoints to keep")
    parser.add_argument("--lr", type=float, default=None,
                        help="initial learning rate; default: 0.1")
    parser.add_argument("--lr-decay-factor", type=float, default=0.1, metavar="F",
                        help="the learning rate is multiplied by F every --epochs-per-decay")
    parser.add_argument("--epochs-per-decay", type=float, default=None, metavar="E",
                        help="epochs between learning-rate decays; default: 350")
    parser.add_argument("--ema-decay", type=float, default=0.9999, metavar="D",
                        help="decay of the parameters' moving averages, which eval "
                        "scores (0: none)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the initialisation, the data order and the distortions")
    parser.add_argument("--no-progress", action="store_true",
                        help="never show a progress bar (shown when stderr is a terminal)")
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
