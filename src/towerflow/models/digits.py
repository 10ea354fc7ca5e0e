"""A small network for scikit-learn's 8x8 handwritten digits.

A real data set that needs no network (1797 images, 10 classes), so every
test and example can train on real data. Inputs are float32 ``(N, 1, 8, 8)``
images; the output is 10 logits.

Example:
    >>> import torch
    >>> DigitsNet()(torch.zeros(4, 1, 8, 8)).shape
    torch.Size([4, 10])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DigitsNet", "NUM_CLASSES"]

NUM_CLASSES = 10


class DigitsNet(nn.Module):
    """Two fully connected layers (``hidden``, ``softmax_linear``) over the 64 pixels.

    Attributes:
        weight_decays: parameter name -> L2 coefficient for
            :func:`towerflow.models.weight_decay_loss`.
    """

    def __init__(self, hidden: int = 128, num_classes: int = NUM_CLASSES,
                 weight_decay: float = 1e-4) -> None:
        super().__init__()
        self.hidden = nn.Linear(64, hidden)
        self.softmax_linear = nn.Linear(hidden, num_classes)
        self.weight_decays: dict[str, float] = {"hidden.weight": weight_decay}

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.softmax_linear(F.relu(self.hidden(torch.flatten(images, 1))))
