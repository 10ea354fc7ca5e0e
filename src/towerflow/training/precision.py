"""Precision @ 1 of a classifier on a data set, counted on the device and read once.

Example:
    >>> import torch
    >>> from towerflow.data import Dataset
    >>> model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 2))
    >>> data = Dataset(torch.zeros(6, 1, 2, 2), torch.zeros(6, dtype=torch.int64), 2)
    >>> 0.0 <= evaluate(model, data, device=torch.device("cpu")) <= 1.0
    True
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["evaluate"]


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
