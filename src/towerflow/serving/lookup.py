"""Local lookup modules that take a served table's place in the user's model.

Both are called as the module they replace (``nn.Embedding``, ``nn.EmbeddingBag`` or a
table of the ps tasks): ``forward(input, offsets=None, per_sample_weights=None)``, with
``mode=None`` one row per id and ``sum`` / ``mean`` / ``max`` bags otherwise (2-D ids one
bag per row; 1-D ids with ``offsets``). Their values are the table's as a ps worker gathers
them, and both go through ``torch.export.export`` with a dynamic batch size.

- :class:`FixedLookup`: a fixed-size table, ``weight`` ``(num_rows, dim)`` (a parameter that
  does not require grad, as a frozen ``nn.Embedding``'s).
- :class:`DynamicLookup`: a table of any int64 ids: ``keys`` (sorted) and ``rows``, an id
  found with ``torch.searchsorted``; an id the table does not hold is answered with its
  ``default`` row (zeros unless the table declares another).

Example:
    >>> import torch
    >>> table = DynamicLookup(torch.tensor([3, 10**12]), torch.tensor([[1.0], [2.0]]))
    >>> table(torch.tensor([[10**12, 5]])).tolist()
    [[[2.0], [0.0]]]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 - PyTorch's own convention
from torch import nn

from towerflow.errors import InvalidArgumentError

__all__ = ["BAG_MODES", "DynamicLookup", "FixedLookup"]

BAG_MODES = ("sum", "mean", "max")


def _check_mode(mode: str | None) -> None:
    if mode is not None and mode not in BAG_MODES:
        raise InvalidArgumentError(f"A served table's mode is {mode!r}; use None or one of "
                                   f"{list(BAG_MODES)}.")


def _gather(index: torch.Tensor, rows: torch.Tensor, mode: str | None,
            offsets: torch.Tensor | None, per_sample_weights: torch.Tensor | None
            ) -> torch.Tensor:
    """The lookup of ``index`` (row numbers of ``rows``): the values a ps worker computes
    (a bag may sum in another order: equal to a float's rounding)."""
    if mode is None:
        if offsets is not None or per_sample_weights is not None:
            raise InvalidArgumentError("offsets and per_sample_weights need a bag mode; this "
                                       "table looks up one row per id.")
        return F.embedding(index, rows)
    return F.embedding_bag(index, rows, offsets, mode=mode,
                           per_sample_weights=per_sample_weights)


class FixedLookup(nn.Module):
    """A fixed-size table served from one local weight.

    Args:
        weight: ``(num_rows, dim)`` rows (kept, not copied).
        mode: None (one row per id) or ``sum`` / ``mean`` / ``max``.

    Example:
        >>> import torch
        >>> FixedLookup(torch.eye(3), mode="sum")(torch.tensor([[0, 2]])).tolist()
        [[1.0, 0.0, 1.0]]
    """

    def __init__(self, weight: torch.Tensor, mode: str | None = None) -> None:
        super().__init__()
        _check_mode(mode)
        if weight.dim() != 2:
            raise InvalidArgumentError(f"FixedLookup: weight of shape {tuple(weight.shape)}; "
                                       "give (num_rows, dim) rows.")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.mode = mode
        self.num_rows, self.dim = int(weight.shape[0]), int(weight.shape[1])

    def extra_repr(self) -> str:
        bag = "" if self.mode is None else f", mode={self.mode!r}"
        return f"{self.num_rows}, {self.dim}{bag}"

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,  # noqa: A002
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        return _gather(input, self.weight, self.mode, offsets, per_sample_weights)


class DynamicLookup(nn.Module):
    """A table of any int64 ids served from sorted keys and their rows.

    Args:
        keys: ``(n,)`` int64 ids, strictly increasing.
        rows: ``(n, dim)`` their rows.
        mode: None (one row per id) or ``sum`` / ``mean`` / ``max``.
        default: ``(dim,)`` the row of an id the table does not hold; None: zeros.

    The lookup finds each id with ``torch.searchsorted`` and takes its row, or the
    default row (kept as row ``n`` of the ``rows`` buffer) where the key differs.
    """

    def __init__(self, keys: torch.Tensor, rows: torch.Tensor, mode: str | None = None,
                 default: torch.Tensor | None = None) -> None:
        super().__init__()
        _check_mode(mode)
        if keys.dtype != torch.int64 or keys.dim() != 1 or rows.dim() != 2 \
                or rows.shape[0] != keys.shape[0]:
            raise InvalidArgumentError(
                f"DynamicLookup: keys {keys.dtype} {tuple(keys.shape)} and rows "
                f"{tuple(rows.shape)}; give int64 keys (n,) and rows (n, dim).")
        if keys.numel() > 1 and not bool((keys[1:] > keys[:-1]).all()):
            raise InvalidArgumentError("DynamicLookup: keys are not strictly increasing; sort "
                                       "them (and their rows) and drop repeated ids.")
        dim = int(rows.shape[1])
        default = torch.zeros(dim, dtype=rows.dtype) if default is None else default
        if tuple(default.shape) != (dim,):
            raise InvalidArgumentError(f"DynamicLookup: default of shape "
                                       f"{tuple(default.shape)}; give ({dim},).")
        self.mode, self.dim, self.num_keys = mode, dim, int(keys.numel())
        # an empty table still has one key to compare with; it never matches (see forward)
        self.register_buffer("keys", keys if keys.numel() else torch.zeros(1, dtype=torch.int64))
        self.register_buffer("rows", torch.cat([rows, default.to(rows.dtype)[None]]))

    def extra_repr(self) -> str:
        bag = "" if self.mode is None else f", mode={self.mode!r}"
        return f"{self.num_keys} keys, {self.dim}{bag}"

    def index_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's row number in ``rows`` (``num_keys``: the default row)."""
        ids = ids.to(torch.int64)
        place = torch.searchsorted(self.keys, ids).clamp_(max=self.keys.numel() - 1)
        found = self.keys[place] == ids
        if self.num_keys == 0:
            found = torch.zeros_like(found)
        return torch.where(found, place, torch.full_like(place, self.num_keys))

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,  # noqa: A002
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        return _gather(self.index_of(input), self.rows, self.mode, offsets, per_sample_weights)
