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

import logging

import torch

from towerflow.strategies.base import OptimizerConfig, Strategy
from towerflow.training.config import TrainConfig
from towerflow.training.evaluate import save_data_options
from towerflow.training.loop import Trainer, TrainResult, default_strategy
from towerflow.training.schedules import ExponentialDecay, decay_steps_for_epochs
from towerflow.training.tasks import DataOptions, Task, get_task

__all__ = ["run_training"]

log = logging.getLogger("towerflow.training")


def _load_train_split(task: Task, data: DataOptions, strategy: Strategy):  # noqa: ANN202
    """Rank 0 reads (and downloads) first, the other replicas after it."""
    if strategy.rank != 0:
        strategy.barrier()
    dataset = task.load("train", data)
    if strategy.rank == 0:
        strategy.barrier()
    return dataset


def run_training(task: str | Task, config: TrainConfig, *, data: DataOptions | None = None,
                 lr: float | None = None, lr_decay_factor: float = 0.1,
                 epochs_per_decay: float | None = None, strategy: Strategy | None = None,
                 device: str | None = None) -> TrainResult:
    """Train a built-in task; resume from ``config.train_dir`` when it holds a checkpoint.

    Args:
        task: ``"cifar10"``, ``"digits"`` or a :class:`Task`.
        config: the loop's options (``batch_size`` is per replica).
        data: where the data comes from (default: the task's usual place).
        lr: initial learning rate (default: the task's, 0.1).
        lr_decay_factor: staircase decay factor.
        epochs_per_decay: epochs between decays (default 350, as in the article).
        strategy: default :func:`~towerflow.training.loop.default_strategy`.
        device: the device of a single-process run (ignored with ``strategy``).
    """
    task = get_task(task) if isinstance(task, str) else task
    owns_strategy = strategy is None
    strategy = strategy if strategy is not None else default_strategy(device)
    try:
        torch.manual_seed(config.seed)
        model = task.build_model()
        data = data or DataOptions()
        dataset = _load_train_split(task, data, strategy)
        if strategy.is_chief and config.train_dir is not None:
            save_data_options(config.train_dir, data)  # what `towerflow eval` reads back
        initial = lr if lr is not None else task.default_lr
        epochs = epochs_per_decay if epochs_per_decay is not None else task.default_epochs_per_decay
        decay_steps = decay_steps_for_epochs(task.num_examples_per_epoch,
                                             config.batch_size * strategy.batches_per_step, epochs)
        schedule = ExponentialDecay(initial, decay_steps, lr_decay_factor, staircase=True)
        transform = task.train_transform(strategy.device, seed=config.seed * 7919 + strategy.rank)
        trainer = Trainer(model, task.loss_fn, dataset, strategy=strategy,
                          optimizer=OptimizerConfig("sgd", lr=initial), schedule=schedule,
                          config=config, transform=transform, metadata={"task": task.name})
        with trainer:
            return trainer.fit()
    finally:
        if owns_strategy:
            strategy.shutdown()
