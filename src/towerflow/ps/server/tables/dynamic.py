"""A dynamic table's shard: any int64 id, rows made on first touch, admission, eviction.

:class:`DynamicRowStore` is a :class:`~towerflow.ps.server.tables.rows.RowStore`
(look up, apply, export / import), so the wire, the worker, the
aggregation modes and the row-wise optimizers are the fixed table's. What
differs is where a row lives:

- a :class:`~towerflow.ps.server.tables.keyindex.KeyIndex` maps each id
  held to a slot; the rows, each optimizer slot and the row's last update
  step (its *version*, int32) are tensors indexed by slot, grown by a
  quarter when full, slots freed by eviction reused first;
- a lookup of an id with no row answers the initializer's value for that
  id (a function of id and seed: the same on every worker, before and
  after the row exists) and stores nothing;
- an update (:meth:`DynamicRowStore.apply`) makes the rows of its ids that
  are admitted and have none, from the initializer, slots at their
  initial values, then applies the optimizer to them all;
- admission (``admit_after=N``): :meth:`DynamicRowStore.observe` counts the
  pushes that carried each id (the shard calls it once per new push, so a
  retried push is not counted twice and the counts of every worker add
  up), in a second, small key index of counters that holds no row; an id
  is admitted at its ``N``-th push, and until then its gradients are
  dropped (counted as ``filtered``);
- eviction: ``evict_after_steps=S`` removes the rows not updated in the
  last ``S`` steps (the clock is the largest ``step`` applied): each update
  scans the next 65,536 slots (a bounded window; a sweep of the shard goes
  round), so a stale row goes within ``S`` steps and one sweep; the
  admission counters of ids not seen for ``S`` steps go alike.
  ``capacity`` keeps at most its share of rows (``ceil(capacity /
  num_shards)``), evicting the least recently updated first (a ``topk``
  of the slots' versions), down to 1/32 below the share so that selection
  is paid once per ``share / 32`` new rows. A row's slots go with it.
  Eviction runs inside an update and is paused while an export is under
  way (so the slots an export plans to read stay theirs).

Stats (:meth:`DynamicRowStore.stats`): ``rows`` held, ``admitted`` (rows
made), ``evicted``, ``filtered`` (gradients dropped before admission),
``bytes``.

Example:
    >>> import torch
    >>> from towerflow.ps.partition import HashPartitioner
    >>> from towerflow.ps.spec.row_optimizers import SparseSGD
    >>> store = DynamicRowStore(HashPartitioner(1), 0, 2, SparseSGD())
    >>> store.lookup(torch.tensor([-5])).tolist(), store.num_rows
    ([[0.0, 0.0]], 0)
    >>> store.observe(torch.tensor([-5])); store.apply(torch.tensor([-5]), torch.ones(1, 2), 0.5, 1)
    >>> store.lookup(torch.tensor([-5])).tolist(), store.num_rows
    ([[-0.5, -0.5]], 1)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from towerflow.errors import InvalidArgumentError
from towerflow.ps.partition import Partitioner, coalesce
from towerflow.ps.server.tables.keyindex import KeyIndex
from towerflow.ps.server.tables.rows import RowExport, RowStore
from towerflow.ps.spec.initializers import RowInitializer
from towerflow.ps.spec.row_optimizers import SparseOptimizer
from towerflow.ps.spec.tables import check_options

__all__ = ["DynamicRowStore"]

_NEVER = torch.iinfo(torch.int32).max  # the version of a free slot
#: slots an update scans for rows (and counters) too old (a sweep of the shard goes round)
_SCAN = 1 << 16
#: lookups whose slots are kept for the pushes that follow them (about one per worker)
_RECENT = 8


class DynamicRowStore(RowStore):
    """The rows of one shard of a dynamic table (see the module docstring).

    Args:
        partitioner: the table's partitioner; unbounded (``num_rows`` None).
        shard: this shard's index.
        dim: values per row.
        optimizer: the row-wise optimizer.
        dtype: ``torch.float32`` (default) or ``torch.float64``.
        initializer: a row's value before its first update (zeros by default).
        options: ``{"admit_after", "evict_after_steps", "capacity"}``
            (:func:`check_options`; ``capacity`` is the whole table's).
    """

    kind: ClassVar[str] = "dynamic"

    def __init__(self, partitioner: Partitioner, shard: int, dim: int,
                 optimizer: SparseOptimizer, *, dtype: torch.dtype = torch.float32,
                 initializer: RowInitializer | None = None,
                 options: Mapping[str, Any] | None = None) -> None:
        super().__init__(partitioner, shard, dim, optimizer, dtype=dtype,
                         initializer=initializer)
        if partitioner.num_rows is not None:
            raise InvalidArgumentError(
                f"A dynamic row store holds any int64 id, but {partitioner!r} bounds the table "
                "to num_rows; use HashPartitioner(num_shards)."
            )
        self.options = check_options(options or {"admit_after": 1, "evict_after_steps": None,
                                                 "capacity": None})
        capacity = self.options["capacity"]
        #: most rows this shard keeps (None: no bound)
        self.share = None if capacity is None else -(-capacity // partitioner.num_shards)
        self._index = KeyIndex(on_grow=self._grow)
        self._rows = torch.empty((self._index.keys.numel(), dim), dtype=dtype)
        self._slots = optimizer.init_slots(self._index.keys.numel(), dim, dtype)
        self._version = torch.zeros(self._index.keys.numel(), dtype=torch.int32)
        self._counts = KeyIndex(on_grow=self._grow_counts)  # admission: id -> counter slot
        self._count = torch.zeros(self._counts.keys.numel(), dtype=torch.int32)
        self._seen = torch.zeros(self._counts.keys.numel(), dtype=torch.int32)
        self.clock = 0
        self._cursor = {"rows": 0, "counters": 0}  # where the next age scan starts
        #: the slots of the last few lookups, while no row has been removed since: a push's
        #: ids are mostly those its worker pulled the step before (one probe saved)
        self._recent: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._exporting = 0
        self.counters = {"admitted": 0, "evicted": 0, "filtered": 0}
        #: the ids whose row or admission counter went with no push naming them (evicted,
        #: aged out), kept while the shard's replica copies its changes (None: not kept)
        self.noted: list[torch.Tensor] | None = None

    # -- storage ---------------------------------------------------------------------------
    def _grow(self, size: int) -> None:
        used = self._index.used
        rows = torch.empty((size, self.dim), dtype=self.dtype)
        rows[:used] = self._rows[:used]
        self._rows = rows
        for name, slot in list(self._slots.items()):
            grown = torch.empty((size, self.dim), dtype=self.dtype)
            grown[:used] = slot[:used]
            self._slots[name] = grown
        version = torch.zeros(size, dtype=torch.int32)
        version[:used] = self._version[:used]
        self._version = version

    def _grow_counts(self, size: int) -> None:
        used = self._counts.used
        for name in ("_count", "_seen"):
            grown = torch.zeros(size, dtype=torch.int32)
            grown[:used] = getattr(self, name)[:used]
            setattr(self, name, grown)

    @property
    def num_rows(self) -> int:
        return self._index.live

    @property
    def nbytes(self) -> int:
        per_slot = self.dim * self._rows.element_size() * (1 + len(self._slots)) + 4
        return (self._index.keys.numel() * per_slot + self._index.nbytes
                + self._counts.nbytes + self._count.numel() * 8)

    def stats(self) -> dict[str, int]:
        """``{"rows", "admitted", "evicted", "filtered", "bytes"}`` of this shard."""
        return {"rows": self.num_rows, **self.counters, "bytes": self.nbytes}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "options": dict(self.options)}

    # -- checks ----------------------------------------------------------------------------
    def _checked_ids(self, ids: object, checked: bool) -> torch.Tensor:
        if checked:
            return ids  # type: ignore[return-value]
        self.partitioner.local_index(ids, self.shard)  # type: ignore[arg-type]
        return ids  # type: ignore[return-value]

    # -- the interface ---------------------------------------------------------------------
    def _find(self, ids: torch.Tensor) -> torch.Tensor:
        """The slots of ``ids`` (-1: no row), from a recent lookup of the same ids when no
        row has been removed since (its missing ids looked up again: made since)."""
        for seen, slots in self._recent:
            if seen.numel() == ids.numel() and torch.equal(seen, ids):
                slots = slots.clone()
                missing = (slots < 0).nonzero().view(-1)
                if missing.numel():
                    slots.index_copy_(0, missing, self._index.find(ids.index_select(0, missing)))
                return slots
        return self._index.find(ids)

    def lookup(self, ids: torch.Tensor, *, checked: bool = False) -> torch.Tensor:
        ids = self._checked_ids(ids, checked)
        slots = self._index.find(ids)
        self._recent = [(ids, slots), *self._recent[:_RECENT - 1]]
        present = slots >= 0
        if bool(present.all()):
            return self._rows.index_select(0, slots)
        out = self.initializer(ids, self.dim, self.dtype)  # not stored
        if bool(present.any()):
            where = present.nonzero().view(-1)
            out.index_copy_(0, where, self._rows.index_select(0, slots.index_select(0, where)))
        return out

    def observe(self, ids: torch.Tensor) -> None:
        """Count one push of each (checked) id not admitted yet (admission's counter)."""
        if self.options["admit_after"] == 1 or not ids.numel():
            return
        ids = torch.unique(ids)
        missing = ids[self._index.find(ids) < 0]
        if not missing.numel():
            return
        slots = self._counts.find(missing)
        new = slots < 0
        if bool(new.any()):
            made = self._counts.insert(missing[new])
            self._count.index_fill_(0, made, 0)
            slots[new] = made
        self._count.index_add_(0, slots, torch.ones(slots.numel(), dtype=torch.int32))
        self._seen.index_fill_(0, slots, min(self.clock, _NEVER))

    def apply(self, ids: torch.Tensor, row_grads: torch.Tensor, lr: float, step: int, *,
              checked: bool = False) -> None:
        ids = self._checked_ids(ids, checked)
        grads = row_grads if checked else self._check_values("row_grads", row_grads, ids)
        if not checked:
            lr, step = self.optimizer.check_step(lr, step)
        self.clock = max(self.clock, int(step))
        if ids.numel():
            ids, grads = coalesce(ids, grads)
            slots = self._find(ids)
            missing = slots < 0
            made = torch.empty(0, dtype=torch.int64)
            if bool(missing.any()):
                slots, grads, made = self._admit(ids, slots, missing, grads)
            if slots.numel():
                try:
                    self.optimizer.apply(self._rows, self._slots, slots, grads, lr, step)
                except InvalidArgumentError:
                    self._drop(made, evicted=False)  # nothing applied: the new rows go too
                    raise
                self._version.index_fill_(0, slots, min(self.clock, _NEVER))
        self._evict()

    def _admit(self, ids: torch.Tensor, slots: torch.Tensor, missing: torch.Tensor,
               grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Make the rows of the missing ids that are admitted; drop the others' gradients.

        Returns the slots and gradients to update and the slots made.
        """
        new_ids = ids[missing]
        admit = self._admitted(new_ids)
        keep = ~missing
        keep[missing.nonzero().view(-1)[admit]] = True
        if not bool(admit.all()):
            self.counters["filtered"] += int((~admit).sum())
            new_ids = new_ids[admit]
        made = self._index.insert(new_ids)
        if made.numel():
            self._rows.index_copy_(0, made, self.initializer(new_ids, self.dim, self.dtype))
            for name, slot in self._slots.items():
                slot.index_fill_(0, made, self.optimizer.slot_initial_value(name))
            self.counters["admitted"] += made.numel()
        slots = slots.clone()
        slots[missing.nonzero().view(-1)[admit]] = made
        return slots[keep], grads[keep], made

    def _admitted(self, ids: torch.Tensor) -> torch.Tensor:
        """Which of ``ids`` (no row yet) have been seen ``admit_after`` times; forget their
        counters."""
        need = self.options["admit_after"]
        if need == 1:
            return torch.ones(ids.numel(), dtype=torch.bool)
        slots = self._counts.find(ids)
        counted = slots >= 0
        count = torch.zeros(ids.numel(), dtype=torch.int32)
        count[counted] = self._count.index_select(0, slots[counted])
        admit = count >= need
        done = slots[admit & counted]
        self._counts.remove(done)
        self._seen.index_fill_(0, done, _NEVER)  # a free counter is never the stalest
        return admit

    def _note(self, index: KeyIndex, slots: torch.Tensor) -> None:
        if self.noted is not None and slots.numel():
            self.noted.append(index.keys.index_select(0, slots))

    def _drop(self, slots: torch.Tensor, *, evicted: bool = True) -> None:
        if slots.numel():
            self._note(self._index, slots)
            self._recent.clear()  # their slots may be another id's from now on
            self._index.remove(slots)
            self._version.index_fill_(0, slots, _NEVER)  # a free slot is never the oldest
            if evicted:
                self.counters["evicted"] += slots.numel()
            else:
                self.counters["admitted"] -= slots.numel()

    def _evict(self) -> None:
        """Evict by age (a window of slots per update) and by capacity (over the share)."""
        if self._exporting:
            return
        ttl = self.options["evict_after_steps"]
        if ttl is not None:
            old = self._age_window("rows", self._index, self._version, ttl)
            self._drop(old)
            stale = self._age_window("counters", self._counts, self._seen, ttl)
            if stale.numel():  # admission counters age out too
                self._note(self._counts, stale)
                self._counts.remove(stale)
                self._seen.index_fill_(0, stale, _NEVER)
        if self.share is not None and self._index.live > self.share:
            excess = self._index.live - (self.share - self.share // 32)
            used = self._version[:self._index.used]  # free slots hold _NEVER: never picked
            oldest = torch.topk(used, excess, largest=False, sorted=False).indices
            self._drop(oldest)
        if self.share is not None and self._counts.live > 4 * self.share + 1024:
            seen = self._seen[:self._counts.used]  # counters bounded too: the stalest go
            stale = torch.topk(seen, self._counts.live - (2 * self.share + 1024),
                               largest=False, sorted=False).indices
            self._note(self._counts, stale)
            self._counts.remove(stale)
            self._seen.index_fill_(0, stale, _NEVER)

    def _age_window(self, which: str, index: KeyIndex, stamps: torch.Tensor, ttl: int
                    ) -> torch.Tensor:
        """The slots of the next :data:`_SCAN` slots of ``index`` last stamped more than
        ``ttl`` steps ago (one update scans a bounded window; a sweep goes round)."""
        used = index.used
        if not index.live or not used:
            return torch.empty(0, dtype=torch.int64)
        start = self._cursor[which] % used
        stop = min(start + _SCAN, used)
        self._cursor[which] = 0 if stop >= used else stop
        window = stamps[start:stop]
        return (window < self.clock - ttl).nonzero().view(-1) + start

    # -- export / import -------------------------------------------------------------------
    def export(self, start: int = 0, stop: int | None = None) -> RowExport:
        plan = self.begin_export()
        try:
            return self.export_piece(plan, 0, plan[0].numel())
        finally:
            self.end_export()

    def begin_export(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids held, ascending, and their slots (16 bytes a row: no row is copied).

        Eviction waits until :meth:`end_export`, so the slots stay the ids'.
        """
        live = self._index.live_slots()
        keys, order = torch.sort(self._index.keys.index_select(0, live))
        self._exporting += 1
        return keys, live.index_select(0, order)

    def export_piece(self, plan: tuple[torch.Tensor, torch.Tensor], start: int, stop: int
                     ) -> RowExport:
        """Copies of the rows, slots and versions of ``plan``'s ids ``[start, stop)``."""
        keys, slots = plan[0][start:stop], plan[1][start:stop]
        return RowExport(keys, self._rows.index_select(0, slots),
                         {k: v.index_select(0, slots) for k, v in self._slots.items()},
                         self._version.index_select(0, slots).to(torch.int64))

    def export_counters(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The admission counters: ids not admitted yet (ascending) and their counts."""
        live = self._counts.live_slots()
        ids, order = torch.sort(self._counts.keys.index_select(0, live))
        return ids, self._count.index_select(0, live.index_select(0, order)).to(torch.int64)

    def import_counters(self, ids: torch.Tensor, counts: torch.Tensor) -> None:
        """Add ``counts`` to the admission counters of ``ids`` (owned here, unique, no row
        yet: an id that has a row is skipped)."""
        self.partitioner.local_index(ids, self.shard)
        if counts.dtype != torch.int64 or tuple(counts.shape) != (ids.numel(),) or (
                counts.numel() and int(counts.min()) < 0):
            raise InvalidArgumentError(
                f"Admission counters must be {ids.numel()} int64 counts >= 0, got "
                f"{counts.dtype} {list(counts.shape)}; import a checkpoint written by towerflow."
            )
        keep = self._index.find(ids) < 0
        ids, counts = ids[keep], counts[keep]
        slots = self._counts.find(ids)
        new = slots < 0
        if bool(new.any()):
            made = self._counts.insert(ids[new])
            self._count.index_fill_(0, made, 0)
            slots[new] = made
        self._count.index_add_(0, slots, counts.clamp(max=_NEVER).to(torch.int32))
        self._seen.index_fill_(0, slots, min(self.clock, _NEVER))

    def export_changed(self, ids: torch.Tensor
                       ) -> tuple[RowExport, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """For a replica's copy of the changes to ``ids``: the rows, slots and versions of
        those that have a row, the ids that have none (evicted, or not admitted yet), and
        the admission counters of these."""
        ids = torch.unique(ids)
        slots = self._index.find(ids)
        have = slots >= 0
        kept = slots[have]
        export = RowExport(ids[have], self._rows.index_select(0, kept),
                           {k: v.index_select(0, kept) for k, v in self._slots.items()},
                           self._version.index_select(0, kept).to(torch.int64))
        absent = ids[~have]
        counted = self._counts.find(absent)
        held = counted >= 0
        return export, absent, (absent[held], self._count.index_select(
            0, counted[held]).to(torch.int64))

    def forget(self, ids: torch.Tensor, *, rows: bool) -> None:
        """Remove the admission counters of ``ids`` and, with ``rows``, their rows (a
        replica taking its primary's changes: those ids have no row there, or their
        counters are sent again)."""
        if rows:
            slots = self._index.find(ids)
            self._drop(slots[slots >= 0])
        counted = self._counts.find(ids)
        counted = counted[counted >= 0]
        if counted.numel():
            self._counts.remove(counted)
            self._seen.index_fill_(0, counted, _NEVER)

    def end_export(self) -> None:
        """An export has ended (eviction may run again)."""
        self._exporting = max(0, self._exporting - 1)

    def import_(self, ids: torch.Tensor, rows: torch.Tensor,
                slots: Mapping[str, torch.Tensor] | None = None,
                versions: torch.Tensor | None = None) -> None:
        self.partitioner.local_index(ids, self.shard)
        rows = self._check_values("rows", rows, ids)
        given = None if slots is None else self._check_slots(slots, ids)
        unique = torch.unique(ids)
        if unique.numel() != ids.numel():
            raise InvalidArgumentError(
                "import_ got an id more than once; each id's row can be set once per import "
                "(merge the exports first)."
            )
        if versions is not None and (versions.dtype != torch.int64
                                     or tuple(versions.shape) != (ids.numel(),)):
            raise InvalidArgumentError(
                f"versions must be int64 [{ids.numel()}], got {versions.dtype} "
                f"{list(versions.shape)}."
            )
        where = self._index.find(ids)
        new = where < 0
        if bool(new.any()):
            where[new] = self._index.insert(ids[new])
        self._rows.index_copy_(0, where, rows)
        for name, slot in self._slots.items():
            if given is None:
                slot.index_fill_(0, where, self.optimizer.slot_initial_value(name))
            else:
                slot.index_copy_(0, where, given[name])
        stamp = torch.full((ids.numel(),), min(self.clock, _NEVER), dtype=torch.int32) \
            if versions is None else versions.clamp(0, _NEVER).to(torch.int32)
        self._version.index_copy_(0, where, stamp)
        if versions is not None and versions.numel():
            self.clock = max(self.clock, int(versions.max()))

    def __repr__(self) -> str:
        return (f"DynamicRowStore(shard {self.shard} of {self.partitioner!r}, {self.num_rows} "
                f"rows x {self.dim} {self.dtype}, {self.optimizer!r}, {self.options})")
