"""The test metrics of a user's own model, chosen by its loss as a built-in task's are.

``towerflow eval`` of ``--model MODULE:FACTORY`` prints the mean loss of the test split
and, from the outputs and targets of the whole split:

* a binary cross entropy (``--loss bce_with_logits``, ``nn.BCEWithLogitsLoss``,
  ``nn.BCELoss`` and their functional forms): ``AUC`` and ``logloss`` (scikit-learn's
  ``roc_auc_score`` and ``log_loss``), as the click, MovieLens and Criteo tasks;
* a cross entropy (``--loss cross_entropy``, ``nn.CrossEntropyLoss``): ``accuracy``
  (the top class against the target class, or against a target distribution's top class);
* whatever the model factory names: ``{"model": ..., "metrics": {"name": fn}}``, each
  ``fn(outputs, targets) -> float`` called once on the split's concatenated CPU tensors.

Example:
    >>> outputs, targets = torch.tensor([2.0, -1.0, 0.5, -3.0]), torch.tensor([1.0, 0.0, 0.0, 0.0])
    >>> sorted(split_metrics("logits", {}, outputs, targets))
    ['AUC', 'logloss']
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from towerflow.errors import InvalidArgumentError
from towerflow.training.names import LOSS_KINDS

__all__ = ["kind_of_loss", "check_metrics", "split_metrics", "binary_scores"]

log = logging.getLogger("towerflow.training")

#: the criteria whose outputs are logits of a binary label, probabilities of it, class scores
_LOGITS = (nn.BCEWithLogitsLoss, F.binary_cross_entropy_with_logits)
_PROBS = (nn.BCELoss, F.binary_cross_entropy)
_CLASSES = (nn.CrossEntropyLoss, F.cross_entropy)


def kind_of_loss(criterion: Any, name: str | None = None) -> str | None:
    """``"logits"``, ``"probs"`` or ``"classes"`` for a criterion whose metrics are known
    (``name``: the ``--loss`` it came from), else None (the loss alone is reported)."""
    if name is not None:
        return LOSS_KINDS.get(name)
    for kind, known in (("logits", _LOGITS), ("probs", _PROBS), ("classes", _CLASSES)):
        if criterion in known or isinstance(criterion, tuple(k for k in known
                                                             if isinstance(k, type))):
            return kind
    return None


def check_metrics(metrics: Any, factory: str) -> dict[str, Callable[[Any, Any], Any]]:
    """A model factory's ``"metrics"``: a mapping of names to callables.

    Raises:
        InvalidArgumentError: not a mapping of non-empty names to callables.
    """
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping) or not all(
            isinstance(k, str) and k and callable(v) for k, v in metrics.items()):
        raise InvalidArgumentError(
            f"--model {factory} returned 'metrics' of type {type(metrics).__name__}; return "
            "a dict of names to functions fn(outputs, targets) -> float, e.g. "
            "{'mae': lambda o, t: float((o - t).abs().mean())}.")
    return dict(metrics)


def binary_scores(labels: torch.Tensor, probs: torch.Tensor, *, one_class: str = "warn",
                  what: str = "the test split") -> dict[str, float]:
    """``AUC`` and ``logloss`` (scikit-learn's) of click probabilities ``probs`` against 0/1
    ``labels``. A split of one class has no AUC: ``one_class="warn"`` says so in one line and
    reports the logloss alone, ``"raise"`` refuses.

    Raises:
        InvalidArgumentError: one class only, with ``one_class="raise"``.
    """
    from sklearn.metrics import log_loss, roc_auc_score

    y, p = labels.double().reshape(-1).numpy(), probs.double().reshape(-1).numpy()
    out = {"logloss": float(log_loss(y, p, labels=[0, 1]))}
    if y.min() != y.max():
        return {"AUC": float(roc_auc_score(y, p)), **out}
    if one_class == "raise":
        raise InvalidArgumentError(f"{what[:1].upper()}{what[1:]} holds one class only "
                                   f"({int(y[0])}); AUC needs both: test on more data.")
    log.warning("%s holds one class only (%d): no AUC; test on more data", what, int(y[0]))
    return out


def _binary(kind: str, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    scores = outputs.double().reshape(-1)
    if scores.numel() != targets.numel():
        log.warning("the model's outputs %s and the targets %s differ in size: no AUC or "
                    "logloss", tuple(outputs.shape), tuple(targets.shape))
        return {}
    return binary_scores(targets, torch.sigmoid(scores) if kind == "logits"
                         else scores.clamp(0.0, 1.0))


def _accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    predicted = outputs.argmax(-1)
    truth = targets.argmax(-1) if targets.is_floating_point() and targets.shape == outputs.shape \
        else targets
    if predicted.shape != truth.shape:
        log.warning("the predicted classes %s and the targets %s differ in shape: no accuracy",
                    tuple(predicted.shape), tuple(truth.shape))
        return {}
    return {"accuracy": float((predicted == truth).double().mean())}


def split_metrics(kind: str | None, own: Mapping[str, Callable[[Any, Any], Any]],
                  outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """The metrics of a whole test split from its concatenated outputs and targets.

    Raises:
        InvalidArgumentError: one of the factory's metrics raised or gave no number.
    """
    out: dict[str, float] = {}
    if kind in ("logits", "probs"):
        out.update(_binary(kind, outputs, targets))
    elif kind == "classes":
        out.update(_accuracy(outputs, targets))
    for name, fn in own.items():
        try:
            out[name] = float(fn(outputs, targets))
        except Exception as exc:  # noqa: BLE001 - the user's function, named in the message
            raise InvalidArgumentError(
                f"The model factory's metric {name!r} failed on the test split's outputs "
                f"{tuple(outputs.shape)} and targets {tuple(targets.shape)}: {exc}. It is "
                "called once as fn(outputs, targets) with CPU tensors and returns a number."
            ) from None
    return out
