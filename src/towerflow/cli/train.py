"""``towerflow train cifar10|digits|click``: article 001's cifar10_multi_gpu_train.py as one command.

One process::

    towerflow train cifar10 --train-dir runs/c10 --max-steps 100000 --batch-size 128

N replicas on one machine (synchronous, all-reduce; each replica a process)::

    towerflow train cifar10 --num-gpus 2 --train-dir runs/c10     # one per GPU, NCCL
    towerflow train digits --replicas 2 --train-dir runs/digits   # CPU processes, Gloo

N machines: the same command under torchrun's environment (``torchrun
--nnodes 2 --nproc-per-node 4 -m towerflow train cifar10 ...``) or a
``TF_CONFIG`` without a ps job. With ``--ps K`` (or a ``TF_CONFIG`` naming a
``ps`` job) the parameter-server strategy trains instead.

``click`` is a click-through model on synthetic click logs with a planted
truth (a ``--table-rows`` x ``--embedding-dim`` embedding bag of
``--ids-per-example`` Zipf ids per example, a linear and an MLP head; Adagrad,
batches of 512 unless given); ``towerflow eval`` prints its AUC and the
truth's. With ``--sparse-threshold`` at most the table's bytes, the ps tasks
hold the table row-sharded and a worker pulls and pushes only a batch's rows::

    towerflow train click --ps 2 --workers 2 --sparse-threshold 64MiB --train-dir runs/click

Settings from a file: ``--config run.yaml`` (or ``.json``) names any of the
options below by its name (``batch_size: 64`` or ``batch-size: 64``); flags
given on the command line win over it. When training starts, the chief
writes the run's resolved settings to ``run.yaml`` in ``--train-dir``, itself
a valid ``--config`` file; ``towerflow eval`` takes its model and data from it.

Running the same command again (or ``towerflow train --train-dir DIR``)
resumes from the latest checkpoint in ``--train-dir`` with the settings
recorded there. A setting that cannot change when a run resumes (the model,
the batch size, the update mode, the optimizer, ...) stops the command when
given with another value; the settings listed below may change.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import textwrap
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from towerflow.cli._argv import argv_from_namespace
from towerflow.cli._serving import (
    BIND_ENV,
    add_lifecycle_arguments,
    bind_host,
    idle_timeout_from_args,
)

if TYPE_CHECKING:  # torch stays out of the command line's start-up
    from towerflow.strategies.base import OptimizerConfig, Strategy
    from towerflow.training.config import TrainConfig
    from towerflow.training.tasks import DataOptions

__all__ = ["add_parser", "add_train_arguments", "bind_host", "build_config", "build_data_options",
           "build_optimizer", "build_strategy", "byte_count", "replica_argv", "require_gpus",
           "resolve_args", "strategy_options", "run"]

log = logging.getLogger("towerflow.training")

_MODELS = ("cifar10", "digits", "click")  # towerflow.training.tasks.TASKS
_MODES = ("async", "sync", "ssp")  # towerflow.ps.server.dense.aggregation.MODES
_PS_STRATEGIES = ("round_robin", "greedy")  # towerflow.ps.placement.STRATEGY_NAMES
_OPTIMIZERS = ("sgd", "momentum", "adam", "adagrad")  # towerflow.strategies.base

#: option dest -> (the strategy that takes it, its keyword there)
_STRATEGY_OPTIONS: dict[str, tuple[str, str]] = {
    "mode": ("ps", "mode"), "staleness": ("ps", "staleness"),
    "replicas_to_aggregate": ("ps", "replicas_to_aggregate"),
    "ps_strategy": ("ps", "ps_strategy"), "partition_threshold": ("ps", "partition_threshold_bytes"),
    "ps_timeout": ("ps", "timeout"), "step_timeout": ("ps", "step_timeout"),
    "init_timeout": ("ps", "init_timeout"), "on_bad_gradient": ("ps", "on_bad_gradient"),
    "ps_prefetch": ("ps", "prefetch"), "bind": ("ps", "bind_host"),
    "sparse_threshold": ("ps", "sparse_threshold_bytes"),
    "table_part_bytes": ("ps", "table_part_bytes"),
    "join": ("ps", "join"), "max_elastic_workers": ("ps", "max_elastic_workers"),
    "backend": ("mirrored", "backend"), "collective_timeout": ("mirrored", "timeout_s"),
}
#: keywords of the strategies that no flag sets: the cluster decides them (the chief by the
#: cluster's rule, the credentials from its secret, each task runs its own server), and a
#: device setter is what --ps-strategy and --partition-threshold describe
FROM_THE_CLUSTER = {"ps": frozenset({"is_chief", "credentials", "server", "device_setter"}),
                    "mirrored": frozenset()}
#: options of the ps tasks' servers (when a ps task ends), not keywords of a strategy
_PS_TASK_OPTIONS = ("serve_forever", "idle_timeout")
#: ps options that only one update mode uses
_MODE_OPTIONS = {"staleness": "ssp", "replicas_to_aggregate": "sync", "join": "async",
                 "max_elastic_workers": "async"}
_KINDS = {"ps": "the parameter-server strategy (--ps K, or a cluster with a ps job)",
          "mirrored": "all-reduce replicas (--replicas N or --num-gpus N, or a cluster "
          "without a ps job)", "single": "one process"}


def add_train_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every option of ``towerflow train`` (shared with the parameter-server trainer).

    Article 001's flags also work as its program spells them (``--train_dir``,
    ``--max_steps``, ``--num_gpus``, ``--log_device_placement``,
    ``--batch_size``, ``--data_dir``).
    """
    parser.add_argument("model", nargs="?", choices=_MODELS, default=None,
                        help="which built-in model to train; default: the one --config or "
                        "the resumed run's run.yaml names")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="a YAML or JSON file of settings named as these options "
                        "(batch_size: 64); flags given here override it")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--num-gpus", "--num_gpus", type=int, default=None, metavar="N",
                       help="replicas on this machine, one per GPU (NCCL); default: one process")
    where.add_argument("--replicas", "--workers", type=int, default=None, metavar="N",
                       help="replicas (with --ps: workers) on this machine as CPU processes "
                       "(Gloo); default: one process")
    parser.add_argument("--device", default=None,
                        help="device of a single-process run, e.g. /cpu:0 or /gpu:1; "
                        "default: the first GPU, else the CPU")
    parser.add_argument("--train-dir", "--train_dir", default=None, metavar="DIR",
                        help="checkpoints, summaries and run.yaml; default: /tmp/<model>_train")
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
    parser.add_argument("--ema-decay", type=float, default=0.9999, metavar="D",
                        help="decay of the parameters' moving averages, which eval "
                        "scores (0: none)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the initialisation, the data order and the distortions")
    parser.add_argument("--no-progress", action="store_true",
                        help="never show a progress bar (shown when stderr is a terminal)")
    click = parser.add_argument_group(
        "click model (click; unless given, it trains with --optimizer adagrad "
        "--initial-accumulator-value 1e-4 --batch-size 512 --ema-decay 0)")
    click.add_argument("--table-rows", type=int, default=1_000_000, metavar="N",
                       help="rows of the embedding table (the hashed feature ids' range)")
    click.add_argument("--embedding-dim", type=int, default=32, metavar="N",
                       help="values per row of the embedding table")
    click.add_argument("--ids-per-example", type=int, default=16, metavar="N",
                       help="feature ids per example (Zipf(1.2) over the table's rows)")
    _add_optimizer_arguments(parser.add_argument_group(
        "optimizer (applied by the ps tasks with --ps, else by each replica)"))
    _add_ps_arguments(parser.add_argument_group(
        "parameter-server strategy (with --ps K, or a cluster with a ps job)"))
    mirrored = parser.add_argument_group(
        "all-reduce replicas (with --replicas / --num-gpus, or a cluster without a ps job)")
    mirrored.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                          help="collective backend; default: nccl on GPUs, gloo on CPUs")
    mirrored.add_argument("--collective-timeout", type=float, default=1800.0, metavar="SECONDS",
                          help="how long a collective waits for the other replicas")
    return parser


def _add_optimizer_arguments(group: Any) -> None:
    group.add_argument("--optimizer", choices=_OPTIMIZERS, default="sgd",
                       help="'momentum' is SGD with --momentum")
    group.add_argument("--lr", type=float, default=None,
                       help="initial learning rate; default: 0.1")
    group.add_argument("--lr-decay-factor", type=float, default=0.1, metavar="F",
                       help="the learning rate is multiplied by F every --epochs-per-decay")
    group.add_argument("--epochs-per-decay", type=float, default=None, metavar="E",
                       help="epochs between learning-rate decays; default: 350")
    group.add_argument("--momentum", type=float, default=0.0, metavar="M",
                       help="momentum of 'momentum' (and of 'sgd' when not 0)")
    group.add_argument("--weight-decay", type=float, default=0.0, metavar="W",
                       help="L2 penalty added to every gradient")
    group.add_argument("--adam-beta1", type=float, default=0.9, metavar="B",
                       help="Adam's first-moment decay")
    group.add_argument("--adam-beta2", type=float, default=0.999, metavar="B",
                       help="Adam's second-moment decay")
    group.add_argument("--eps", type=float, default=1e-8,
                       help="Adam's and Adagrad's epsilon")
    group.add_argument("--initial-accumulator-value", type=float, default=0.1, metavar="V",
                       help="Adagrad's initial accumulator")


def _add_ps_arguments(group: Any) -> None:
    group.add_argument("--ps", type=int, default=0, metavar="K",
                       help="train with K local parameter-server tasks instead of all-reduce")
    group.add_argument("--mode", choices=_MODES, default="async",
                       help="how the ps tasks apply the workers' gradients")
    group.add_argument("--staleness", type=int, default=2, metavar="N",
                       help="--mode ssp: pushes a worker may run ahead of the slowest")
    group.add_argument("--replicas-to-aggregate", type=int, default=None, metavar="N",
                       help="--mode sync: gradients averaged per step; the workers beyond N "
                       "are backups; default: every worker")
    group.add_argument("--ps-strategy", choices=_PS_STRATEGIES, default="round_robin",
                       help="how variables are spread over the ps tasks: in turn, or "
                       "'greedy' by bytes")
    group.add_argument("--partition-threshold", type=byte_count, default=None, metavar="BYTES",
                       help="split a variable larger than this across the ps tasks (e.g. "
                       "1048576 or 64MiB); default: never")
    group.add_argument("--sparse-threshold", type=byte_count, default=None, metavar="BYTES",
                       help="make every nn.Embedding / nn.EmbeddingBag of this many bytes or "
                       "more a sparse table sharded over the ps tasks (only a batch's rows "
                       "travel; e.g. 64MiB); default: never")
    group.add_argument("--table-part-bytes", type=byte_count, default=None, metavar="BYTES",
                       help="bytes of a sparse table's rows and slots per checkpoint file "
                       "(what saving or restoring a table holds at once); default: 64MiB")
    group.add_argument("--ps-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="deadline of each call to a ps task")
    group.add_argument("--step-timeout", "--aggregation-timeout", type=float, default=120.0,
                       metavar="SECONDS",
                       help="--mode sync / ssp: how long a push waits for the other workers")
    group.add_argument("--init-timeout", type=float, default=300.0, metavar="SECONDS",
                       help="how long a worker waits for the chief to initialise the ps tasks")
    group.add_argument("--on-bad-gradient", choices=("raise", "skip"), default="raise",
                       help="a NaN / inf gradient stops training, or is skipped with a warning")
    group.add_argument("--ps-prefetch", action="store_true",
                       help="push and pull in the background while the next batch is prepared "
                       "(the step log then lags by one push)")
    group.add_argument("--bind", default=None, metavar="HOST",
                       help="the interface this task's server listens on (0.0.0.0 or :: for "
                       "all) instead of the host its cluster names, e.g. in a pod whose Service "
                       f"name resolves only once it runs; default: ${BIND_ENV}, else that host")
    group.add_argument("--join", action="store_true",
                       help="join the running asynchronous ps job of TF_CONFIG (a cluster and "
                       "no task) as an elastic worker; it leaves when it ends")
    group.add_argument("--max-elastic-workers", type=int, default=16, metavar="N",
                       help="(the chief, async) elastic workers (--join) each ps task admits "
                       "at once; 0: none (default 16, towerflow.ps.protocol's)")
    add_lifecycle_arguments(group)


_BYTE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000 ** 2,
               "mb": 1000 ** 2, "mib": 1024 ** 2, "g": 1000 ** 3, "gb": 1000 ** 3,
               "gib": 1024 ** 3}


def byte_count(text: str) -> int:
    """A size in bytes: ``1048576``, ``64MiB``, ``1.5GB`` (an argparse type).

    Example:
        >>> byte_count("64MiB"), byte_count("2kb"), byte_count("100")
        (67108864, 2000, 100)
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match and _BYTE_UNITS.get(match.group(2).lower())
    if not match or unit is None:
        raise ValueError(f"{text!r} is not a size in bytes such as 1048576, 512KiB or 64MiB")
    value = float(match.group(1)) * unit
    if value < 1:
        raise ValueError(f"{text!r} is less than one byte")
    return int(value)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``towerflow train``."""
    from towerflow.training.runconfig import MAY_CHANGE, PER_RUN

    epilog = textwrap.fill(
        f"Settings a resumed run may change: {', '.join(sorted(MAY_CHANGE))}; and, never taken "
        f"from the record: {', '.join(sorted(PER_RUN))}.", width=78)
    parser = subparsers.add_parser(
        "train", help="train a built-in model (cifar10, digits, click)", description=__doc__,
        epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    return add_train_arguments(parser)


def build_config(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` the options describe."""
    from towerflow.training.config import TrainConfig

    return TrainConfig(
        train_dir=args.train_dir or f"/tmp/{args.model}_train", max_steps=args.max_steps,
        batch_size=args.batch_size, log_every=args.log_every, summary_every=args.summary_every,
        checkpoint_every=args.checkpoint_every, max_to_keep=args.max_to_keep,
        ema_decay=args.ema_decay if args.ema_decay else None, seed=args.seed,
        progress=False if args.no_progress else None,
        log_device_placement=args.log_device_placement)


def build_data_options(args: argparse.Namespace) -> DataOptions:
    """The :class:`DataOptions` the options describe."""
    from towerflow.training.tasks import DataOptions

    return DataOptions(data_dir=args.data_dir, synthetic=args.data == "synthetic",
                       synthetic_examples=args.synthetic_examples,
                       download=not args.no_download)


def build_optimizer(args: argparse.Namespace) -> OptimizerConfig:
    """The :class:`OptimizerConfig` the options describe (``lr`` None: the task's)."""
    from towerflow.strategies.base import OptimizerConfig
    from towerflow.training.tasks import get_task

    lr = args.lr if args.lr is not None else get_task(args.model).default_lr
    return OptimizerConfig(args.optimizer, lr=lr,
                           momentum=args.momentum, weight_decay=args.weight_decay,
                           betas=(args.adam_beta1, args.adam_beta2), eps=args.eps,
                           initial_accumulator_value=args.initial_accumulator_value)


@cache
def _defaults() -> dict[str, Any]:
    from towerflow.cli._config import option_actions

    parser = add_train_arguments(argparse.ArgumentParser(add_help=False))
    return {dest: action.default for dest, action in option_actions(parser).items()}


def _flag(dest: str) -> str:
    from towerflow.cli._config import flag_of, option_actions

    return flag_of(option_actions(add_train_arguments(argparse.ArgumentParser()))[dest])


def strategy_options(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    """The keyword options of the strategy ``kind`` (a registry name) that ``args`` give.

    A flag of another strategy, or of another ``--mode``, set to anything but
    its default is refused, never ignored.

    Raises:
        InvalidArgumentError: such a flag, given here or recorded by the run resumed.
    """
    from towerflow.errors import InvalidArgumentError
    from towerflow.training.runconfig import MAY_CHANGE, PER_RUN, RUN_FILE

    explicit = getattr(args, "_explicit", None)
    options: dict[str, Any] = {}
    owners = {**_STRATEGY_OPTIONS, **{dest: ("ps", None) for dest in _PS_TASK_OPTIONS}}
    for dest, (owner, keyword) in owners.items():
        value = getattr(args, dest)
        mode = _MODE_OPTIONS.get(dest) if owner == kind else None
        if owner == kind and (mode is None or mode == args.mode):
            if keyword is not None:
                options[keyword] = value
            continue
        if value == _defaults()[dest]:
            continue
        given = _flag(dest) if value is True else f"{_flag(dest)} {value}"
        if explicit is not None and dest not in explicit:  # taken from the resumed run
            if dest in MAY_CHANGE | PER_RUN:
                setattr(args, dest, _defaults()[dest])
                continue
            raise InvalidArgumentError(
                f"{args.train_dir!r} holds a run trained with {given} "
                f"({RUN_FILE}), which this run, with {_KINDS[kind]}, cannot keep; resume it "
                f"as it was trained ({_KINDS[owner]}), or start a new run with another "
                "--train-dir.")
        where = f"--mode {args.mode}" if mode else _KINDS[kind]
        need = f"--mode {mode}" if mode else _KINDS[owner]
        raise InvalidArgumentError(
            f"{given} does not apply: this run trains with {where}; remove it, "
            f"or train with {need}.")
    return options


def build_strategy(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Strategy:
    """The strategy of this process's task of the environment's cluster, with the options."""
    from towerflow.cluster import resolve_cluster
    from towerflow.strategies.choose import choose_kind, choose_strategy

    env = os.environ if env is None else env
    cluster, task = resolve_cluster(env=env)
    options = strategy_options(args, choose_kind(cluster, task))
    if "bind_host" in options:
        options["bind_host"] = bind_host(args, env)
    return choose_strategy(device=_device(args, cluster, task), env=env, **options)


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill ``args`` from its ``--config`` file and the record of the run it resumes.

    Flags given on the command line (``args._argv``, set by the ``towerflow``
    entry point) win over the file, the file over the record, the record
    over the defaults. ``args._explicit`` becomes the names the command line
    or the file set.

    Raises:
        InvalidArgumentError: an unknown setting or bad value in the file, no
            model named anywhere, or a resume that changes a setting it may not.
    """
    from towerflow.cli._config import (
        check_exclusive,
        convert_settings,
        given_dests,
        merge_layers,
        option_actions,
    )
    from towerflow.training.runconfig import normalize_settings, read_settings_file

    parser = add_train_arguments(argparse.ArgumentParser(add_help=False))
    actions = option_actions(parser, skip=frozenset({"config"}))
    argv = getattr(args, "_argv", None)
    given = (given_dests(parser, argv) if argv is not None
             else {d for d, a in actions.items() if getattr(args, d) != a.default})
    explicit = {d: getattr(args, d) for d in given if d in actions}
    if args.config:
        source = f"--config {args.config}"
        from_file = convert_settings(parser, normalize_settings(
            read_settings_file(args.config), actions, source), source)
        check_exclusive(parser, from_file, source)
        explicit = merge_layers(parser, from_file, explicit)
    for dest, value in explicit.items():
        setattr(args, dest, value)
    args.config = None  # its settings are in args now: a replica gets them as flags
    _resume(args, parser, explicit)
    args._explicit = frozenset(explicit)
    return args


def _resume(args: argparse.Namespace, parser: argparse.ArgumentParser,
            explicit: Mapping[str, Any]) -> None:
    """Check the settings against the record of the run resumed, and take the rest from it."""
    from towerflow.cli._config import convert_settings, flag_of, merge_layers, option_actions
    from towerflow.errors import InvalidArgumentError
    from towerflow.training.runconfig import (
        PER_RUN,
        RUN_FILE,
        conflict_message,
        holds_checkpoint,
        load_run_settings,
        normalize_settings,
        resume_conflicts,
    )

    if args.train_dir is None and args.model is not None:
        args.train_dir = f"/tmp/{args.model}_train"
    saved = None
    if args.train_dir is not None and holds_checkpoint(args.train_dir):
        saved = load_run_settings(args.train_dir)
    if saved is not None:
        actions = option_actions(parser, skip=frozenset({"config"}))
        source = str(Path(args.train_dir) / RUN_FILE)
        saved = convert_settings(parser, normalize_settings(saved, actions, source), source)
        conflicts = resume_conflicts(saved, explicit)
        if conflicts:
            flags = {dest: flag_of(action) for dest, action in actions.items()}
            raise InvalidArgumentError(conflict_message(args.train_dir, conflicts, flags))
        kept = merge_layers(parser, {d: v for d, v in saved.items() if d not in PER_RUN},
                            explicit)
        reused = sorted(d for d in kept if d not in explicit)
        for dest in reused:
            setattr(args, dest, saved[dest])
        unusual = [f"{d}={saved[d]}" for d in reused if saved[d] != _defaults().get(d)]
        log.info("resuming %s with its recorded settings%s", args.train_dir,
                 f" ({', '.join(unusual)})" if unusual else "")
    if args.model is None:
        raise InvalidArgumentError(
            "towerflow train needs a model: name it (cifar10, digits or click), give a --config file "
            "that names it, or a --train-dir whose run.yaml does.")
    if args.train_dir is None:
        args.train_dir = f"/tmp/{args.model}_train"
    _task_options(args, explicit, saved)


def _task_options(args: argparse.Namespace, explicit: Mapping[str, Any],
                  saved: Mapping[str, Any] | None) -> None:
    """Give the model's own defaults to options neither given nor recorded; refuse the
    options of another model (``--table-rows`` for digits).

    Raises:
        InvalidArgumentError: an option of another model set to anything but its default.
    """
    from towerflow.errors import InvalidArgumentError
    from towerflow.training.tasks import TASKS

    task = TASKS[args.model]
    for dest, value in task.option_defaults.items():
        if dest not in explicit and (saved is None or dest not in saved):
            setattr(args, dest, value)
    for name, other in TASKS.items():
        for dest, default in other.options.items():
            value = getattr(args, dest)
            if dest not in task.options and value != default:
                raise InvalidArgumentError(
                    f"{_flag(dest)} {value} applies to the {name} model only, not "
                    f"{args.model}; remove it, or train {name}.")


def _record(args: argparse.Namespace) -> dict[str, Any]:
    """The settings of this run, for its ``run.yaml``."""
    return {dest: getattr(args, dest) for dest in _defaults() if dest != "config"}


def replica_argv(args: argparse.Namespace) -> list[str]:
    """The command each spawned replica or task runs: ``towerflow train``, every flag kept.

    Every setting is written out, defaults included, so that a replica trains
    with exactly the settings this process resolved.
    """
    parser = add_train_arguments(argparse.ArgumentParser(add_help=False))
    verbose = ["--verbose"] if getattr(args, "verbose", False) else []
    return [sys.executable, "-m", "towerflow", *verbose, "train",
            *argv_from_namespace(parser, args, defaults=True)]


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

    strategy_options(args, "ps" if args.ps else "mirrored")  # refuse before anything starts
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

    resolve_args(args)
    count = _local_count(args)
    if args.join:
        return _train(args, _joining_strategy(args))
    cluster, task = resolve_cluster()
    if cluster is None and (args.ps or count > 1):
        return _launch_local(args, count)
    if cluster is None and args.num_gpus:
        require_gpus(args.num_gpus)
    from towerflow.training.ps_train import serve_task

    if cluster is not None and task not in cluster.replicas:
        return serve_task(cluster, task, bind_host=bind_host(args),
                          serve_forever=args.serve_forever,
                          idle_timeout=idle_timeout_from_args(args))
    return _train(args, build_strategy(args))


def _joining_strategy(args: argparse.Namespace) -> Strategy:
    """``--join``: an elastic worker of the running ps job (``ParameterServer(join=True)``)."""
    from towerflow.errors import InvalidArgumentError
    from towerflow.strategies.parameter_server import ParameterServer

    options = strategy_options(args, "ps")  # join=True among them
    if options.pop("bind_host", None) is not None:
        raise InvalidArgumentError(f"--bind {args.bind} does not apply to --join: an elastic "
                                   "worker serves nothing; remove it.")
    return ParameterServer(device=args.device, **options)


def _train(args: argparse.Namespace, strategy: Strategy) -> int:
    from towerflow.training.run import run_training
    from towerflow.training.tasks import get_task

    try:
        task = get_task(args.model, vars(args))
        run_training(task, build_config(args), data=build_data_options(args), lr=args.lr,
                     lr_decay_factor=args.lr_decay_factor,
                     epochs_per_decay=args.epochs_per_decay, strategy=strategy,
                     optimizer=build_optimizer(args), settings=_record(args))
    finally:
        strategy.shutdown()
    return 0
