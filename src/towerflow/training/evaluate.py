"""Evaluate a checkpoint's moving-average weights on the test split, on any device.

Article 002: a model trained on a GPU runs inference on a CPU with no change;
article 001's ``cifar10_eval.py`` prints ``precision @ 1 = 0.861``. The
checkpoint's tensors are read straight onto the requested device, so where the
model was trained does not matter.

Example:
    >>> import torch
    >>> from towerflow.data import Dataset
    >>> model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 2))
    >>> data = Dataset(torch.zeros(6, 1, 2, 2), torch.zeros(6, dtype=torch.int64), 2)
    >>> 0.0 <= evaluate(model, data, device=torch.device("cpu")) <= 1.0
    True
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from towerflow.errors import DataLossError, NotFoundError
from towerflow.training.tasks import DataOptions, Task, get_task

__all__ = ["DATA_FILE", "EvalResult", "evaluate", "evaluate_checkpoint", "load_data_options",
           "save_data_options"]

#: the file in a train dir that records the data a run was trained with
DATA_FILE = "data.json"


def save_data_options(train_dir: str | Path, data: DataOptions) -> Path:
    """Record in ``train_dir`` where the run's data comes from, for evaluation to reuse.

    The data directory is stored as an absolute path, so an evaluation started
    from another directory reads the same files. The write is atomic.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     _ = save_data_options(d, DataOptions(synthetic=True, synthetic_examples=16))
        ...     load_data_options(d).synthetic_examples
        16
    """
    from towerflow.checkpoint.atomic import write_file_atomic

    fields = dataclasses.asdict(data)
    fields["data_dir"] = str(Path(data.data_dir).absolute())
    path = Path(train_dir) / DATA_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomic(path, json.dumps(fields, indent=2, sort_keys=True) + "\n")
    return path


def load_data_options(train_dir: str | Path) -> DataOptions | None:
    """The data options :func:`save_data_options` recorded in ``train_dir``, or None.

    Raises:
        DataLossError: the file exists but is not the JSON object it writes.
    """
    path = Path(train_dir) / DATA_FILE
    if not path.is_file():
        return None
    known = {f.name: f.type for f in dataclasses.fields(DataOptions)}
    try:
        raw = json.loads(path.read_text())
        if not isinstance(raw, dict):
            raise TypeError(f"a JSON {type(raw).__name__}, not an object")
        return DataOptions(**{k: v for k, v in raw.items() if k in known})
    except (ValueError, TypeError) as exc:
        raise DataLossError(
            f"{str(path)!r} does not hold a run's data settings ({exc}); delete it and give "
            "the data options (--data, --data-dir, --synthetic-examples) on the command line."
        ) from exc


@dataclass(frozen=True, slots=True)
class EvalResult:
    """Precision @ 1 of a checkpoint on a test split.

    Attributes:
        precision: fraction of test examples whose top class is the label.
        step: the checkpoint's training step.
        path: the checkpoint directory.
        num_examples: how many examples were scored.
        averaged: True when the moving averages were evaluated.
    """

    precision: float
    step: int
    path: Path
    num_examples: int
    averaged: bool


@torch.no_grad()
def evaluate(model: nn.Module, dataset, *, device: torch.device,  # noqa: ANN001
             batch_size: int = 128,
             images_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> float:
    """Precision @ 1 of ``model`` on ``dataset`` (counted on the device, read once)."""
    model.eval()
    correct = torch.zeros((), dtype=torch.int64, device=device)
    total = len(dataset.labels)
    for start in range(0, total, batch_size):
        images = dataset.images[start:start + batch_size].to(device, non_blocking=True)
        labels = dataset.labels[start:start + batch_size].to(device, non_blocking=True)
        if images_fn is not None:
            images = images_fn(images)
        correct += (model(images).argmax(dim=1) == labels).sum()
    return int(correct.item()) / max(total, 1)


def evaluate_checkpoint(task: str | Task, train_dir: str | Path, *,
                        device: str | torch.device | None = None,
                        data: DataOptions | None = None, batch_size: int = 128) -> EvalResult:
    """Load the latest checkpoint in ``train_dir`` onto ``device`` and score the test split.

    The moving averages (group ``ema``) replace the parameters when the
    checkpoint has them, as ``cifar10_eval.py`` restores them. With ``data``
    None, the test split comes from the data the run was trained with (as
    recorded by :func:`save_data_options`), else from the task's usual place.

    Raises:
        NotFoundError: ``train_dir`` holds no checkpoint.
    """
    from towerflow.checkpoint import latest_checkpoint, load_into_module, read_checkpoint
    from towerflow.devices import resolve_device

    task = get_task(task) if isinstance(task, str) else task
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
    load_into_module(model, ckpt.groups["model"])
    averaged = "ema" in ckpt.groups
    if averaged:
        load_into_module(model, ckpt.groups["ema"], strict=False)
    if data is None:
        data = load_data_options(train_dir) or DataOptions()
    dataset = task.load("test", data)
    precision = evaluate(model, dataset, device=target, batch_size=batch_size,
                         images_fn=task.eval_images)
    return EvalResult(precision, ckpt.step, ckpt.path, len(dataset.labels), averaged)
