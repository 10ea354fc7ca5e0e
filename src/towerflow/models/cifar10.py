"""The CIFAR-10 network of TensorFlow's ``cifar10.py`` (article 001), in PyTorch.

Layer for layer what ``cifar10.inference()`` builds, with the same names so a
placement log or a checkpoint reads like TensorFlow's::

    conv1           5x5 conv, 64 filters, relu          (24x24x3  -> 24x24x64)
    pool1           3x3 max pool, stride 2, SAME        (-> 12x12x64)
    norm1           local response normalisation
    conv2           5x5 conv, 64 filters, relu
    norm2           local response normalisation
    pool2           3x3 max pool, stride 2, SAME        (-> 6x6x64 = 2304)
    local3          fully connected 2304 -> 384, relu   (weight decay 0.004)
    local4          fully connected 384 -> 192, relu    (weight decay 0.004)
    softmax_linear  fully connected 192 -> 10 (logits; the softmax is in the loss)

Initialisation follows the original too (truncated normals with the same
standard deviations, the same bias constants). The L2 weight decay is not an
optimizer option but a term of the loss, as in TensorFlow: see
:func:`weight_decay_loss`.

Example:
    >>> import torch
    >>> net = Cifar10Net()
    >>> net(torch.zeros(2, 3, 24, 24)).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "IMAGE_SIZE",
    "NUM_CLASSES",
    "NUM_EXAMPLES_PER_EPOCH_FOR_TRAIN",
    "NUM_EXAMPLES_PER_EPOCH_FOR_EVAL",
    "LocalResponseNorm",
    "Cifar10Net",
    "weight_decay_loss",
    "cross_entropy_loss",
]

IMAGE_SIZE = 24
NUM_CLASSES = 10
NUM_EXAMPLES_PER_EPOCH_FOR_TRAIN = 50000
NUM_EXAMPLES_PER_EPOCH_FOR_EVAL = 10000


class LocalResponseNorm(nn.Module):
    """``tf.nn.lrn`` with TensorFlow's parameters.

    ``out = x / (bias + alpha * sum(x[c - r : c + r + 1] ** 2)) ** beta`` over
    the channel axis. PyTorch's ``local_response_norm`` divides ``alpha`` by the
    window size, so this module multiplies it back.

    Args:
        depth_radius: half-width ``r`` of the channel window (size ``2r + 1``).
        bias, alpha, beta: as in ``tf.nn.lrn``.
    """

    def __init__(
        self, depth_radius: int = 4, bias: float = 1.0, alpha: float = 0.001 / 9.0,
        beta: float = 0.75,
    ) -> None:
        super().__init__()
        self.depth_radius = depth_radius
        self.bias = bias
        self.alpha = alpha
        self.beta = beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = 2 * self.depth_radius + 1
        return F.local_response_norm(x, size, alpha=self.alpha * size, beta=self.beta,
                                     k=self.bias)

    def extra_repr(self) -> str:
        return (f"depth_radius={self.depth_radius}, bias={self.bias}, "
                f"alpha={self.alpha:.3g}, beta={self.beta}")


def _init_(layer: nn.Conv2d | nn.Linear, stddev: float, bias: float) -> None:
    nn.init.trunc_normal_(layer.weight, std=stddev, a=-2 * stddev, b=2 * stddev)
    nn.init.constant_(layer.bias, bias)


class Cifar10Net(nn.Module):
    """The article's CIFAR-10 model; input float32 ``(N, 3, 24, 24)``, output logits.

    Attributes:
        weight_decays: parameter name -> L2 weight-decay coefficient, read by
            :func:`weight_decay_loss` (TensorFlow's ``_variable_with_weight_decay``).
    """

    def __init__(self, num_classes: int = NUM_CLASSES, image_size: int = IMAGE_SIZE) -> None:
        super().__init__()
        flat = 64 * _pooled(_pooled(image_size)) ** 2
        self.conv1 = nn.Conv2d(3, 64, 5, padding=2)
        self.pool1 = nn.MaxPool2d(3, stride=2, padding=1)
        self.norm1 = LocalResponseNorm(4, bias=1.0, alpha=0.001 / 9.0, beta=0.75)
        self.conv2 = nn.Conv2d(64, 64, 5, padding=2)
        self.norm2 = LocalResponseNorm(4, bias=1.0, alpha=0.001 / 9.0, beta=0.75)
        self.pool2 = nn.MaxPool2d(3, stride=2, padding=1)
        self.local3 = nn.Linear(flat, 384)
        self.local4 = nn.Linear(384, 192)
        self.softmax_linear = nn.Linear(192, num_classes)
        _init_(self.conv1, 5e-2, 0.0)
        _init_(self.conv2, 5e-2, 0.1)
        _init_(self.local3, 0.04, 0.1)
        _init_(self.local4, 0.04, 0.1)
        _init_(self.softmax_linear, 1.0 / 192.0, 0.0)
        self.weight_decays: dict[str, float] = {"local3.weight": 0.004, "local4.weight": 0.004}

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.norm1(self.pool1(F.relu(self.conv1(images))))
        x = self.pool2(self.norm2(F.relu(self.conv2(x))))
        x = F.relu(self.local3(torch.flatten(x, 1)))
        x = F.relu(self.local4(x))
        return self.softmax_linear(x)


def _pooled(size: int) -> int:
    """Spatial size after a 3x3 stride-2 SAME pool."""
    return (size + 1) // 2


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a ``DistributedDataParallel`` (or similar) wrapper."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def weight_decay_loss(model: nn.Module) -> torch.Tensor:
    """Sum of ``wd * sum(w ** 2) / 2`` over the model's ``weight_decays`` entries.

    Works on the bare model and on a ``DistributedDataParallel`` wrapper. A model
    without a ``weight_decays`` attribute has no decay (the result is 0).

    Example:
        >>> net = Cifar10Net()
        >>> w3, w4 = net.local3.weight, net.local4.weight
        >>> expected = 0.004 * ((w3 ** 2).sum() + (w4 ** 2).sum()) / 2
        >>> bool(torch.isclose(weight_decay_loss(net), expected))
        True
    """
    inner = _unwrap(model)
    decays: dict[str, float] = getattr(inner, "weight_decays", {})
    params = dict(inner.named_parameters())
    total: torch.Tensor | None = None
    for name, wd in decays.items():
        term = params[name].pow(2).sum() * (wd / 2.0)
        total = term if total is None else total + term
    if total is None:
        first = next(iter(params.values()), None)
        return torch.zeros((), device=first.device if first is not None else None)
    return total


def cross_entropy_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The tower loss of ``cifar10.loss()``: mean cross entropy plus weight decay.

    The signature is the strategies' ``loss_fn(model, batch)``.
    """
    images, labels = batch
    logits = model(images)
    return F.cross_entropy(logits, labels) + weight_decay_loss(model)
