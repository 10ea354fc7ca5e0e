"""The lookups of tables fused on the ps, done as one lookup on the worker.

A model with a table per field looks each one up apart: per table and step a
gather, a leaf that requires grad, its gradient in the backward, its ids taken
apart from the others' and put back together for the push. That per-table cost
is what separates a 52-table DeepFM from the same model with its fields fused
by hand into two tables (TorchRec's batched tables remove it the same way).

The rows of tables fused on the ps (:mod:`~towerflow.ps.worker.tables.fusion`)
arrive together already (:func:`~towerflow.ps.worker.tables.prefetch.pull_ahead`).
A :class:`RowGroup` keeps them together: one leaf holds every member's rows,
one ``index_select`` gathers every member's lookup at once, cut per member, so
that the backward has the same three nodes whatever the number of tables; the
step's push is the leaf's gradient against the fused ids as they were pulled
(:func:`take_groups`), one item per fused table.

A member whose lookup is not a plain gather (a ``max`` bag, offsets, weights),
whose ids were not the predicted ones, or that runs on another device or grad
mode than the group was made in looks up its own rows (:meth:`RowGroup.apart`),
as a table alone does; the group then pushes member by member.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

__all__ = ["Pulled", "RowGroup", "GroupPush", "bag_of", "grouped_lookup", "plain_gather",
           "take_groups", "to_host", "host_ready", "kept_rows"]


class Pulled(NamedTuple):
    """The rows pulled for one lookup: the unique ids, each id's place among them, the rows."""

    unique: torch.Tensor
    inverse: torch.Tensor
    rows: torch.Tensor


class RowGroup:
    """The rows pulled for several tables fused on the ps, looked up as one.

    Made when the rows arrive; its leaf at the first member's lookup, on that
    lookup's device and in its grad mode.

    Args:
        table: the fused table on the ps (a ``TableConfig``).
        together: the fused ids pulled, sorted and unique (``rows``' ids).
        rows: ``(len(together), dim)``.
        inverse: each looked-up id's row, the members' ids one after the other.
        sizes: how many ids each member looks up.
        bounds: each member's ``(first, last)`` row of ``rows``.
        offsets: each member's first id in the fused table.
    """

    def __init__(self, table: Any, together: torch.Tensor, rows: torch.Tensor,
                 inverse: torch.Tensor, sizes: list[int], bounds: list[tuple[int, int]],
                 offsets: Sequence[int]) -> None:
        self.table, self.together, self.rows, self.inverse = table, together, rows, inverse
        self.sizes, self.bounds, self.offsets = sizes, bounds, list(offsets)
        self.starts = [0]
        for size in sizes[:-1]:
            self.starts.append(self.starts[-1] + size)
        #: the rows on the lookups' device (requiring grad when made with grad)
        self.leaf: torch.Tensor | None = None
        self._parts: tuple[torch.Tensor, ...] = ()
        self._grad = False
        #: how many times each member took its part of the gather
        self.taken = [0] * len(sizes)

    def part(self, member: int, device: torch.device) -> torch.Tensor | None:
        """Member ``member``'s gathered rows ``(its ids, dim)``, or None (another device or
        grad mode than the group's).

        The parts are cut with ``unsafe_split_with_sizes``: a part may be changed
        in place like the output of any lookup.
        """
        grad = torch.is_grad_enabled()
        if self.leaf is None:  # its own tensor: a member's lookup apart slices ``rows``
            leaf = self.rows.to(device, non_blocking=True)  # pinned rows: without waiting
            if leaf is self.rows:
                leaf = leaf.detach()
            self.leaf = leaf.requires_grad_(True) if grad else leaf
            self._grad = grad
            self._parts = torch.unsafe_split_with_sizes(
                self.leaf.index_select(0, self.inverse.to(device)), self.sizes)
        if self.leaf.device != device or self._grad != grad:
            return None
        self.taken[member] += 1
        return self._parts[member]

    def apart(self, member: int) -> Pulled:
        """Member ``member``'s own unique ids, inverse and rows, for a lookup of its own."""
        first, last = self.bounds[member]
        start = self.starts[member]
        return Pulled(self.ids_of(member), self.inverse[start:start + self.sizes[member]] - first,
                      self.rows[first:last])

    def ids_of(self, member: int) -> torch.Tensor:
        """Member ``member``'s ids of the rows it pulled (its own numbering)."""
        first, last = self.bounds[member]
        return self.together[first:last] - self.offsets[member]

    def grad_of(self, member: int) -> torch.Tensor | None:
        """The gradient of member ``member``'s rows (None: no backward reached them)."""
        if self.leaf is None or self.leaf.grad is None:
            return None
        first, last = self.bounds[member]
        return self.leaf.grad[first:last]


def plain_gather(mode: str | None, ids: torch.Tensor, offsets: torch.Tensor | None,
                 per_sample_weights: torch.Tensor | None) -> bool:
    """Whether a lookup of ``ids`` is rows gathered and, for a bag, summed or averaged over
    its second dimension (:func:`bag_of`): no ``max`` bag, offsets or weights."""
    return mode is None or (mode in ("sum", "mean") and ids.dim() == 2 and offsets is None
                            and per_sample_weights is None)


def bag_of(picked: torch.Tensor, mode: str | None) -> torch.Tensor:
    """A plain gather's output from its gathered rows ``(*ids.shape, dim)``."""
    if mode is None:
        return picked
    return picked.sum(1) if mode == "sum" else picked.mean(1)


def grouped_lookup(group: RowGroup, member: int, mode: str | None, dim: int,
                   input: torch.Tensor, offsets: torch.Tensor | None,  # noqa: A002
                   per_sample_weights: torch.Tensor | None, limit: int) -> torch.Tensor | None:
    """A lookup's output from its group's gather, or None where it is not a plain gather
    (``max`` bags, offsets, weights, more than ``limit`` values), on a device other than a
    CPU or GPU, or the group was made on another device or grad mode."""
    if not plain_gather(mode, input, offsets, per_sample_weights) \
            or input.numel() * dim > limit or input.device.type not in ("cpu", "cuda"):
        return None  # (another backend may have no strided views to cut the gather with)
    part = group.part(member, input.device)
    return None if part is None else bag_of(part.view(*input.shape, dim), mode)


class GroupPush:
    """The push of a whole :class:`RowGroup`: its fused table, as one table's push.

    Stands where :meth:`~towerflow.ps.worker.tables.sparse_tables.SparseTables.take` puts a table module (``config``,
    ``defer_push``, ``dim``, ``dtype``).
    """

    def __init__(self, group: RowGroup, members: Sequence[Any]) -> None:
        self.group, self.members = group, list(members)
        self.config = group.table
        self.defer_push = members[0].defer_push
        self.dim, self.dtype = members[0].dim, members[0].dtype
        #: which of the group's rows are pushed (None: all; a padding row is not)
        self.kept: torch.Tensor | None = None

    def name_of(self, grads: torch.Tensor) -> str:
        """The member whose rows of the pushed ``grads`` hold NaN / inf (the fused table's
        name if none)."""
        done = 0
        for module, (first, last) in zip(self.members, self.group.bounds, strict=True):
            count = last - first if self.kept is None else int(self.kept[first:last].sum())
            if not bool(torch.isfinite(grads[done:done + count]).all()):
                return module.config.name
            done += count
        return self.config.name


_copies = threading.local()


def to_host(grads: torch.Tensor) -> torch.Tensor:
    """``grads`` on the CPU: from a GPU into pinned memory, copied without waiting (read it
    after :func:`host_ready`), else as it is."""
    if grads.device.type != "cuda":
        return grads.cpu()
    out = torch.empty(grads.shape, dtype=grads.dtype, pin_memory=True)
    out.copy_(grads, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(grads.device))
    _copies.__dict__.setdefault("events", []).append(done)
    return out


def host_ready() -> None:
    """Wait for the copies :func:`to_host` started in this thread (once for all of them)."""
    events = _copies.__dict__.get("events")
    while events:
        events.pop().synchronize()


def kept_rows(ids: torch.Tensor, grads: torch.Tensor,
              keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``ids`` (host) and ``grads`` (any device) where ``keep`` (host, bool) holds: an
    index, not a mask, for the gradients, so that a GPU's are not waited for."""
    where = keep.nonzero().squeeze(1)
    return ids.index_select(0, where), grads.index_select(0, where.to(grads.device))


def take_groups(modules: Sequence[Any]) -> list[tuple[GroupPush, torch.Tensor, torch.Tensor]]:
    """(Their gradients copied off a GPU without waiting: :func:`host_ready`.) The pushes of the groups whose every member looked up its rows once through the
    group and nothing else: one ``(GroupPush, fused ids, gradients)`` per group, against
    the fused ids as pulled (a member's ``padding_idx`` row left out); those members'
    lookups are taken. The other members push as tables alone."""
    found: dict[int, tuple[RowGroup, dict[int, Any]]] = {}
    for module in modules:
        touched = module.touched
        if len(touched) != 1 or not isinstance(touched[0][1], tuple):
            continue
        group, member = touched[0][1]
        if group.taken[member] == 1:
            found.setdefault(id(group), (group, {}))[1][member] = module
    out = []
    for group, members in found.values():
        if len(members) != len(group.sizes) or group.leaf is None or group.leaf.grad is None:
            continue
        ordered = [members[k] for k in range(len(group.sizes))]
        ids, grads = group.together, group.leaf.grad.detach()
        pads = [offset + m.padding_idx for m, offset in zip(ordered, group.offsets, strict=True)
                if m.padding_idx is not None]
        push = GroupPush(group, ordered)
        if pads:  # the padding rows take no update
            keep = ~torch.isin(ids, torch.tensor(pads, dtype=ids.dtype))
            ids, grads = kept_rows(ids, grads, keep)
            push.kept = keep
        for module in ordered:
            module.forget()
        out.append((push, ids, to_host(grads)))
    return out
