"""``towerflow eval cifar10|digits``: precision @ 1 of the latest checkpoint's moving averages.

::

    towerflow eval cifar10 --train-dir runs/c10                  # default device
    towerflow eval cifar10 --train-dir runs/c10 --device /cpu:0  # a GPU-trained model on a CPU

Prints ``precision @ 1 = 0.861`` (article 001's ``cifar10_eval.py``); exits
non-zero with a message naming the directory when it holds no checkpoint.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``towerflow eval``."""
    parser = subparsers.add_parser(
        "eval", help="evaluate the latest checkpoint on the test split",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=("cifar10", "digits"))
    parser.add_argument("--train-dir", default=None,
                        help="where training wrote its checkpoints (default /tmp/<model>_train)")
    parser.add_argument("--device", default=None, help="e.g. /cpu:0 or /gpu:0")
    parser.add_argument("--data-dir", default="/tmp/cifar10_data")
    parser.add_argument("--data", choices=("real", "synthetic"), default="real")
    parser.add_argument("--synthetic-examples", type=int, default=10000)
    parser.add_argument("--no-download", action="store_true")
    parser.add_argument("--batch-size", type=int, default=128)
    return parser


def run(args: argparse.Namespace) -> int:
    """Evaluate and print the precision; a missing checkpoint is a NotFoundError."""
    from towerflow.training.evaluate import evaluate_checkpoint
    from towerflow.training.tasks import DataOptions

    data = DataOptions(data_dir=args.data_dir, synthetic=args.data == "synthetic",
                       synthetic_examples=args.synthetic_examples, download=not args.no_download)
    result = evaluate_checkpoint(args.model, args.train_dir or f"/tmp/{args.model}_train",
                                 device=args.device, data=data, batch_size=args.batch_size)
    weights = "moving averages" if result.averaged else "parameters"
    print(f"step {result.step}: {weights} of {result.path} on {result.num_examples} "
          "test examples")
    print(f"precision @ 1 = {result.precision:.3f}", flush=True)
    return 0
