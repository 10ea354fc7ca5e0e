"""Article 003's model: linear regression ``z = X * w + b`` on one feature.

Example:
    >>> import torch
    >>> x, y = regression_data(100, noise=0.0)
    >>> model = LinearRegression()
    >>> _ = torch.nn.init.constant_(model.weight, 2.0)
    >>> float(mse_loss(model, (x, y)).detach())
    1.0
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["LinearRegression", "regression_data", "mse_loss", "TRUE_WEIGHT", "TRUE_BIAS"]

TRUE_WEIGHT = 2.0
TRUE_BIAS = 1.0


class LinearRegression(nn.Module):
    """``z = X * weight + bias``; ``weight`` starts random normal, ``bias`` at zero."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(1, generator=generator))
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight + self.bias


def regression_data(num: int = 100, *, weight: float = TRUE_WEIGHT, bias: float = TRUE_BIAS,
                    noise: float = 0.3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The article's data: ``x`` evenly spaced in [-1, 1], ``y = weight * x + bias + noise``."""
    x = torch.linspace(-1.0, 1.0, num)
    gen = torch.Generator().manual_seed(seed)
    y = weight * x + bias + noise * torch.randn(num, generator=gen)
    return x, y


def mse_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``mean((Y - z)^2)``, the article's cost."""
    x, y = batch
    return torch.mean(torch.square(y - model(x)))
