"""Learning-rate schedules: a pure function of the global step.

``ExponentialDecay`` is ``tf.train.exponential_decay``; with ``staircase=True``
the rate drops by ``decay_rate`` once every ``decay_steps`` steps, as in
article 001 (0.1, times 0.1 every 350 epochs).

Example:
    >>> s = ExponentialDecay(0.1, decay_steps=100, decay_rate=0.1)
    >>> [round(s(step), 6) for step in (0, 99, 100, 250)]
    [0.1, 0.1, 0.01, 0.001]
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from towerflow.errors import InvalidArgumentError

__all__ = ["ExponentialDecay", "decay_steps_for_epochs"]


@dataclass(frozen=True, slots=True)
class ExponentialDecay:
    """``lr(step) = initial * decay_rate ** (step / decay_steps)`` (floored if staircase).

    Attributes:
        initial: the learning rate at step 0.
        decay_steps: steps per decay period (positive).
        decay_rate: factor applied once per period (``1.0`` keeps the rate constant).
        staircase: decay in discrete steps (TensorFlow's ``staircase=True``).
    """

    initial: float
    decay_steps: int
    decay_rate: float = 0.1
    staircase: bool = True

    def __post_init__(self) -> None:
        if not (math.isfinite(self.initial) and self.initial > 0):
            raise InvalidArgumentError(
                f"Initial learning rate must be a positive number, got {self.initial!r}."
            )
        if self.decay_steps < 1:
            raise InvalidArgumentError(
                f"decay_steps must be at least 1, got {self.decay_steps!r}; use a larger "
                "number of epochs per decay or a smaller batch."
            )
        if not self.decay_rate > 0:
            raise InvalidArgumentError(
                f"decay_rate must be positive, got {self.decay_rate!r}; use 1.0 for no decay."
            )

    def __call__(self, step: int) -> float:
        exponent = step / self.decay_steps
        if self.staircase:
            exponent = math.floor(exponent)
        return self.initial * self.decay_rate ** exponent

    def as_dict(self) -> dict[str, Any]:
        """JSON-able description (stored in checkpoint metadata)."""
        return {"kind": "exponential_decay", **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExponentialDecay:
        """Inverse of :meth:`as_dict`."""
        if data.get("kind") != "exponential_decay":
            raise InvalidArgumentError(
                f"Unknown learning-rate schedule {data.get('kind')!r} in checkpoint metadata; "
                "expected 'exponential_decay'."
            )
        return cls(initial=float(data["initial"]), decay_steps=int(data["decay_steps"]),
                   decay_rate=float(data["decay_rate"]), staircase=bool(data["staircase"]))


def decay_steps_for_epochs(num_examples_per_epoch: int, global_batch_size: int,
                           epochs_per_decay: float) -> int:
    """Steps in ``epochs_per_decay`` epochs, as article 001 computes ``decay_steps``.

    Example:
        >>> decay_steps_for_epochs(50000, 128, 350.0)
        136718
    """
    if global_batch_size < 1:
        raise InvalidArgumentError(
            f"Global batch size must be at least 1, got {global_batch_size!r}."
        )
    batches_per_epoch = num_examples_per_epoch / global_batch_size
    return max(1, int(batches_per_epoch * epochs_per_decay))
