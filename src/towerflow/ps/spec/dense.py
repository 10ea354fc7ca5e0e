"""The dense optimizers a ps task applies: their names, their state buffers, their torch twins.

The one list of dense optimizer names: the strategies' :class:`OptimizerConfig`, the
command line's ``--optimizer``, the ps task's server-side optimizer and a
one-process run of a ps checkpoint all read it. Importing it costs no torch: the
command line's help and errors stay fast.

Example:
    >>> canonical_name("sgd", momentum=0.9), SLOT_NAMES["adam"]
    ('momentum', ('exp_avg', 'exp_avg_sq'))
    >>> check_optimizer_name("lbfgs")
    Traceback (most recent call last):
    ...
    towerflow.errors.InvalidArgumentError: Unknown optimizer 'lbfgs'; use one of sgd, momentum, adam, adagrad.
"""

from __future__ import annotations

from typing import Any

from towerflow.errors import InvalidArgumentError

__all__ = ["OPTIMIZER_NAMES", "SLOT_NAMES", "canonical_name", "check_optimizer_name",
           "torch_optimizer_class"]

#: the dense optimizers a ps task applies (``sgd`` with momentum runs as ``momentum``)
OPTIMIZER_NAMES = ("sgd", "momentum", "adam", "adagrad")
#: the state buffers each optimizer keeps, named as ``torch.optim`` names them
SLOT_NAMES = {"sgd": (), "momentum": ("momentum_buffer",), "adam": ("exp_avg", "exp_avg_sq"),
              "adagrad": ("sum",)}
#: the ``torch.optim`` class each runs as in one process
_TORCH_CLASSES = {"sgd": "SGD", "momentum": "SGD", "adam": "Adam", "adagrad": "Adagrad"}


def canonical_name(name: str, momentum: float = 0.0) -> str:
    """The optimizer ``name`` runs as (``sgd`` with momentum is ``momentum``)."""
    return "momentum" if name == "sgd" and momentum else name


def check_optimizer_name(name: object) -> str:
    """``name`` if it is one of :data:`OPTIMIZER_NAMES`.

    Raises:
        InvalidArgumentError: any other name, with the names to use.
    """
    if name not in OPTIMIZER_NAMES:
        raise InvalidArgumentError(
            f"Unknown optimizer {name!r}; use one of {', '.join(OPTIMIZER_NAMES)}."
        )
    return str(name)


def torch_optimizer_class(name: str) -> Any:
    """The ``torch.optim`` class that optimizer ``name`` runs as in one process."""
    import torch

    return getattr(torch.optim, _TORCH_CLASSES[check_optimizer_name(name)])
