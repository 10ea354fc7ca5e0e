"""The in-memory data set every towerflow input pipeline starts from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from towerflow.errors import InvalidArgumentError

__all__ = ["Dataset"]


@dataclass(frozen=True, slots=True)
class Dataset:
    """Examples held in memory as CPU tensors.

    Attributes:
        images: ``(N, C, H, W)``: uint8 for CIFAR-10 ``(N, 3, 32, 32)``,
            float32 in [0, 1] for digits ``(N, 1, 8, 8)``.
        labels: int64 ``(N,)`` class indices.
        num_classes: How many classes the labels index.

    Example:
        >>> ds = Dataset(torch.zeros(4, 1, 8, 8), torch.tensor([0, 1, 2, 1]), 3)
        >>> len(ds)
        4
    """

    images: torch.Tensor
    labels: torch.Tensor
    num_classes: int

    def __post_init__(self) -> None:
        if self.images.dim() != 4:
            raise InvalidArgumentError(
                f"Dataset images must be (N, C, H, W), got shape {list(self.images.shape)}."
            )
        if self.labels.dtype != torch.int64 or self.labels.shape != (self.images.shape[0],):
            raise InvalidArgumentError(
                f"Dataset labels must be int64 of shape ({self.images.shape[0]},), got "
                f"{self.labels.dtype} {list(self.labels.shape)}."
            )
        if self.num_classes < 1:
            raise InvalidArgumentError(f"num_classes={self.num_classes} must be at least 1.")

    def __len__(self) -> int:
        return int(self.labels.shape[0])
