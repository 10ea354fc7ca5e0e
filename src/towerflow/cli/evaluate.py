"""``towerflow eval MODEL``: the latest checkpoint's precision @ 1 (or AUC and logloss).

::

    towerflow eval cifar10 --train-dir runs/c10                  # default device
    towerflow eval cifar10 --train-dir runs/c10 --device /cpu:0  # a GPU-trained model on a CPU

Prints ``precision @ 1 = 0.861`` (article 001's ``cifar10_eval.py``) of the
moving averages when the run kept them; for the click model, ``AUC =
0.7850`` on held-out click logs and the planted truth's AUC on the same
examples (a sparse table the ps tasks held is read from the checkpoint's
parts); for movielens and criteo, ``AUC = 0.781`` and ``logloss = 0.5312``
on the test split (the latest ratings or lines); for your own model
(``--model MODULE:FACTORY``), ``loss = 0.4123``, the mean loss of its data
factory's test split, with ``AUC`` and ``logloss`` for a binary cross entropy,
``accuracy`` for a cross entropy and the metrics the model factory names. Exits non-zero with a message naming the directory when it holds no
checkpoint.

The model and the test split come from the run's record: ``towerflow
train`` writes its settings to ``run.yaml`` in the train dir, among them the
model and the data options (``--data``, ``--data-dir``,
``--synthetic-examples``, ``--no-download``); an option given here overrides
the recorded one, and ``towerflow eval --train-dir runs/c10`` needs no model.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from towerflow.training.names import TASK_NAMES

__all__ = ["add_parser", "run"]

log = logging.getLogger("towerflow.training")

_AS_TRAINED = "default: as the run was trained (run.yaml in --train-dir), else "


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``towerflow eval``."""
    from towerflow.cli._train_options import model_name

    parser = subparsers.add_parser(
        "eval", help="evaluate the latest checkpoint on the test split",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", type=model_name, default=None,
                        help="which model: a built-in one or your own MODULE:FACTORY; default: "
                        "the one run.yaml in --train-dir names (with your own model's data "
                        "factory and loss)")
    parser.add_argument("--train-dir", "--train_dir", default=None, metavar="DIR",
                        help="where training wrote its checkpoints; default: /tmp/<model>_train")
    parser.add_argument("--device", default=None,
                        help="e.g. /cpu:0 or /gpu:0; default: the first GPU, else the CPU")
    parser.add_argument("--data-dir", "--data_dir", default=None, metavar="DIR",
                        help="the data set's files (CIFAR-10's, MovieLens', Criteo's); " + _AS_TRAINED
                        + "/tmp/cifar10_data")
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


def _data_options(args: argparse.Namespace, saved: dict[str, Any] | None) -> Any:
    """The recorded data options of the run, with the options given here on top."""
    import dataclasses

    from towerflow.training.evaluate import data_options_from
    from towerflow.training.tasks import DataOptions

    given: dict[str, Any] = {}
    if args.data is not None:
        given["synthetic"] = args.data == "synthetic"
    if args.data_dir is not None:
        given["data_dir"] = args.data_dir
    if args.synthetic_examples is not None:
        given["synthetic_examples"] = args.synthetic_examples
    if args.no_download:
        given["download"] = False
    base = data_options_from(saved) if saved is not None else DataOptions()
    return dataclasses.replace(base, **given)


def _model(args: argparse.Namespace, train_dir: str | None,
           saved: dict[str, Any] | None) -> str:
    """The model named here, which must be the one the run trained, else the recorded one."""
    from towerflow.errors import InvalidArgumentError

    recorded = (saved or {}).get("model")
    if args.model is not None and recorded is not None and args.model != recorded:
        raise InvalidArgumentError(
            f"{train_dir!r} holds a run of model {recorded}, not {args.model}; run `towerflow "
            f"eval {recorded} --train-dir {train_dir}`, or pass the --train-dir of a "
            f"{args.model} run.")
    if args.model is None and recorded is None:
        where = f" ({train_dir!r} has none)" if train_dir else ""
        raise InvalidArgumentError(
            f"towerflow eval needs a model: name it ({', '.join(TASK_NAMES[:-1])} or {TASK_NAMES[-1]}), "
            "or pass the "
            f"--train-dir of a run whose run.yaml names it{where}.")
    return args.model or recorded


def run(args: argparse.Namespace) -> int:
    """Evaluate and print the precision; a missing checkpoint is a NotFoundError."""
    from towerflow.training.evaluate import evaluate_checkpoint
    from towerflow.training.runconfig import RUN_FILE, load_run_settings
    from towerflow.training.tasks import default_train_dir

    train_dir = args.train_dir or (args.model and default_train_dir(args.model))
    saved = load_run_settings(train_dir) if train_dir else None
    if saved is not None:
        log.info("model and test data as trained: %s/%s", train_dir, RUN_FILE)
    model = _model(args, train_dir, saved)
    train_dir = train_dir or default_train_dir(model)
    result = evaluate_checkpoint(model, train_dir, device=args.device,
                                 data=_data_options(args, saved), batch_size=args.batch_size)
    weights = "moving averages" if result.averaged else "parameters"
    print(f"step {result.step}: {weights} of {result.path} on {result.num_examples} "
          "test examples")
    if result.reference is None:
        print(f"{result.metric} = {result.precision:.3f}", flush=True)
    else:  # a planted truth: four digits, the gap to it
        print(f"{result.metric} = {result.precision:.4f} (the truth's {result.reference:.4f} on "
              f"the same examples, gap {result.reference - result.precision:.4f})", flush=True)
    for name, value in result.others.items():
        print(f"{name} = {value:.4f}", flush=True)
    return 0
