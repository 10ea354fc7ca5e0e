"""Moving averages of the parameters (``tf.train.ExponentialMovingAverage``).

After every update, ``shadow -= (1 - d) * (shadow - param)`` with
``d = min(decay, (1 + n) / (10 + n))`` where ``n`` is the number of updates
applied before this one, TensorFlow's ``num_updates`` warm-up. Evaluation
uses the shadow values. The update is one fused ``torch._foreach_lerp_`` on
the parameters' device: no host synchronisation.

Example:
    >>> import torch
    >>> p = torch.nn.Parameter(torch.zeros(2))
    >>> ema = ExponentialMovingAverage({"w": p}, decay=0.9999)
    >>> with torch.no_grad():
    ...     _ = p.fill_(1.0)
    >>> ema.update(num_updates=0)       # d = min(0.9999, 1/10) = 0.1
    >>> [round(v, 4) for v in ema.shadow["w"].tolist()]
    [0.9, 0.9]
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from towerflow.errors import InvalidArgumentError

__all__ = ["ExponentialMovingAverage", "ema_decay"]


def ema_decay(decay: float, num_updates: int | None) -> float:
    """The effective decay: ``min(decay, (1 + n) / (10 + n))``, or ``decay`` when n is None.

    Example:
        >>> ema_decay(0.9999, 0), ema_decay(0.9999, 90), ema_decay(0.9999, None)
        (0.1, 0.91, 0.9999)
    """
    if num_updates is None:
        return decay
    return min(decay, (1.0 + num_updates) / (10.0 + num_updates))


class ExponentialMovingAverage:
    """Shadow copies of named parameters, updated with a moving average.

    Args:
        params: name -> parameter (the model's ``named_parameters()``).
        decay: the maximum decay (article 001: 0.9999).
        num_updates_warmup: apply TensorFlow's ``num_updates`` rule.
    """

    __slots__ = ("decay", "num_updates_warmup", "_params", "shadow")

    def __init__(self, params: Mapping[str, torch.Tensor], decay: float = 0.9999,
                 num_updates_warmup: bool = True) -> None:
        if not 0.0 <= decay < 1.0:
            raise InvalidArgumentError(
                f"Moving-average decay must be in [0, 1), got {decay!r}; the article uses 0.9999."
            )
        self.decay = decay
        self.num_updates_warmup = num_updates_warmup
        self._params = dict(params)
        with torch.no_grad():
            self.shadow: dict[str, torch.Tensor] = {
                name: p.detach().clone() for name, p in self._params.items()
            }

    def update(self, num_updates: int | None = None) -> None:
        """Move every shadow towards its parameter (call after each optimizer step)."""
        d = ema_decay(self.decay, num_updates if self.num_updates_warmup else None)
        with torch.no_grad():
            names = list(self.shadow)
            torch._foreach_lerp_([self.shadow[n] for n in names],
                                 [self._params[n].detach() for n in names], 1.0 - d)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The shadow values by parameter name (what checkpoints store as ``ema``)."""
        return dict(self.shadow)

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Restore shadow values (from any device) saved by :meth:`state_dict`."""
        missing = sorted(set(self.shadow) - set(tensors))
        unexpected = sorted(set(tensors) - set(self.shadow))
        if missing or unexpected:
            raise InvalidArgumentError(
                f"Moving averages do not match the model: missing {missing}, unexpected "
                f"{unexpected}; restore a checkpoint written for this model."
            )
        with torch.no_grad():
            for name, value in tensors.items():
                target = self.shadow[name]
                if value.shape != target.shape:
                    raise InvalidArgumentError(
                        f"Moving average {name!r} has shape {tuple(value.shape)} in the "
                        f"checkpoint but {tuple(target.shape)} in the model."
                    )
                target.copy_(value)
