"""The options of ``towerflow train`` as training objects, and the command that repeats them.

Both the all-reduce trainer and the parameter-server trainer turn the parsed
options (an ``argparse.Namespace``) into a :class:`TrainConfig` and
:class:`DataOptions`, and rebuild the command line that each spawned replica
or task runs again.

Example:
    >>> import argparse
    >>> args = argparse.Namespace(model="digits", max_steps=5, data="real")
    >>> replica_argv(args)[3:]
    ['train', 'digits', '--max-steps', '5', '--data', 'real']
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from towerflow.training.config import TrainConfig

if TYPE_CHECKING:  # tasks imports torch; this module stays cheap for the command line
    from towerflow.training.tasks import DataOptions

__all__ = ["build_config", "build_data_options", "replica_argv", "require_gpus"]

# (flag, dest) of the options that replicas receive again when the command spawns them
_VALUE_FLAGS = (
    ("--train-dir", "train_dir"), ("--max-steps", "max_steps"), ("--batch-size", "batch_size"),
    ("--data-dir", "data_dir"), ("--data", "data"), ("--synthetic-examples", "synthetic_examples"),
    ("--log-every", "log_every"), ("--summary-every", "summary_every"),
    ("--checkpoint-every", "checkpoint_every"), ("--max-to-keep", "max_to_keep"),
    ("--lr", "lr"), ("--lr-decay-factor", "lr_decay_factor"),
    ("--epochs-per-decay", "epochs_per_decay"), ("--ema-decay", "ema_decay"), ("--seed", "seed"),
    ("--num-gpus", "num_gpus"), ("--replicas", "replicas"),
)
_BOOL_FLAGS = (("--log-device-placement", "log_device_placement"),
               ("--no-download", "no_download"), ("--no-progress", "no_progress"))


def replica_argv(args: argparse.Namespace) -> list[str]:
    """The command each spawned replica runs: ``towerflow train``, rebuilt from ``args``."""
    argv = [sys.executable, "-m", "towerflow"]
    if getattr(args, "verbose", False):
        argv.append("--verbose")
    argv += ["train", args.model]
    for flag, dest in _VALUE_FLAGS:
        value = getattr(args, dest, None)
        if value is not None:
            argv += [flag, str(value)]
    argv += [flag for flag, dest in _BOOL_FLAGS if getattr(args, dest, False)]
    return argv


def build_config(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` the options describe."""
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
