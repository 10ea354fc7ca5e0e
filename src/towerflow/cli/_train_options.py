"""The options of ``towerflow train`` and the strategy each one reaches.

:func:`add_train_arguments` declares every flag (``towerflow train --help``
lists them); :func:`strategy_options` hands a strategy the keywords its flags
set, and refuses a flag of another strategy (or of another ``--mode``) that is
set to anything but its default.

Example:
    >>> byte_count("64MiB"), flag_of_dest("ps_strategy")
    (67108864, '--ps-strategy')
"""

from __future__ import annotations

import argparse
import re
from functools import cache
from typing import Any

from towerflow.cli._serving import BIND_ENV, add_lifecycle_arguments
from towerflow.ps.placement import DEFAULT_PS_STRATEGY, STRATEGY_NAMES
from towerflow.ps.spec.dense import OPTIMIZER_NAMES
from towerflow.ps.wire.calls import MODES
from towerflow.training.names import LOSS_NAMES, TASK_NAMES

__all__ = ["FROM_THE_CLUSTER", "add_train_arguments", "byte_count", "byte_count_or_off",
           "data_source", "flag_of_dest", "model_name",
           "option_defaults", "strategy_options"]


#: option dest -> (the strategy that takes it, its keyword there)
_STRATEGY_OPTIONS: dict[str, tuple[str, str]] = {
    "mode": ("ps", "mode"), "staleness": ("ps", "staleness"),
    "replicas_to_aggregate": ("ps", "replicas_to_aggregate"),
    "ps_strategy": ("ps", "ps_strategy"), "partition_threshold": ("ps", "partition_threshold_bytes"),
    "ps_timeout": ("ps", "timeout"), "step_timeout": ("ps", "step_timeout"),
    "init_timeout": ("ps", "init_timeout"), "on_bad_gradient": ("ps", "on_bad_gradient"),
    "ps_prefetch": ("ps", "prefetch"), "dense_with_rows": ("ps", "dense_with_rows"),
    "bind": ("ps", "bind_host"),
    "sparse_threshold": ("ps", "sparse_threshold_bytes"),
    "whole_tables": ("ps", "whole_table_bytes"),
    "table_part_bytes": ("ps", "table_part_bytes"),
    "join": ("ps", "join"), "max_elastic_workers": ("ps", "max_elastic_workers"),
    "ps_replicas": ("ps", "replicas"),
    "dense": ("ps", "dense"), "embedding_staleness": ("ps", "embedding_staleness"),
    "backend": ("mirrored", "backend"), "collective_timeout": ("mirrored", "timeout_s"),
}
#: keywords of the strategies that no flag sets: the cluster decides them (the chief by the
#: cluster's rule, the credentials from its secret, each task runs its own server), and a
#: device setter is what --ps-strategy and --partition-threshold describe; hybrid training's
#: collective backend follows the worker's device (NCCL on a GPU, Gloo on a CPU: --device)
FROM_THE_CLUSTER = {"ps": frozenset({"is_chief", "credentials", "server", "device_setter",
                                     "backend"}),
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
    parser.add_argument("model", nargs="?", type=model_name, default=None,
                        help=f"which model to train: a built-in one ({', '.join(TASK_NAMES)}) or "
                        "your own as MODULE:FACTORY (as --model); default: the one --config or "
                        "the resumed run's run.yaml names")
    parser.add_argument("--model", dest="model_spec", type=model_name, default=None,
                        metavar="MODULE:FACTORY",
                        help="your own model: a function of an importable module (the current "
                        "directory is) that returns an nn.Module, or {'model': ..., 'loss_fn': "
                        "..., 'optimizer': ...}; with --data MODULE:FACTORY "
                        "(docs/recommendation.md)")
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
                        help="the data set's files: CIFAR-10's binary files or MovieLens' "
                        "(downloaded there when absent), Criteo's train.txt[.gz]")
    parser.add_argument("--data", type=data_source, default="real",
                        metavar="real|synthetic|MODULE:FACTORY",
                        help="'synthetic': random CIFAR-10-shaped images, for speed runs "
                        "or with no network; MODULE:FACTORY: your own model's data, a function "
                        "of (split, batch_size, rank, world_size, seed, epoch, data_dir, skip: "
                        "those it names) returning an iterable of (inputs, targets) batches")
    parser.add_argument("--loss", choices=LOSS_NAMES, default=None,
                        help="the loss of your own model (--model MODULE:FACTORY); default: "
                        "the loss_fn its factory returns")
    parser.add_argument("--synthetic-examples", type=int, default=10000, metavar="N",
                        help="examples in the synthetic data set (with --data synthetic)")
    parser.add_argument("--no-download", action="store_true",
                        help="fail instead of downloading missing CIFAR-10 or MovieLens files")
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
    parser.add_argument("--stop-deadline", type=float, default=30.0, metavar="S",
                        help="on SIGTERM / SIGINT the step in flight finishes and the chief "
                        "writes a final checkpoint; S seconds after the signal (or at a second "
                        "one) it is abandoned, leaving no partial checkpoint (0: no deadline)")
    parser.add_argument("--max-to-keep", type=int, default=5, metavar="N",
                        help="how many recent checkpoints to keep")
    parser.add_argument("--export-dir", default=None, metavar="DIR",
                        help="write serving exports here while training runs: a full one, "
                        "then deltas (docs/serving.md)")
    parser.add_argument("--export-every-secs", type=float, default=600.0, metavar="SECONDS",
                        help="seconds between two serving exports (with --export-dir)")
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
    recsys = parser.add_argument_group(
        "recommendation models (movielens, criteo: DeepFM; unless given, they train with "
        "--optimizer adagrad --initial-accumulator-value 1e-4 --batch-size 256 (criteo 1024) "
        "--ema-decay 0 --embedding-dim 16, their data in --data-dir /tmp/movielens_data or "
        "/tmp/criteo_data)")
    recsys.add_argument("--movielens-variant", choices=("ml-100k", "ml-1m", "ml-20m", "ml-25m"),
                        default="ml-100k",
                        help="which GroupLens release, in its folder of --data-dir (ml-100k/)")
    recsys.add_argument("--criteo-buckets", type=int, default=100_000, metavar="N",
                        help="rows per categorical field: each hashed value's id is 1 + value "
                        "mod N (0: empty)")
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
    group.add_argument("--optimizer", choices=OPTIMIZER_NAMES, default="sgd",
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
    group.add_argument("--mode", choices=MODES, default="async",
                       help="how the ps tasks apply the workers' gradients")
    group.add_argument("--staleness", type=int, default=2, metavar="N",
                       help="--mode ssp: pushes a worker may run ahead of the slowest")
    group.add_argument("--replicas-to-aggregate", type=int, default=None, metavar="N",
                       help="--mode sync: gradients averaged per step; the workers beyond N "
                       "are backups; default: every worker")
    group.add_argument("--ps-strategy", choices=STRATEGY_NAMES, default=DEFAULT_PS_STRATEGY,
                       help="how variables are spread over the ps tasks: 'greedy' (default) "
                       "puts each on the task holding the fewest bytes so far; 'round_robin' "
                       "puts them on the tasks in turn")
    group.add_argument("--partition-threshold", type=byte_count, default=None, metavar="BYTES",
                       help="split a variable larger than this across the ps tasks (e.g. "
                       "1048576 or 64MiB); default: never")
    group.add_argument("--sparse-threshold", type=byte_count_or_off, default=None,
                       metavar="BYTES|off",
                       help="make every nn.Embedding / nn.EmbeddingBag declared sparse=True or "
                       "of this many bytes or more a sparse table sharded over the ps tasks "
                       "(only a batch's rows travel; e.g. 16MiB); 'off': none; default: 64MiB")
    group.add_argument("--whole-tables", type=byte_count_or_off, default=None,
                       metavar="BYTES|off",
                       help="a sparse=True embedding smaller than this travels whole with the "
                       "dense variables when its optimizer updates it alike (sgd, adagrad), "
                       "faster than as rows; 'off': every one as rows; default: 256KiB")
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
    group.add_argument("--dense-apart", dest="dense_with_rows", action="store_false",
                       help="async: push the dense layers in their own request each step "
                       "(default: dense_with_rows=True, with the next step's table pull: one "
                       "request per ps task and step)")
    group.add_argument("--dense", choices=("ps", "allreduce"), default="ps",
                       help="where the dense layers train: 'ps' (default) on the ps tasks with "
                       "the tables; 'allreduce' (hybrid): replicated on the workers and "
                       "averaged each step by all-reduce (Gloo / NCCL), the tables on the ps")
    group.add_argument("--embedding-staleness", type=int, default=None, metavar="N",
                       help="--dense allreduce: how many of a worker's own steps its pulled "
                       "rows may lag its pushes (default 0: each push goes with the next pull)")
    group.add_argument("--bind", default=None, metavar="HOST",
                       help="the interface this task's server listens on (0.0.0.0 or :: for "
                       "all) instead of the host its cluster names, e.g. in a pod whose Service "
                       f"name resolves only once it runs; default: ${BIND_ENV}, else that host")
    group.add_argument("--join", action="store_true",
                       help="join the running asynchronous ps job of TF_CONFIG (a cluster and "
                       "no task) as an elastic worker; it leaves when it ends")
    group.add_argument("--max-elastic-workers", type=int, default=16, metavar="N",
                       help="(the chief, async) elastic workers (--join) each ps task admits "
                       "at once; 0: none (default 16, towerflow.ps.wire.calls')")
    group.add_argument("--ps-replicas", type=int, default=0, metavar="N",
                       help="(the chief) live copies of each dense ps shard on other ps "
                       "tasks: 0 (default) none; 1: shard i's on ps task i+1, and a push (in "
                       "sync mode, its step) is acknowledged once the copy has it (fewer than "
                       "the ps tasks; async, sync or ssp; fixed and dynamic tables too)")
    add_lifecycle_arguments(group)


def model_name(text: str) -> str:
    """A built-in model's name or ``MODULE:FACTORY`` (an argparse type).

    Example:
        >>> model_name("digits"), model_name("mymodels:build")
        ('digits', 'mymodels:build')
    """
    if text in TASK_NAMES or (":" in text and text.partition(":")[0] and text.partition(":")[2]):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither a built-in model ({', '.join(TASK_NAMES)}) nor "
                     "MODULE:FACTORY such as mymodels:build")


def data_source(text: str) -> str:
    """``real``, ``synthetic`` or ``MODULE:FACTORY`` (an argparse type).

    Example:
        >>> data_source("synthetic"), data_source("mydata:batches")
        ('synthetic', 'mydata:batches')
    """
    if text in ("real", "synthetic") or (":" in text and text.partition(":")[0]
                                         and text.partition(":")[2]):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither real, synthetic nor MODULE:FACTORY such as "
                     "mydata:batches")


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


def byte_count_or_off(text: str) -> int | str:
    """:func:`byte_count`, or ``"off"`` (an argparse type).

    Example:
        >>> byte_count_or_off("OFF"), byte_count_or_off("1KiB")
        ('off', 1024)
    """
    if text.strip().lower() == "off":
        return "off"
    try:
        return byte_count(text)
    except ValueError:
        raise ValueError(f"{text!r} is neither a size in bytes such as 64MiB nor 'off'") from None


def _keyword_value(dest: str, value: Any) -> tuple[bool, Any]:
    """Whether the strategy takes ``dest``'s keyword, and its value there.

    ``--sparse-threshold`` / ``--whole-tables`` not given: the strategy's default; ``off``:
    None (none).
    """
    if dest in ("sparse_threshold", "whole_tables"):
        return value is not None, None if value == "off" else value
    return True, value


@cache
def option_defaults() -> dict[str, Any]:
    """Every option's default, by its dest."""
    from towerflow.cli._config import option_actions

    parser = add_train_arguments(argparse.ArgumentParser(add_help=False))
    return {dest: action.default for dest, action in option_actions(parser).items()}


def flag_of_dest(dest: str) -> str:
    """The flag of the option ``dest`` as ``towerflow train`` spells it (``--ps-strategy``)."""
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
            takes, value = _keyword_value(dest, value)
            if keyword is not None and takes:
                options[keyword] = value
            continue
        if value == option_defaults()[dest]:
            continue
        given = flag_of_dest(dest) if value is True else f"{flag_of_dest(dest)} {value}"
        if explicit is not None and dest not in explicit:  # taken from the resumed run
            if dest in MAY_CHANGE | PER_RUN:
                setattr(args, dest, option_defaults()[dest])
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
    if kind == "ps":  # what hybrid training cannot do, before anything starts
        from towerflow.strategies.ps_placement import check_dense_mode

        check_dense_mode(options.get("dense", "ps"), options.get("embedding_staleness"), None,
                         mode=options.get("mode", "async"), join=bool(options.get("join")),
                         prefetch=bool(options.get("prefetch")))
    return options
