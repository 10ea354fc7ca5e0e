"""Evaluate a checkpoint's moving-average weights on the test split, on any device.

Article 002: a model trained on a GPU runs inference on a CPU with no change;
article 001's ``cifar10_eval.py`` prints ``precision @ 1 = 0.861``. The
checkpoint's tensors are read straight onto the requested device, so where the
model was trained does not matter.

A classifier's precision @ 1 is :func:`towerflow.training.precision.evaluate`
(exported here too); a task scores with its own metric (:meth:`Task.score`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from towerflow.errors import NotFoundError
from towerflow.training.precision import evaluate
from towerflow.training.runconfig import load_run_settings
from towerflow.training.tasks import DataOptions, Task, get_task

__all__ = ["EvalResult", "evaluate", "evaluate_checkpoint", "load_data_options",
           "data_options_from", "table_weights"]


def data_options_from(settings: Mapping[str, Any]) -> DataOptions:
    """The :class:`DataOptions` of a run's recorded settings (absent ones: the defaults).

    Example:
        >>> data_options_from({"data": "synthetic", "synthetic_examples": 16}).synthetic
        True
    """
    default = DataOptions()
    return DataOptions(
        data_dir=settings.get("data_dir") or default.data_dir,
        synthetic=settings.get("data", "real") == "synthetic",
        synthetic_examples=settings.get("synthetic_examples", default.synthetic_examples),
        download=not settings.get("no_download", not default.download))


def load_data_options(train_dir: str | Path) -> DataOptions | None:
    """The data options of the run recorded in ``train_dir`` (``run.yaml``), or None.

    Example:
        >>> import tempfile
        >>> from towerflow.training.runconfig import save_run_settings
        >>> with tempfile.TemporaryDirectory() as d:
        ...     _ = save_run_settings(d, {"data": "synthetic", "synthetic_examples": 16})
        ...     load_data_options(d).synthetic_examples
        16

    Raises:
        DataLossError: the record exists but is not a mapping of settings.
    """
    settings = load_run_settings(train_dir)
    return None if settings is None else data_options_from(settings)


@dataclass(frozen=True, slots=True)
class EvalResult:
    """The task's metric (precision @ 1, AUC) of a checkpoint on a test split.

    Attributes:
        precision: the metric's value: for a classifier the fraction of test
            examples whose top class is the label.
        step: the checkpoint's training step.
        path: the checkpoint directory.
        num_examples: how many examples were scored.
        averaged: True when the moving averages were evaluated.
        metric: what ``precision`` measures (the task's :attr:`~Task.metric`).
        reference: the best value a model can reach on the same examples when
            the task knows it (the click task's planted truth), else None.
        others: the task's other measures by name (the recommendation tasks'
            logloss), in the order it gives them.
    """

    precision: float
    step: int
    path: Path
    num_examples: int
    averaged: bool
    metric: str = "precision @ 1"
    reference: float | None = None
    others: Mapping[str, float] = field(default_factory=dict)


def evaluate_checkpoint(task: str | Task, train_dir: str | Path, *,
                        device: str | torch.device | None = None,
                        data: DataOptions | None = None, batch_size: int = 128) -> EvalResult:
    """Load the latest checkpoint in ``train_dir`` onto ``device`` and score the test split.

    The moving averages (group ``ema``) replace the parameters when the
    checkpoint has them, as ``cifar10_eval.py`` restores them. With ``data``
    None, the test split comes from the data the run was trained with (as
    recorded in the train dir's ``run.yaml``), else from the task's usual place.

    Raises:
        NotFoundError: ``train_dir`` holds no checkpoint.
    """
    from towerflow.checkpoint import latest_checkpoint, load_into_module, read_checkpoint
    from towerflow.devices import resolve_device

    settings = load_run_settings(train_dir) if Path(train_dir).is_dir() else None
    task = get_task(task, settings) if isinstance(task, str) else task
    target = resolve_device(device)
    path = latest_checkpoint(train_dir) if Path(train_dir).is_dir() else None
    if path is None:
        raise NotFoundError(
            f"No checkpoint found in {str(train_dir)!r}; train first with "
            f"`towerflow train {task.name} --train-dir {train_dir}`, or pass the --train-dir "
            "a training run wrote."
        )
    ckpt = read_checkpoint(path, device=target)
    model = task.build_model().to(target)
    load_into_module(model, {**ckpt.groups["model"], **table_weights(ckpt, model)})
    averaged = "ema" in ckpt.groups
    if averaged:
        load_into_module(model, ckpt.groups["ema"], strict=False)
    if data is None:
        data = data_options_from(settings) if settings is not None else DataOptions()
    dataset = task.load("test", data)
    values = task.scores(model, dataset, device=target, batch_size=batch_size)
    others = {name: v for name, v in values.items() if name != task.metric}
    return EvalResult(values[task.metric], ckpt.step, ckpt.path,
                      task.num_test_examples(dataset), averaged, task.metric,
                      task.reference_score(dataset), others)


def table_weights(ckpt: Any, model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights of the model's tables that a ps run saved sharded (``<table>.weight``);
    see :func:`~towerflow.strategies.ps_tables.table_weights`."""
    from towerflow.strategies.ps_tables import table_weights as weights_of

    return weights_of(ckpt.chunked, (ckpt.metadata or {}).get("strategy"), model, ckpt.path)
