"""``towerflow eval cifar10|digits``: precision @ 1 of the latest checkpoint's moving averages.

::

    towerflow eval cifar10 --train-dir runs/c10                  # default device
    towerflow eval cifar10 --train-dir runs/c10 --device /cpu:0  # a GPU-trained model on a CPU

Prints ``precision @ 1 = 0.861`` (article 001's ``cifar10_eval.py``); exits
non-zero with a message naming the directory when it holds no checkpoint.

The test split comes from the data the run was trained with: ``towerflow
train`` records its data options (``--data``, ``--data-dir``,
``--synthetic-examples``, ``--no-download``) in ``data.json`` in the train
dir. An option given here overrides the recorded one.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

__all__ = ["add_parser", "run"]

log = logging.getLogger("towerflow.training")

_AS_TRAINED = "default: as the run was trained (data.json in --train-dir), else "


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``towerflow eval``."""
    parser = subparsers.add_parser(
        "eval", help="evaluate the latest checkpoint on the test split",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=("cifar10", "digits"), help="which built-in model")
    parser.add_argument("--train-dir", "--train_dir", default=None, metavar="DIR",
                        help="where training wrote its checkpoints; default: /tmp/<model>_train")
    parser.add_argument("--device", default=None,
                        help="e.g. /cpu:0 or /gpu:0; default: the first GPU, else the CPU")
    parser.add_argument("--data-dir", "--data_dir", default=None, metavar="DIR",
                        help="CIFAR-10 binary files; " + _AS_TRAINED + "/tmp/cifar10_data")
    parser.add_argument("--data", choices=("real", "synthetic"), default=None,
                        help="'synthetic': random CIFAR-10-shaped images; " + _AS_TRAINED + "real")
    parser.add_argument("--synthetic-examples", type=int, default=None, metavar="N",
                        help="examples in the synthetic test split; " + _AS_TRAINED + "10000")
    parser.add_argument("--no-download", action="store_true", default=None,
                        help="fail instead of downloading missing CIFAR-10 files; "
                        + _AS_TRAINED + "download")
    parser.add_argument("--batch-size", "--batch_size", type=int, default=128, metavar="N",
                        help="test examples per forward pass")
    return parser


def _data_options(args: argparse.Namespace, train_dir: str) -> Any:
    """The recorded data options of the run, with the options given here on top."""
    import dataclasses

    from towerflow.training.evaluate import DATA_FILE, load_data_options
    from towerflow.training.tasks import DataOptions

    saved = load_data_options(train_dir)
    if saved is not None:
        log.info("test data as trained: %s/%s", train_dir, DATA_FILE)
    given: dict[str, Any] = {}
    if args.data is not None:
        given["synthetic"] = args.data == "synthetic"
    if args.data_dir is not None:
        given["data_dir"] = args.data_dir
    if args.synthetic_examples is not None:
        given["synthetic_examples"] = args.synthetic_examples
    if args.no_download:
        given["download"] = False
    return dataclasses.replace(saved or DataOptions(), **given)


def run(args: argparse.Namespace) -> int:
    """Evaluate and print the precision; a missing checkpoint is a NotFoundError."""
    from towerflow.training.evaluate import evaluate_checkpoint

    train_dir = args.train_dir or f"/tmp/{args.model}_train"
    result = evaluate_checkpoint(args.model, train_dir, device=args.device,
                                 data=_data_options(args, train_dir), batch_size=args.batch_size)
    weights = "moving averages" if result.averaged else "parameters"
    print(f"step {result.step}: {weights} of {result.path} on {result.num_examples} "
          "test examples")
    print(f"precision @ 1 = {result.precision:.3f}", flush=True)
    return 0
