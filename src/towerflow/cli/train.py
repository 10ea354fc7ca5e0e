"""``towerflow train cifar10|digits|click|movielens|criteo|--model MODULE:FACTORY``: article 001's cifar10_multi_gpu_train.py as one command.

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
truth's. Under ``--ps`` its table (``sparse=True``, as a model's embedding of
64 MiB and more, or of ``--sparse-threshold`` bytes) is held by the ps tasks
row-sharded and a worker pulls and pushes only a batch's rows
(``--sparse-threshold off``: none is)::

    towerflow train click --ps 2 --workers 2 --train-dir runs/click

``movielens`` and ``criteo`` train DeepFM (an ``nn.Embedding`` per field, FM
+ MLP) on the publishers' files in ``--data-dir``: MovieLens
(``--movielens-variant ml-100k``, downloaded from GroupLens when absent)
rated 4+ or not, Criteo's display-advertising TSV (``train.txt`` or
``train.txt.gz``); ``towerflow eval`` prints AUC and logloss on the test
split, the latest ratings or lines::

    towerflow train movielens --data-dir data --train-dir runs/ml --max-steps 2000
    towerflow train movielens --ps 2 --workers 2 --data-dir data --train-dir runs/ml-ps

Your own model and data: ``--model MODULE:FACTORY`` (a function returning an
``nn.Module``, or ``{'model': ..., 'loss_fn': ..., 'optimizer': ...}``) and
``--data MODULE:FACTORY`` (a function of the ``split``, ``batch_size``,
``rank``, ``world_size``, ``seed``, ``epoch``, ``data_dir`` it names,
returning an iterable of ``(inputs, targets)`` batches), the loss from the
factory or ``--loss``; every option below serves them, and ``run.yaml``
records them for a resume and ``towerflow eval`` (docs/recommendation.md)::

    towerflow train --model mymodels:build --data mydata:batches --train-dir runs/mine
    towerflow train --model mymodels:build --data mydata:batches --ps 2 --workers 2 \
        --train-dir runs/mine-ps

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
import contextlib
import os
import sys
import textwrap
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from towerflow.cli._argv import argv_from_namespace
from towerflow.cli._serving import bind_host, idle_timeout_from_args
from towerflow.cli._train_options import add_train_arguments, byte_count, strategy_options
from towerflow.cli._train_settings import resolve_args, run_record

if TYPE_CHECKING:  # torch stays out of the command line's start-up
    from towerflow.strategies.base import OptimizerConfig, Strategy
    from towerflow.training.config import TrainConfig
    from towerflow.training.tasks import DataOptions

__all__ = ["add_parser", "add_train_arguments", "bind_host", "build_config", "build_data_options",
           "build_optimizer", "build_strategy", "byte_count", "replica_argv", "require_gpus",
           "resolve_args", "strategy_options", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``towerflow train``."""
    from towerflow.training.runconfig import MAY_CHANGE, PER_RUN

    epilog = textwrap.fill(
        f"Settings a resumed run may change: {', '.join(sorted(MAY_CHANGE))}; and, never taken "
        f"from the record: {', '.join(sorted(PER_RUN))}.", width=78)
    parser = subparsers.add_parser(
        "train", help="train a built-in model (cifar10, digits, click, movielens, criteo) or your own", description=__doc__,
        epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    return add_train_arguments(parser)


def build_config(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` the options describe."""
    from towerflow.training.config import TrainConfig
    from towerflow.training.tasks import default_train_dir

    return TrainConfig(
        train_dir=args.train_dir or default_train_dir(args.model), max_steps=args.max_steps,
        batch_size=args.batch_size, log_every=args.log_every, summary_every=args.summary_every,
        checkpoint_every=args.checkpoint_every, max_to_keep=args.max_to_keep,
        ema_decay=args.ema_decay if args.ema_decay else None, seed=args.seed,
        progress=False if args.no_progress else None,
        log_device_placement=args.log_device_placement, stop_deadline=args.stop_deadline)


def build_data_options(args: argparse.Namespace) -> DataOptions:
    """The :class:`DataOptions` the options describe."""
    from towerflow.training.tasks import DataOptions

    return DataOptions(data_dir=args.data_dir, synthetic=args.data == "synthetic",
                       synthetic_examples=args.synthetic_examples,
                       download=not args.no_download)


def build_optimizer(args: argparse.Namespace) -> OptimizerConfig:
    """The :class:`OptimizerConfig` the options describe (``lr`` None: the task's)."""
    from towerflow.strategies.base import OptimizerConfig
    from towerflow.training.tasks import task_class

    lr = args.lr if args.lr is not None else task_class(args.model).default_lr
    return OptimizerConfig(args.optimizer, lr=lr,
                           momentum=args.momentum, weight_decay=args.weight_decay,
                           betas=(args.adam_beta1, args.adam_beta2), eps=args.eps,
                           initial_accumulator_value=args.initial_accumulator_value)


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
    from towerflow.devices.local import gpu_count
    from towerflow.errors import InvalidArgumentError

    visible = gpu_count()
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
    GPUs seen), an all-reduce replica's ``cuda:LOCAL_RANK`` (``cuda``: its local rank's GPU,
    or an error, never the CPU); else ``--device``."""
    if args.replicas:
        return "cpu"
    if args.num_gpus:
        if cluster is None:
            return "/gpu:0"
        if "ps" in cluster:
            from towerflow.devices.local import gpu_count

            count = gpu_count()
            return f"cuda:{task.task_index % count}" if count else "cpu"
        return "cuda"
    return args.device


def _launch_local(args: argparse.Namespace, count: int) -> int:
    """Start this command again as the processes of a local cluster (``--ps``) or world."""
    from towerflow.cluster.launcher import launch_cluster, spawn_replicas

    strategy_options(args, "ps" if args.ps else "mirrored")  # refuse before anything starts
    if args.num_gpus:
        require_gpus(args.num_gpus, role="workers" if args.ps else "replicas")
    grace = args.stop_deadline + 15.0 if args.stop_deadline else 3600.0  # then SIGKILL
    if not args.ps:
        return spawn_replicas(replica_argv(args), count, grace_s=grace,
                              log_dir=build_config(args).train_dir)
    if args.model == "cifar10" and args.data == "real":
        from towerflow.training.tasks import get_task

        get_task(args.model).load("train", build_data_options(args))  # once, for every worker
    return launch_cluster(replica_argv(args), num_ps=args.ps, num_workers=count,
                          who="towerflow train", grace=grace,
                          train_dir=build_config(args).train_dir)


def run(args: argparse.Namespace) -> int:
    """Train: as this process's task of the environment's cluster (``TF_CONFIG``, torchrun,
    Slurm), else start the local processes asked for (``--ps``, ``--replicas``,
    ``--num-gpus``), else in this process alone.

    SIGTERM / SIGINT while training stop it after the step in flight with a final
    checkpoint (exit 0); before training starts or after it ended, they end the
    process with status 0 (a ps task, and the launcher of local processes, handle
    them their own way)."""
    from towerflow.training.stopping import exit_on_signals

    with exit_on_signals(), _traceback_to_file():
        return _run(args)


@contextlib.contextmanager
def _traceback_to_file() -> Iterator[None]:
    """In a replica told to (``TOWERFLOW_TRACEBACK_FILE``): an error that ends it is one line
    here, its traceback in that file, so that replica 0's is the error the terminal shows."""
    from towerflow.cluster.launcher import TRACEBACK_FILE_ENV

    path = os.environ.get(TRACEBACK_FILE_ENV)
    if not path:
        yield
        return
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - written out in full, then one line
        import traceback

        with open(path, "w") as out:
            out.write(traceback.format_exc())
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        print(f"stopped by {type(exc).__name__}: {first} (traceback in {path})",
              file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def _run(args: argparse.Namespace) -> int:
    from towerflow.cluster import resolve_cluster

    resolve_args(args)
    count = _local_count(args)
    if args.join:
        return _train(args, _joining_strategy(args))
    cluster, task = resolve_cluster()
    if cluster is None and (args.ps or count > 1):
        return _launch_local(args, count)
    if cluster is not None:  # a task of a cluster: its share of this host's cores
        from towerflow.cluster.threads import apply_thread_share

        apply_thread_share("towerflow train", cluster, task)
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


def _export_hooks(args: argparse.Namespace) -> list[Any]:
    """``--export-dir``: an ``ExportHook`` writing serving exports while training runs."""
    from towerflow.training.export_hook import ExportHook

    return [ExportHook(args.export_dir, args.export_every_secs)] if args.export_dir else []


def _train(args: argparse.Namespace, strategy: Strategy) -> int:
    from towerflow.training.run import run_training
    from towerflow.training.stopping import finish_failing
    from towerflow.training.tasks import get_task

    try:
        task = get_task(args.model, vars(args))
        run_training(task, build_config(args), data=build_data_options(args), lr=args.lr,
                     lr_decay_factor=args.lr_decay_factor,
                     epochs_per_decay=args.epochs_per_decay, strategy=strategy,
                     optimizer=build_optimizer(args), settings=run_record(args),
                     hooks=_export_hooks(args))
    except BaseException:
        # a stop signal meanwhile (a launcher stopping the others of a failed group) neither
        # hides the error nor ends the process with status 0
        with finish_failing():
            strategy.shutdown()
        raise
    strategy.shutdown()
    return 0
