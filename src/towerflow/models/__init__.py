"""Models: the article's CIFAR-10 network, a small net for 8x8 digits, a click net, DeepFM.

Example:
    >>> from towerflow.models import Cifar10Net, weight_decay_loss
    >>> float(weight_decay_loss(Cifar10Net())) > 0
    True
"""

from __future__ import annotations

from towerflow.models.cifar10 import (
    Cifar10Net,
    LocalResponseNorm,
    cross_entropy_loss,
    weight_decay_loss,
)
from towerflow.models.click import ClickNet
from towerflow.models.deepfm import DeepFM, deepfm_loss
from towerflow.models.digits import DigitsNet

__all__ = [
    "Cifar10Net",
    "ClickNet",
    "DeepFM",
    "DigitsNet",
    "LocalResponseNorm",
    "cross_entropy_loss",
    "deepfm_loss",
    "weight_decay_loss",
]
