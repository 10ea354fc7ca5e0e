"""``run_training``: article 001's whole program, for a built-in task, as one call.

What ``towerflow train cifar10|digits`` runs in every replica process: the
task's model, its (sharded, prefetched, distorted) data, SGD with a staircase
exponential decay of the learning rate, moving averages, the step log,
summaries and checkpoints, all through :class:`~towerflow.training.Trainer`.

Example:
    >>> from towerflow.training import TrainConfig, run_training
    >>> result = run_training("digits", TrainConfig(max_steps=20, batch_size=32,
    ...                                              log_every=10**6))
    >>> result.step
    20
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from towerflow.strategies.base import OptimizerConfig, Strategy
from towerflow.training.config import TrainConfig
from towerflow.training.hooks import Hook
from towerflow.training.loop import Trainer, TrainResult, default_strategy
from towerflow.training.runconfig import save_run_settings
from towerflow.training.schedules import ExponentialDecay, decay_steps_for_epochs
from towerflow.training.tasks import DataOptions, Task, get_task

__all__ = ["run_training", "run_settings"]

log = logging.getLogger("towerflow.training")


def _load_train_split(task: Task, data: DataOptions, strategy: Strategy):  # noqa: ANN202
    """Rank 0 reads (and downloads) first, the other replicas after it."""
    if strategy.rank != 0:
        strategy.barrier()
    dataset = task.load("train", data)
    if strategy.rank == 0:
        strategy.barrier()
    return dataset


def run_settings(task: Task, config: TrainConfig, data: DataOptions, optimizer: OptimizerConfig,
                 lr_decay_factor: float, epochs_per_decay: float) -> dict[str, Any]:
    """The settings a run trains with, named as ``towerflow train``'s options.

    Paths are absolute, so the record is read the same from any directory.
    """
    return {
        "model": task.name,
        "train_dir": str(Path(config.train_dir).absolute()) if config.train_dir else None,
        "max_steps": config.max_steps, "batch_size": config.batch_size,
        "data": "synthetic" if data.synthetic else "real",
        "data_dir": str(Path(data.data_dir).absolute()),
        "synthetic_examples": data.synthetic_examples, "no_download": not data.download,
        "log_every": config.log_every, "summary_every": config.summary_every,
        "checkpoint_every": config.checkpoint_every, "max_to_keep": config.max_to_keep,
        "optimizer": optimizer.name, "lr": optimizer.lr, "momentum": optimizer.momentum,
        "weight_decay": optimizer.weight_decay, "adam_beta1": optimizer.betas[0],
        "adam_beta2": optimizer.betas[1], "eps": optimizer.eps,
        "initial_accumulator_value": optimizer.initial_accumulator_value,
        "lr_decay_factor": lr_decay_factor, "epochs_per_decay": epochs_per_decay,
        "ema_decay": config.ema_decay or 0.0, "seed": config.seed,
        **task.settings(),
    }


def run_training(task: str | Task, config: TrainConfig, *, data: DataOptions | None = None,
                 lr: float | None = None, lr_decay_factor: float = 0.1,
                 epochs_per_decay: float | None = None, strategy: Strategy | None = None,
                 device: str | None = None, optimizer: OptimizerConfig | None = None,
                 settings: Mapping[str, Any] | None = None,
                 hooks: Sequence[Hook] = ()) -> TrainResult:
    """Train a built-in task; resume from ``config.train_dir`` when it holds a checkpoint.

    The chief records the run's settings in ``<train_dir>/run.yaml``
    (:mod:`~towerflow.training.runconfig`): those given here, over ``settings``
    (the rest of the command line's, e.g. the strategy's options).

    Args:
        task: ``"cifar10"``, ``"digits"`` or a :class:`Task`.
        config: the loop's options (``batch_size`` is per replica).
        data: where the data comes from (default: the task's usual place).
        lr: initial learning rate (default: ``optimizer.lr`` when an optimizer
            is given, else the task's, 0.1).
        lr_decay_factor: staircase decay factor.
        epochs_per_decay: epochs between decays (default 350, as in the article).
        strategy: default :func:`~towerflow.training.loop.default_strategy`.
        device: the device of a single-process run (ignored with ``strategy``).
        optimizer: the optimizer and its hyper-parameters (default: plain SGD); the task's
            own (:meth:`Task.own_optimizer`, a user factory's) replaces it.
        settings: more settings to record in ``run.yaml``.
        hooks: more hooks for the loop (an ``ExportHook``).
    """
    task = get_task(task) if isinstance(task, str) else task
    owns_strategy = strategy is None
    strategy = strategy if strategy is not None else default_strategy(device)
    try:
        torch.manual_seed(config.seed)
        model = task.build_train_model()
        data = data or DataOptions()
        dataset = task.replica_data(_load_train_split(task, data, strategy), rank=strategy.rank,
                                    world_size=strategy.world_size, batch_size=config.batch_size)
        own = task.own_optimizer()  # the model's own (a user factory's), over the run's
        if own is not None:
            from towerflow.strategies.optim import as_optimizer_config

            optimizer = as_optimizer_config(own, model)  # a torch.optim one by its groups
            lr = optimizer.lr
        if lr is None:
            lr = optimizer.lr if optimizer is not None else task.default_lr
        optimizer = dataclasses.replace(optimizer or OptimizerConfig("sgd", lr=lr), lr=lr)
        epochs = epochs_per_decay if epochs_per_decay is not None else task.default_epochs_per_decay
        if strategy.is_chief and config.train_dir is not None:  # what eval and a resume read
            record = {**(settings or {}), **run_settings(
                task, config, data, optimizer, lr_decay_factor, epochs)}
            save_run_settings(config.train_dir, {k: v for k, v in record.items()
                                                 if k not in task.unused_settings})
        decay_steps = decay_steps_for_epochs(task.num_examples_per_epoch,
                                             config.batch_size * strategy.batches_per_step, epochs)
        schedule = ExponentialDecay(lr, decay_steps, lr_decay_factor, staircase=True)
        transform = task.train_transform(strategy.device, seed=config.seed * 7919 + strategy.rank)
        trainer = Trainer(model, task.loss_fn, dataset, strategy=strategy,
                          optimizer=optimizer, schedule=schedule,
                          config=config, transform=transform, metadata=task.metadata(),
                          hooks=hooks)
        with trainer:
            return trainer.fit()
    finally:
        if owns_strategy:
            strategy.shutdown()
