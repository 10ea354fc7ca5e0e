"""DeepFM (Guo et al., 2017) as its authors write it: one embedding per field, FM + MLP.

Every categorical field has its own ``nn.Embedding`` of ``dim`` values per
row (the factorization machine's latent vectors, shared with the deep part)
and its own ``nn.Embedding`` of one value per row (the FM's first-order
weights). An example's log-odds is::

    bias + first-order weights + dense linear
         + sum over field pairs <v_i, v_j>        (FM second order)
         + MLP(concat(v_1 .. v_F, dense))         (deep part)

trained with binary cross entropy (:func:`deepfm_loss`). A field given as
``(batch, L)`` ids holds several values per example (a movie's genres): its
vector is the sum of its rows, id 0 padding (no row). The tables are plain
``nn.Embedding`` modules, with ``sparse=True`` by default (a batch's gradient
holds the touched rows only, which ``torch.optim.SGD``, ``Adagrad`` and
``SparseAdam`` apply as such); a parameter-server run applies its own rule
to them as to any user's embeddings.

Example:
    >>> import torch
    >>> model = DeepFM([10, 5, 7], dim=4, dense_features=2, hidden=(8,))
    >>> fields = [torch.tensor([1, 2]), torch.tensor([0, 4]), torch.tensor([[1, 2], [3, 0]])]
    >>> tuple(model(fields, torch.zeros(2, 2)).shape)
    (2,)
    >>> float(deepfm_loss(model, (fields, torch.zeros(2, 2), torch.tensor([1.0, 0.0])))) > 0
    True
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["DeepFM", "deepfm_loss"]


class DeepFM(nn.Module):
    """Click log-odds of categorical id fields (and dense features): FM + MLP.

    Args:
        field_rows: each field's table rows (its ids are ``0 .. rows - 1``).
        dim: values per row of the fields' vectors.
        dense_features: how many dense features each example has (0: none).
        hidden: widths of the MLP's hidden layers.
        sparse: ``sparse=True`` embeddings (row-sparse gradients).
        init_std: standard deviation of the tables' normal initialisation.
    """

    def __init__(self, field_rows: Sequence[int], dim: int = 16, *, dense_features: int = 0,
                 hidden: Sequence[int] = (200, 200, 200), sparse: bool = True,
                 init_std: float = 0.01) -> None:
        super().__init__()
        self.embeddings = nn.ModuleList(nn.Embedding(int(n), dim, sparse=sparse)
                                        for n in field_rows)
        self.weights = nn.ModuleList(nn.Embedding(int(n), 1, sparse=sparse) for n in field_rows)
        for table in (*self.embeddings, *self.weights):
            nn.init.normal_(table.weight, std=init_std)
        self.bias = nn.Parameter(torch.zeros(1))
        self.dense = nn.Linear(dense_features, 1) if dense_features else None
        layers: list[nn.Module] = []
        width = len(field_rows) * dim + dense_features
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        self.mlp = nn.Sequential(*layers, nn.Linear(width, 1))

    @staticmethod
    def _lookup(table: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        """``(batch, width)`` rows of ``ids``; a bag of ids ``(batch, L)`` sums its nonzero ones."""
        if ids.dim() == 1:
            return table(ids)
        return (table(ids) * (ids != 0).unsqueeze(-1)).sum(1)

    def forward(self, fields: Sequence[torch.Tensor],
                dense: torch.Tensor | None = None) -> torch.Tensor:
        """The log-odds of each example (``fields``: one id tensor per field)."""
        vectors = torch.stack([self._lookup(t, ids) for t, ids in
                               zip(self.embeddings, fields, strict=True)], dim=1)
        first = torch.cat([self._lookup(t, ids) for t, ids in
                           zip(self.weights, fields, strict=True)], dim=1).sum(1)
        square_of_sum = vectors.sum(1).pow(2)
        sum_of_squares = vectors.pow(2).sum(1)
        second = 0.5 * (square_of_sum - sum_of_squares).sum(1)
        deep_in = vectors.flatten(1)
        logit = self.bias + first + second
        if self.dense is not None and dense is not None:
            logit = logit + self.dense(dense).squeeze(1)
            deep_in = torch.cat([deep_in, dense], dim=1)
        return logit + self.mlp(deep_in).squeeze(1)


def deepfm_loss(model: nn.Module,
                batch: tuple[Sequence[torch.Tensor], torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean binary cross entropy of the model's log-odds against the 0/1 labels."""
    fields, dense, labels = batch
    return nn.functional.binary_cross_entropy_with_logits(model(fields, dense), labels)
