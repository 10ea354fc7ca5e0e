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
import sys
from typing import TYPE_CHECKING, Any

from towerflow.cli._argv import argv_from_namespace

if TYPE_CHECKING:  # torch stays out of the command line's start-up
    from towerflow.training.config import TrainConfig
    from towerflow.training.tasks import DataOptions

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


def build_config(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` the options describe."""
    from towerflow.training.config import TrainConfig

    return TrainConfig(
        train_dir=args.train_dir or f"/tmp/{args.model}_train", max_steps=args.max_steps,
        batch_size=args.batch_size, log_every=args.log_every, summary_every=args.summary_every,
        checkpoint_every=args.checkpoint_every, max_to_keep=args.max_to_keep,
        ema_decay=args.ema_decay if args.ema_decay > 0 else None, seed=args.seed,
        progress=False if args.no_progress else None,
        log_device_placement=args.log_device_placement)


def build_data_options(args: argparse.Namespace) -> DataOptions:
    """The :class:`DataOptions` the options describe."""
    from towerflow.training.tasks import DataOptions

    return DataOptions(data_dir=args.data_dir, synthetic=args.data == "synthetic",
                       synthetic_examples=args.synthetic_examples,
                       download=not args.no_download)


def replica_argv(args: argparse.Namespace) -> list[str]:
    """The command each spawned replica or task runs: ``towerflow train``, every flag kept."""
    parser = add_train_arguments(argparse.ArgumentParser(add_help=False))
    verbose = ["--verbose"] if getattr(args, "verbose", False) else []
    return [sys.executable, "-m", "towerflow", *verbose, "train",
            *argv_from_namespace(parser, args)]


def require_gpus(count: int, role: str = "replicas") -> None:
    """Raise when fewer than ``count`` GPUs are visible (``--num-gpus count``)."""
    import torch

    from towerflow.errors import InvalidArgumentError

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible < count:
        raise InvalidArgumentError(
            f"--num-gpus {count} asks for {count} GPU(s) but {visible} are visible; "
            f"use --replicas {count} for CPU {role}."
        )


def _local_count(args: argparse.Namespace) -> int:
    from towerflow.errors import InvalidArgumentError

    for name in ("num_gpus", "replicas", "ps"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "ps" else 1):
            flag = "--" + name.replace("_", "-")
            raise InvalidArgumentError(f"{flag} must be at least {int(name != 'ps')}, "
                                       f"got {value}.")
    return args.num_gpus or args.replicas or 1


def _device(args: argparse.Namespace, cluster: Any, task: Any) -> str | None:
    """``--replicas``: the CPU; ``--num-gpus``: GPU 0 alone, a ps worker's GPU (index mod the
    GPUs seen), an all-reduce replica's ``cuda:LOCAL_RANK`` (None); else ``--device``."""
    if args.replicas:
        return "cpu"
    if args.num_gpus:
        if cluster is None:
            return "/gpu:0"
        if "ps" in cluster:
            import torch

            count = torch.cuda.device_count()
            return f"cuda:{task.task_index % count}" if count else "cpu"
        return None
    return args.device


def _launch_local(args: argparse.Namespace, count: int) -> int:
    """Start this command again as the processes of a local cluster (``--ps``) or world."""
    from towerflow.cluster.launcher import launch_cluster, spawn_replicas

    if args.num_gpus:
        require_gpus(args.num_gpus, role="workers" if args.ps else "replicas")
    if not args.ps:
        return spawn_replicas(replica_argv(args), count)
    if args.model == "cifar10" and args.data == "real":
        from towerflow.training.tasks import get_task

        get_task(args.model).load("train", build_data_options(args))  # once, for every worker
    return launch_cluster(replica_argv(args), num_ps=args.ps, num_workers=count)


def run(args: argparse.Namespace) -> int:
    """Train: as this process's task of the environment's cluster (``TF_CONFIG``, torchrun,
    Slurm), else start the local processes asked for (``--ps``, ``--replicas``,
    ``--num-gpus``), else in this process alone."""
    from towerflow.cluster import resolve_cluster

    count = _local_count(args)
    cluster, task = resolve_cluster()
    if cluster is None and (args.ps or count > 1):
        return _launch_local(args, count)
    if cluster is None and args.num_gpus:
        require_gpus(args.num_gpus)
    from towerflow.training.ps_train import serve_task

    if cluster is not None and task not in cluster.replicas:
        return serve_task(cluster, task)
    from towerflow.strategies.choose import choose_strategy
    from towerflow.training.run import run_training

    options = {"mode": args.mode} if cluster is not None and "ps" in cluster else {}
    strategy = choose_strategy(device=_device(args, cluster, task), **options)
    try:
        run_training(args.model, build_config(args), data=build_data_options(args), lr=args.lr,
                     lr_decay_factor=args.lr_decay_factor,
                     epochs_per_decay=args.epochs_per_decay, strategy=strategy)
    finally:
        strategy.shutdown()
    return 0
