"""A click-through model: one large embedding bag of hashed feature ids, a linear and an MLP head.

``ClickNet`` sums the rows of an example's ids (``nn.EmbeddingBag``, mode
``sum``) and scores the sum with a linear term plus a small MLP; the output
is the click's log-odds, trained with :func:`click_loss` (binary cross
entropy). The table is a plain ``nn.EmbeddingBag``: in one process it trains
as any module (with ``sparse_gradients=True`` its gradient holds the touched
rows only, which ``torch.optim.SGD`` and ``Adagrad`` apply as such); under the
``ParameterServer`` strategy (``sparse=True``, or ``sparse_threshold_bytes``
at most its size) the strategy swaps it for a table row-sharded over the ps
tasks, and a model
built with ``table_device="meta"`` never allocates it on the worker at all.

Example:
    >>> import torch
    >>> model = ClickNet(1000, 8, hidden=16)
    >>> ids = torch.randint(0, 1000, (4, 3))
    >>> tuple(model(ids).shape)
    (4,)
    >>> float(click_loss(model, (ids, torch.ones(4)))) > 0
    True
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ClickNet", "click_loss"]


class ClickNet(nn.Module):
    """Click log-odds of bags of ids: ``linear(sum of rows) + mlp(sum of rows)``.

    Args:
        num_rows: rows of the table (ids are ``0 .. num_rows - 1``).
        dim: values per row.
        hidden: width of the MLP's hidden layer.
        sparse_gradients: the table's gradient holds the touched rows only
            (``nn.EmbeddingBag(sparse=True)``; ``torch.optim.Adam`` refuses it).
        table_device: where the table's weight is allocated; ``"meta"`` for a
            table that a strategy replaces before training (no memory at all).
    """

    def __init__(self, num_rows: int, dim: int, *, hidden: int = 32,
                 sparse_gradients: bool = False, table_device: str | None = None) -> None:
        super().__init__()
        self.table = nn.EmbeddingBag(num_rows, dim, mode="sum", sparse=sparse_gradients,
                                     device=table_device)
        if table_device != "meta":
            with torch.no_grad():
                self.table.weight.uniform_(-0.05, 0.05)
        else:  # the same start, drawn per id by the ps tasks that hold the table
            self.table.towerflow_initializer = {"kind": "uniform", "minval": -0.05,
                                                "maxval": 0.05, "seed": 0}
        self.linear = nn.Linear(dim, 1)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The click log-odds of each example (``ids``: ``(batch, ids per example)``)."""
        bag = self.table(ids)
        return (self.linear(bag) + self.mlp(bag)).squeeze(1)


def click_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean binary cross entropy of the model's log-odds against the 0/1 clicks."""
    ids, clicks = batch
    return nn.functional.binary_cross_entropy_with_logits(model(ids), clicks)
